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
from voxbatch.models import Chapter, JobSpec, RenderTask, Segment, SynthesisParams, TaskSegment
from voxbatch.reuse import is_builtin_voice
from voxbatch.settings import AudioFormat, Settings
from voxbatch.storage import Storage

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
    if engine == "tone" or is_builtin_voice(voice) or not settings.model_dir:
        return None
    from voxbatch.tokenizer import CosyVoice2Tokenizer

    return CosyVoice2Tokenizer.from_model_dir(settings.model_dir).token_length


def plan_job(path: str | Path, voice: str, settings: Settings, *, name: str | None = None,
             fmt: AudioFormat | None = None, params: SynthesisParams | None = None,
             engine: str | None = None, length_fn: Callable[[str], int] | None = None,
             cast: dict[str, str] | None = None, lexicon: str | Path | None = None, reuse: bool = True,
             title: str | None = None, author: str | None = None, progress: Progress | None = None) -> JobSpec:
    """Read and segment a corpus into a job spec (nothing stored yet).

    `engine` is the engine that will render the job when the caller knows it (`voxbatch render`);
    `length_fn` overrides how text is measured, else `segment_length_fn(settings, voice, engine)`.
    A `.jsonl`/`.csv` corpus is a line-item batch (producer/items.py); `cast` maps speaker names to
    voices (producer/cast.py); `lexicon` is a .tsv/.pls file (producer/lexicon.py); `reuse=False`
    renders every segment even where the content cache holds its audio (voxbatch/reuse.py).
    `title`/`author` override the book's metadata (producer/metadata.py); with `settings.preset`
    "acx", opening and closing credits become the first and last chapters of a book (their own files).
    """
    from voxbatch.producer.items import ITEM_SUFFIXES, ItemError, read_items
    from voxbatch.producer.lexicon import load_lexicon
    from voxbatch.producer.metadata import read_metadata
    from voxbatch.producer.readers import CorpusLimits, check_corpus, read_corpus
    from voxbatch.producer.segment import segment_chapter

    path = Path(path)
    if not is_builtin_voice(voice):  # "tone:NAME" is never a storage key
        keys.check_name("voice name", voice)
    limits = CorpusLimits.from_settings(settings)
    check_corpus(path, limits)  # before the metadata reader opens an EPUB
    lex = load_lexicon(lexicon) if lexicon is not None else None
    if length_fn is None:
        length_fn = segment_length_fn(settings, voice, engine)
    kind = "items" if path.is_file() and path.suffix.lower() in ITEM_SUFFIXES else "book"
    if kind == "items":
        items = read_items(path)
        titles, segments = [], []
        for i, item in enumerate(items):
            chapter = Chapter(index=i, title=item.id, text=item.text, source=f"{path}:{item.line}")
            segs = segment_chapter(chapter, length_fn, cast=cast, lexicon=lex,
                                   **item.model_dump(include={"voice", "speed", "seed"}))
            if not segs:
                raise ItemError(f"{path}:{item.line}: item {item.id!r} has nothing to speak")
            check_segments(segs, len(segments) + len(segs), f"{path}:{item.line}", settings)
            titles.append(item.id)
            segments.extend(segs)
    else:
        chapters = read_corpus(path, limits, all_spine=settings.epub_all_spine)
    meta = read_metadata(path)  # after read_corpus, which refuses a malformed EPUB in one line
    title = title or meta.title
    author = author or meta.author
    if kind == "book":
        if settings.preset == "acx":
            chapters = credit_chapters(chapters, title or name or path.stem, author, settings)
        titles = [c.title for c in chapters]
        segments = []
        for i, chapter in enumerate(chapters):  # chapter by chapter: the limits stop a huge corpus early
            new = segment_chapter(chapter, length_fn, cast=cast, lexicon=lex)
            check_segments(new, len(segments) + len(new), chapter.source, settings)
            segments.extend(new)
            if progress is not None:
                progress("segment", i + 1, len(chapters))
    if not segments:
        raise SubmitError(f"{path}: no text to synthesize after segmentation")
    job_id = uuid.uuid4().hex[:12]
    return JobSpec(
        id=job_id, name=name or path.stem, voice=voice, format=fmt or settings.output_format,
        params=params or SynthesisParams(), chapters=titles, segments=segments,
        created_at=time.time(), source=str(path), kind=kind, cast=cast or {},
        lexicon_sha256=lex.sha256 if lex else None, reuse=reuse,
        preset=settings.preset, title=title, author=author,
        cover_key=keys.cover(job_id, meta.cover_ext) if meta.cover else None,
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


OPENING_CREDITS = "Opening Credits"
CLOSING_CREDITS = "Closing Credits"


def credit_chapters(chapters: list[Chapter], title: str, author: str | None, settings: Settings) -> list[Chapter]:
    """The book's chapters between opening and closing credits (ACX: each its own file, same voice)."""
    def fill(template: str | None, default: str) -> str:
        # Plain replacement, not str.format: the template is user text and must not reach attributes.
        if not template:
            return default
        return template.replace("{title}", title).replace("{author}", author or "")

    by = f" Written by {author}." if author else ""
    opening = fill(settings.credits_opening, f"{title}.{by}")
    closing = fill(settings.credits_closing, f"The end. {title}.{by}")
    body = [c.model_copy(update={"index": i + 1}) for i, c in enumerate(chapters)]
    return [
        Chapter(index=0, title=OPENING_CREDITS, text=opening, source="opening credits"),
        *body,
        Chapter(index=len(body) + 1, title=CLOSING_CREDITS, text=closing, source="closing credits"),
    ]


def render_tasks(spec: JobSpec, batch_size: int, segments: list[Segment] | None = None) -> Iterator[RenderTask]:
    """The render tasks for a job (or for some of its segments), `batch_size` segments each.

    A task has one voice and one set of params, so segments are grouped by those (cast members, line
    items with their own voice or speed), in reading order within a group. Seeds come from the
    content (`content_seed`) unless a line item names its own."""
    todo = spec.segments if segments is None else segments
    groups: dict[tuple[str, SynthesisParams], list[Segment]] = {}
    for s in todo:
        groups.setdefault((spec.voice_of(s), spec.params_of(s)), []).append(s)
    for (voice, params), segs in groups.items():
        for i in range(0, len(segs), batch_size):
            yield RenderTask(
                job_id=spec.id, voice=voice, format=spec.format, params=params, reuse=spec.reuse,
                segments=[
                    TaskSegment(id=s.id, chapter=s.chapter, text=s.text, seed=spec.seed_of(s))
                    for s in segs[i: i + batch_size]
                ],
            )


def check_voice(storage: Storage, voice: str) -> None:
    if not is_builtin_voice(voice) and not storage.exists(keys.voice(voice)):
        raise SubmitError(f"voice {voice!r} not found at {storage.describe(keys.voice(voice))}; "
                          f"create it with `voxbatch voice add {voice} --wav PROMPT.wav --text TRANSCRIPT`")


def spec_bytes(spec: JobSpec, settings: Settings) -> bytes:
    """job.json as stored, refused over `max_job_spec_bytes` (before anything is written)."""
    data = spec.model_dump_json(indent=1).encode()
    if len(data) > settings.max_job_spec_bytes:
        raise SubmitError(f"{spec.source}: the job spec would be {len(data):,} bytes, over the limit of "
                          f"{settings.max_job_spec_bytes:,} (VOXBATCH_MAX_JOB_SPEC_BYTES); split the corpus")
    return data




def check_voices(storage: Storage, spec: JobSpec) -> None:
    """Every voice the job speaks in (narrator, cast, line items) exists, before anything is queued."""
    for voice in dict.fromkeys([spec.voice, *spec.cast.values(), *(s.voice for s in spec.segments if s.voice)]):
        check_voice(storage, voice)


def store_spec(storage: Storage, spec: JobSpec, data: bytes | None = None) -> None:
    """The spec, and beside it the book's cover image (read again from the corpus the spec names)."""
    if spec.cover_key:
        from voxbatch.producer.metadata import read_metadata

        cover = read_metadata(spec.source).cover
        if cover:
            storage.put(spec.cover_key, cover, "image/png" if spec.cover_key.endswith(".png") else "image/jpeg")
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
    from voxbatch.celery_app import configure_celery, render_sender
    from voxbatch.jobstate import RedisJobStore

    spec_bytes(spec, settings)  # refused over the size limit before any service is touched
    storage.check()
    check_voices(storage, spec)
    jobs = RedisJobStore.from_url(settings.broker_url)
    jobs.r.ping()
    configure_celery(settings)
    with render_sender(queue or settings.render_queue) as send:
        # The job's clock starts when it is registered, ready to send, not when its corpus was read.
        spec = spec.model_copy(update={"created_at": time.time()})
        store_spec(storage, spec, spec_bytes(spec, settings))
        try:
            jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
            sent = 0
            for task in render_tasks(spec, settings.batch_size):
                send(task)
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
