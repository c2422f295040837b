"""Turn a corpus into a job: read, segment, store the spec, create the job state, enqueue render tasks.

Everything that can refuse the input (reading, decoding, segmenting) runs before anything is
stored, so bad input leaves storage and Redis untouched.
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
             engine: str | None = None, length_fn: Callable[[str], int] | None = None) -> JobSpec:
    """Read and segment a corpus into a job spec (nothing stored yet).

    `engine` is the engine that will render the job when the caller knows it (`voxbatch render`);
    `length_fn` overrides how text is measured, else `segment_length_fn(settings, voice, engine)`.
    """
    from voxbatch.producer.readers import read_corpus
    from voxbatch.producer.segment import segment_chapters

    path = Path(path)
    chapters = read_corpus(path)
    if length_fn is None:
        length_fn = segment_length_fn(settings, voice, engine)
    segments = segment_chapters(chapters, length_fn=length_fn)
    if not segments:
        raise SubmitError(f"{path}: no text to synthesize after segmentation")
    return JobSpec(
        id=uuid.uuid4().hex[:12], name=name or path.stem, voice=voice, format=fmt or settings.output_format,
        params=params or SynthesisParams(), chapters=[c.title for c in chapters], segments=segments,
        created_at=time.time(), source=str(path),
    )


def render_tasks(spec: JobSpec, batch_size: int, segments: list[Segment] | None = None) -> Iterator[RenderTask]:
    """The render tasks for a job (or for some of its segments), `batch_size` segments each."""
    todo = spec.segments if segments is None else segments
    for i in range(0, len(todo), batch_size):
        yield RenderTask(
            job_id=spec.id, voice=spec.voice, format=spec.format, params=spec.params,
            segments=[
                TaskSegment(id=s.id, chapter=s.chapter, text=s.text, seed=segment_seed(spec.id, s.id))
                for s in todo[i: i + batch_size]
            ],
        )


def check_voice(storage: Storage, voice: str) -> None:
    if voice not in BUILTIN_VOICES and not storage.exists(keys.voice(voice)):
        raise SubmitError(f"voice {voice!r} not found at {storage.describe(keys.voice(voice))}; "
                          f"create it with `voxbatch voice add {voice} --wav PROMPT.wav --text TRANSCRIPT`")


def store_spec(storage: Storage, spec: JobSpec) -> None:
    storage.put(keys.job_spec(spec.id), spec.model_dump_json(indent=1).encode(), "application/json")


def load_spec(storage: Storage, job_id: str) -> JobSpec:
    try:
        return JobSpec.model_validate_json(storage.get(keys.job_spec(job_id)))
    except KeyError:
        raise SubmitError(f"job {job_id!r}: no spec at {storage.describe(keys.job_spec(job_id))}") from None


def submit_job(spec: JobSpec, settings: Settings, storage: Storage, queue: str | None = None) -> str:
    """Store the spec, create the job state in Redis, enqueue its render tasks; returns the job id."""
    from voxbatch.celery_app import configure_celery, send_render
    from voxbatch.jobstate import RedisJobStore

    check_voice(storage, spec.voice)
    configure_celery(settings)
    store_spec(storage, spec)
    jobs = RedisJobStore.from_url(settings.broker_url)
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    for task in render_tasks(spec, settings.batch_size):
        send_render(task, queue or settings.render_queue)
    return spec.id
