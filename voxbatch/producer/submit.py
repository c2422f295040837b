"""Turn a corpus into a job: read, segment, store the spec, create the job state, enqueue render tasks.

Everything that can refuse the input (reading, decoding, segmenting, the limits in `Settings`) runs
before anything is stored, so bad input leaves storage and Redis untouched. Services are checked in
the order they are written to (voice in storage, then Redis answers, then the spec is stored), and a
failure after the spec is stored removes what was written: a service that is down leaves nothing
half-made behind. Large corpora report progress (`Progress`) while they are segmented and enqueued.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from voxbatch import keys
from voxbatch.models import JobSpec, RenderTask, Segment, SynthesisParams, TaskSegment, segment_seed
from voxbatch.settings import AudioFormat, Settings
from voxbatch.storage import Storage

# The tone engine needs no voice profile; every other voice must exist in storage.
BUILTIN_VOICES = frozenset({"tone"})

# progress(stage, done, total): stage "segment" counts chapters, "enqueue" counts segments.
Progress = Callable[[str, int, int], None]


class SubmitError(ValueError):
    pass


def segment_length_fn(settings: Settings, voice: str, engine: str | None = None) -> Callable[[str], int] | None:
    """How segmentation measures non-Chinese text (Chinese is always counted in characters, as official).

    The official rules count tokens of the model's text tokenizer, so when a model directory is known
    (`--model-dir` / `VOXBATCH_MODEL_DIR`) this is the token count of its `CosyVoice-BlankEN/`
    tokenizer (the `tokenizers` library; no torch, so the producer can do it). None, which makes
    segmentation fall back to the tokenizer-free estimate `producer.segment.estimate_tokens`, only
    for the tone engine (`engine == "tone"`, or the built-in 'tone' voice when the engine is not known
    here, as in `voxbatch submit`) or when no model directory is set (e.g. `voxbatch render` that lets
    the engine download the weights from a hub).
    """
    if engine == "tone" or voice in BUILTIN_VOICES or not settings.model_dir:
        return None
    from voxbatch.worker.cosyvoice2.tokenizer import CosyVoice2Tokenizer

    return CosyVoice2Tokenizer.from_model_dir(settings.model_dir).token_length


def plan_job(path: str | Path, voice: str, settings: Settings, *, name: str | None = None,
             fmt: AudioFormat | None = None, params: SynthesisParams | None = None,
             engine: str | None = None, length_fn: Callable[[str], int] | None = None,
             progress: Progress | None = None) -> JobSpec:
    """Read and segment a corpus into a job spec (nothing stored yet).

    `engine` is the engine that will render the job when the caller knows it (`voxbatch render`);
    `length_fn` overrides how text is measured, else `segment_length_fn(settings, voice, engine)`.
    """
    from voxbatch.producer.readers import CorpusLimits, read_corpus
    from voxbatch.producer.segment import segment_chapter

    path = Path(path)
    keys.check_name("voice name", voice)
    chapters = read_corpus(path, CorpusLimits.from_settings(settings))
    if length_fn is None:
        length_fn = segment_length_fn(settings, voice, engine)
    segments: list[Segment] = []
    for i, chapter in enumerate(chapters):
        new = segment_chapter(chapter, length_fn)
        check_segments(new, len(segments) + len(new), chapter.source, settings)
        segments.extend(new)
        if progress is not None:
            progress("segment", i + 1, len(chapters))
    if not segments:
        raise SubmitError(f"{path}: no text to synthesize after segmentation")
    return JobSpec(
        id=uuid.uuid4().hex[:12], name=name or path.stem, voice=voice, format=fmt or settings.output_format,
        params=params or SynthesisParams(), chapters=[c.title for c in chapters], segments=segments,
        created_at=time.time(), source=str(path),
    )


def check_segments(new: list[Segment], total: int, source: str, settings: Settings) -> None:
    """The job-size limits, checked chapter by chapter as segments are made (a huge corpus stops early)."""
    if total > settings.max_segments_per_job:
        raise SubmitError(f"{source}: the corpus makes more than {settings.max_segments_per_job:,} segments "
                          "(VOXBATCH_MAX_SEGMENTS_PER_JOB); split it into several jobs")
    for s in new:
        if len(s.text) > settings.max_segment_chars:
            raise SubmitError(f"{source}: segment {s.id} is {len(s.text):,} characters with no place to cut "
                              f"(limit {settings.max_segment_chars:,}, VOXBATCH_MAX_SEGMENT_CHARS): "
                              f"{s.text[:40]!r}...")


def render_tasks(spec: JobSpec, batch_size: int, segments: list[Segment] | None = None) -> Iterator[RenderTask]:
    """The render tasks for a job (or for some of its segments), `batch_size` segments each."""
    todo = spec.segments if segments is None else segments
    for i in range(0, len(todo), batch_size):
        yield RenderTask(
            job_id=spec.id, voice=spec.voice, format=spec.format, params=spec.params,
            segments=[
                TaskSegment(id=s.id, chapter=s.chapter, text=s.text, key=keys.segment(spec.id, s.chapter, s.index,
                                                                                      spec.format),
                            seed=segment_seed(spec.id, s.id))
                for s in todo[i: i + batch_size]
            ],
        )


def check_voice(storage: Storage, voice: str) -> None:
    if voice not in BUILTIN_VOICES and not storage.exists(keys.voice(voice)):
        raise SubmitError(f"voice {voice!r} not found at {storage.describe(keys.voice(voice))}; "
                          f"create it with `voxbatch voice add {voice} --wav PROMPT.wav --text TRANSCRIPT`")


def spec_bytes(spec: JobSpec, settings: Settings) -> bytes:
    """job.json as stored, refused over `max_job_spec_bytes` (before anything is written)."""
    data = spec.model_dump_json(indent=1).encode()
    if len(data) > settings.max_job_spec_bytes:
        raise SubmitError(f"{spec.source}: the job spec would be {len(data):,} bytes, over the limit of "
                          f"{settings.max_job_spec_bytes:,} (VOXBATCH_MAX_JOB_SPEC_BYTES); split the corpus")
    return data


def store_spec(storage: Storage, spec: JobSpec, data: bytes | None = None) -> None:
    storage.put(keys.job_spec(spec.id), data or spec.model_dump_json(indent=1).encode(), "application/json")


def load_spec(storage: Storage, job_id: str) -> JobSpec:
    try:
        return JobSpec.model_validate_json(storage.get(keys.job_spec(job_id)))
    except KeyError:
        raise SubmitError(f"job {job_id!r}: no spec at {storage.describe(keys.job_spec(job_id))}") from None


def submit_job(spec: JobSpec, settings: Settings, storage: Storage, queue: str | None = None,
               progress: Progress | None = None) -> str:
    """Store the spec, create the job state in Redis, enqueue its render tasks; returns the job id.

    Redis must answer before the spec is stored; if anything fails once it is stored, the spec and
    the job state are removed again (best effort: the service that failed may be the one to clean)."""
    from voxbatch.celery_app import configure_celery, send_render
    from voxbatch.jobstate import RedisJobStore

    data = spec_bytes(spec, settings)
    storage.check()
    check_voice(storage, spec.voice)
    jobs = RedisJobStore.from_url(settings.broker_url)
    jobs.r.ping()
    configure_celery(settings)
    store_spec(storage, spec, data)
    try:
        jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
        sent = 0
        for task in render_tasks(spec, settings.batch_size):
            send_render(task, queue or settings.render_queue)
            sent += len(task.segments)
            if progress is not None:
                progress("enqueue", sent, len(spec.segments))
    except BaseException:
        _undo_submit(jobs, storage, spec.id)
        raise
    return spec.id


def _undo_submit(jobs, storage: Storage, job_id: str) -> None:
    """Take back a half-made submission: the job state (queued tasks then skip) and the spec."""
    for undo in (lambda: jobs.discard(job_id), lambda: storage.delete(keys.job_spec(job_id))):
        try:
            undo()
        except Exception:  # noqa: BLE001 - the service that failed the submit may refuse this too
            pass
