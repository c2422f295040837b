"""Pydantic models at every boundary between producer, Redis, worker and storage.

What crosses a process boundary is one of these, serialized as JSON (Celery uses the JSON serializer
only). Audio never travels through the broker: a render task carries text and an output key.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from voxbatch.settings import AudioFormat

JobState = Literal["queued", "running", "assembling", "completed", "completed_with_errors", "cancelled", "failed"]
SegmentState = Literal["pending", "done", "failed"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SynthesisParams(Frozen):
    """How a job's segments are synthesized; travels with every render task."""

    # zero_shot: voice prompt + its transcript; cross_lingual: prompt audio only; instruct2: an instruction.
    mode: Literal["zero_shot", "cross_lingual", "instruct2"] = "zero_shot"
    # Speaking rate: > 1 faster (mel is time-scaled before the vocoder).
    speed: float = Field(1.0, gt=0.25, le=4.0)
    # instruct2 only: e.g. "Speak slowly and warmly."
    instruct_text: str | None = None
    # Repetition-aware sampling (official CosyVoice2 values).
    top_p: float = Field(0.8, gt=0.0, le=1.0)
    top_k: int = Field(25, ge=1)
    win_size: int = Field(10, ge=1)
    tau_r: float = Field(0.1, ge=0.0, le=1.0)
    # Upper bound on speech tokens per segment (random weights never emit EOS: tests set this).
    max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _instruct_needs_text(self) -> "SynthesisParams":
        if self.mode == "instruct2" and not self.instruct_text:
            raise ValueError("mode='instruct2' needs instruct_text")
        if self.mode != "instruct2" and self.instruct_text:
            raise ValueError(f"instruct_text is only used with mode='instruct2', not mode={self.mode!r}")
        return self


class Chapter(Frozen):
    """One chapter of a corpus as read from its source."""

    index: int = Field(ge=0)
    title: str
    text: str
    # Where it came from, for error messages: "book.epub#chap03.xhtml", "notes.md:12".
    source: str


class Segment(Frozen):
    """One unit of synthesis: a few sentences, rendered into one audio file."""

    chapter: int = Field(ge=0)
    index: int = Field(ge=0)  # position within the chapter
    text: str = Field(min_length=1)

    @property
    def id(self) -> str:
        """Stable id within a job: chapter and position, zero-padded so ids sort in reading order."""
        return segment_id(self.chapter, self.index)


def segment_id(chapter: int, index: int) -> str:
    return f"{chapter:04d}-{index:05d}"


def segment_seed(job_id: str, seg_id: str) -> int:
    """Per-segment sampling seed derived from (job, segment): a re-rendered segment is identical."""
    return int.from_bytes(hashlib.blake2b(f"{job_id}/{seg_id}".encode(), digest_size=4).digest(), "little")


class JobSpec(Frozen):
    """The job as submitted; stored at jobs/<id>/job.json before any task is enqueued."""

    id: str
    name: str
    voice: str
    format: AudioFormat = "wav"
    params: SynthesisParams = SynthesisParams()
    chapters: list[str]  # chapter titles, by index
    segments: list[Segment]
    created_at: float
    source: str  # the path the user submitted


class TaskSegment(Frozen):
    """A segment as a render task carries it."""

    id: str
    chapter: int
    text: str
    key: str  # final storage key of the audio
    seed: int


class RenderTask(Frozen):
    """Payload of `voxbatch.render`: a small batch of segments of one job."""

    job_id: str
    voice: str
    format: AudioFormat
    params: SynthesisParams
    segments: list[TaskSegment] = Field(min_length=1)


class ManifestSegment(Frozen):
    id: str
    chapter: int
    text: str
    key: str
    start_s: float  # start within the assembled chapter
    duration_s: float


class ManifestChapter(Frozen):
    index: int
    title: str
    key: str | None  # None when a segment of it failed and the chapter could not be assembled
    start_s: float  # start within the book
    duration_s: float


class Manifest(Frozen):
    job_id: str
    name: str
    state: JobState
    sample_rate: int
    format: AudioFormat
    chapters: list[ManifestChapter]
    segments: list[ManifestSegment]
    failed: dict[str, str]  # segment id -> last error
    book_key: str | None = None


class JobStatus(Frozen):
    """What `voxbatch status` shows; read from Redis."""

    id: str
    name: str
    state: JobState
    total: int
    done: int
    failed: int
    audio_s: float
    created_at: float
    updated_at: float
    errors: dict[str, str] = {}
    reason: str | None = None  # why the job failed, when the job itself (not a segment) did

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "completed_with_errors", "cancelled", "failed")
