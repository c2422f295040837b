"""Pydantic models at every boundary between producer, Redis, worker and storage.

What crosses a process boundary is one of these, serialized as JSON (Celery uses the JSON serializer
only). Audio never travels through the broker: a render task carries text and an output key.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from voxbatch.settings import AudioFormat, PresetName

# Repetition-aware sampling (RAS) as the official CosyVoice2 yaml sets it (`llm.sampling`): the one
# home of these numbers; SynthesisParams, the LLM request, the torch sampler and the vLLM processor
# all default to them.
RAS_TOP_P = 0.8  # nucleus mass
RAS_TOP_K = 25  # at most this many nucleus tokens
RAS_WIN_SIZE = 10  # recent tokens checked for repeats
RAS_TAU_R = 0.1  # a token seen >= win_size * tau_r times there is redrawn from the full softmax

JobState = Literal["queued", "running", "assembling", "completed", "completed_with_errors", "cancelled", "failed"]

# Ids that become parts of storage keys and Redis keys: no separators, dots or spaces, bounded length.
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
SEGMENT_ID_PATTERN = r"^[0-9]{4,7}-[0-9]{5,7}$"
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
    top_p: float = Field(RAS_TOP_P, gt=0.0, le=1.0)
    top_k: int = Field(RAS_TOP_K, ge=1)
    win_size: int = Field(RAS_WIN_SIZE, ge=1)
    tau_r: float = Field(RAS_TAU_R, ge=0.0, le=1.0)
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

    chapter: int = Field(ge=0)  # the item's position for a line-item batch
    index: int = Field(ge=0)  # position within the chapter
    text: str = Field(min_length=1, max_length=MESSAGE_TEXT_MAX_CHARS)  # what is spoken (normalized, lexicon applied, cast prefix removed)
    # Per-segment overrides (cast members, line items); None means the job's voice / speed / a seed
    # derived from the content (`content_seed`).
    voice: str | None = None
    speed: float | None = Field(None, gt=0.25, le=4.0)
    seed: int | None = Field(None, ge=0, lt=2**32)

    @property
    def id(self) -> str:
        """Stable id within a job: chapter and position, zero-padded so ids sort in reading order."""
        return segment_id(self.chapter, self.index)


def segment_id(chapter: int, index: int) -> str:
    return f"{chapter:04d}-{index:05d}"


def parse_segment_id(seg_id: str) -> tuple[int, int]:
    """(chapter, index) of a segment id made by `segment_id`; ValueError for anything else."""
    chapter, _, index = seg_id.partition("-")
    if not (chapter.isascii() and chapter.isdigit() and index.isascii() and index.isdigit()
            and len(seg_id) <= 15 and segment_id(int(chapter), int(index)) == seg_id):
        raise ValueError(f"not a segment id: {seg_id[:40]!r}")
    return int(chapter), int(index)


def content_seed(text: str, voice: str, params: "SynthesisParams") -> int:
    """Sampling seed derived from what is spoken, by whom and how, never from the position in the
    book: the same paragraph in an edited book (or another job) gets the same seed, so its stored
    audio can be reused (`voxbatch/reuse.py`)."""
    data = "\x1f".join([text, voice, params.model_dump_json()]).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=4, person=b"vb-seed").digest(), "little")


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
    # Delivery: mastering preset applied to chapters at assembly, and the book's metadata (tags, m4b).
    preset: PresetName = "none"
    title: str | None = None  # book title (EPUB dc:title, markdown H1, --title); None: the job name
    author: str | None = None  # EPUB dc:creator or --author
    cover_key: str | None = None  # the EPUB's cover image, stored beside the spec (keys.cover)
    # "book": chapters, book.m4b; "items": a line-item batch (.jsonl/.csv), one file per item id
    # (`spec.chapters` then holds the item ids, a segment's `chapter` its item's position).
    kind: Literal["book", "items"] = "book"
    cast: dict[str, str] = {}  # `--cast`: speaker name -> voice
    lexicon_sha256: str | None = None  # `--lexicon`: hash of its entries (they changed the spoken text)
    reuse: bool = True  # False (`--no-reuse`): render every segment even when its audio is stored

    def voice_of(self, seg: Segment) -> str:
        return seg.voice or self.voice

    def params_of(self, seg: Segment) -> SynthesisParams:
        return self.params if seg.speed is None else self.params.model_copy(update={"speed": seg.speed})

    def seed_of(self, seg: Segment) -> int:
        """The segment's sampling seed: its own (a line item's), else derived from its content."""
        return seg.seed if seg.seed is not None else content_seed(seg.text, self.voice_of(seg), self.params_of(seg))


class TaskSegment(Frozen):
    """A segment as a render task carries it. No storage key: the worker derives it (voxbatch/keys.py)."""

    id: str = Field(pattern=SEGMENT_ID_PATTERN)
    chapter: int = Field(ge=0, le=9_999_999)
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
    # Look up the content-addressed cache (cache/<hash>.<fmt>) before rendering; stored audio is
    # written to the cache either way.
    reuse: bool = True


class ManifestSegment(Frozen):
    id: str
    chapter: int
    text: str
    key: str
    start_s: float  # start within the assembled chapter or item (its file, when a chapter is split)
    duration_s: float
    voice: str = ""
    reused: bool = False  # its audio came from the content-addressed cache, not from the engine
    chapter_file: str | None = None  # key of the chapter file it is in


class ManifestChapter(Frozen):
    index: int
    title: str
    key: str | None  # None when a segment of it failed and the chapter could not be assembled
    start_s: float  # start within the book
    duration_s: float
    # Every file of the chapter in order: one, or several when a preset caps a file's length.
    files: list[str] = []


class QcLevels(Frozen):
    """Levels of one delivered file, measured on its decoded audio (voxbatch/producer/qc.py)."""

    integrated_lufs: float
    rms_db: float
    peak_dbfs: float
    true_peak_dbtp: float
    noise_floor_db: float  # RMS of the quietest 500 ms
    head_s: float  # room tone before the programme starts
    tail_s: float  # room tone after it ends
    duration_s: float


class QcRow(Frozen):
    """One chapter file's QC: its levels before and after mastering, and each rule of the preset."""

    chapter: int
    part: int  # 1-based file of the chapter (chapters over the preset's length limit are split)
    key: str
    format: AudioFormat
    sample_rate: int
    channels: int
    kbps: int | None  # constant bit rate of mp3 / m4a files
    levels: QcLevels  # the delivered file
    source_levels: QcLevels | None = None  # the chapter as assembled, before mastering
    gain_db: float | None = None  # gain mastering applied before the limiter
    checks: dict[str, bool]  # rule name -> passed
    passed: bool


class ManifestItem(Frozen):
    """One item of a line-item batch: its own output file."""

    id: str
    key: str | None  # None when a segment of it failed
    duration_s: float
    status: Literal["done", "failed"]
    error: str | None = None


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
    items: list[ManifestItem] = []  # line-item batches only (chapters is then empty)
    reused: int = 0  # segments whose audio came from the cache
    preset: PresetName = "none"
    chapter_format: AudioFormat | None = None  # chapters' format when a preset sets it (else `format`)
    title: str | None = None
    author: str | None = None
    qc: list[QcRow] = []  # one row per chapter file when a preset is set


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
    # Segments the sweeper found neither done, failed, queued nor in flight, and re-enqueued.
    swept: int = 0
    reused: int = 0  # segments taken from the content-addressed cache instead of rendered

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "completed_with_errors", "cancelled", "failed")
