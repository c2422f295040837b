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

# Ids that become parts of storage keys and Redis keys: no separators, dots or spaces, bounded length.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
SEGMENT_ID_PATTERN = r"^[0-9]{4}-[0-9]{5}$"
# Largest segment text a render message may carry at all; the worker's own, lower bound on what the
# model can speak is `Settings.max_segment_chars`.
MESSAGE_TEXT_MAX_CHARS = 20_000


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
    text: str = Field(min_length=1, max_length=MESSAGE_TEXT_MAX_CHARS)

    @property
    def id(self) -> str:
        """Stable id within a job: chapter and position, zero-padded so ids sort in reading order."""
        return segment_id(self.chapter, self.index)


def segment_id(chapter: int, index: int) -> str:
    return f"{chapter:04d}-{index:05d}"


def parse_segment_id(seg_id: str) -> tuple[int, int]:
    """(chapter, index) of a segment id made by `segment_id`; ValueError for anything else."""
    chapter, _, index = seg_id.partition("-")
    if not (len(chapter) == 4 and len(index) == 5 and chapter.isdigit() and index.isdigit()):
        raise ValueError(f"not a segment id: {seg_id[:40]!r}")
    return int(chapter), int(index)


def segment_seed(job_id: str, seg_id: str) -> int:
    """Per-segment sampling seed derived from (job, segment): a re-rendered segment is identical."""
    return int.from_bytes(hashlib.blake2b(f"{job_id}/{seg_id}".encode(), digest_size=4).digest(), "little")


class JobSpec(Frozen):
    """The job as submitted; stored at jobs/<id>/job.json before any task is enqueued."""

    id: str = Field(pattern=JOB_ID_PATTERN)
    name: str
    voice: str
    format: AudioFormat = "wav"
    params: SynthesisParams = SynthesisParams()
    chapters: list[str]  # chapter titles, by index
    segments: list[Segment]
    created_at: float
    source: str  # the path the user submitted


class TaskSegment(Frozen):
    """A segment as a render task carries it. No storage key: the worker derives it (voxbatch/keys.py)."""

    id: str = Field(pattern=SEGMENT_ID_PATTERN)
    chapter: int = Field(ge=0, le=9999)
    text: str = Field(min_length=1, max_length=MESSAGE_TEXT_MAX_CHARS)
    seed: int = Field(ge=0, lt=2**32)

    @model_validator(mode="after")
    def _chapter_matches_id(self) -> "TaskSegment":
        if parse_segment_id(self.id)[0] != self.chapter:
            raise ValueError(f"segment {self.id} is not in chapter {self.chapter}")
        return self


class RenderTask(Frozen):
    """Payload of `voxbatch.render`: a small batch of segments of one job. Untrusted when it comes
    from the broker: the worker checks it against the job's stored spec (worker/messages.py)."""

    job_id: str = Field(pattern=JOB_ID_PATTERN)
    voice: str = Field(max_length=200)
    format: AudioFormat
    params: SynthesisParams
    segments: list[TaskSegment] = Field(min_length=1, max_length=1024)


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
    # Segments the sweeper found neither done, failed, queued nor in flight, and re-enqueued.
    swept: int = 0

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "completed_with_errors", "cancelled", "failed")
