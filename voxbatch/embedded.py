"""`voxbatch render`: the whole pipeline in one process, a local folder for storage, no Redis.

The same pipeline and assembly as the distributed path; only the job store (in memory) and the
hand-off to assembly (a direct call instead of a Celery task) differ.

It fails fast: voice, model and storage are each proven (a one-line probe render in the job's voice,
a probe write) before any segment is rendered, so a missing voice or an incompatible model is one
error at once, not N retries per segment. It resumes: the job id is derived from the planned job
(segments, voice, format, params) and the engine (`stable_job_id`), so running the same command
again finds the segments the last run stored and renders only the rest (or `resume=<job id>`
continues a stored job as it was planned). Ctrl-C stops within `STOP_GRACE_S` with `RenderInterrupted`,
keeping every segment already stored.

It lives beside the contract, not in either side, because it composes both: imports go one way only,
`voxbatch.producer` and `voxbatch.worker` each import the shared contract (`voxbatch/*.py`) and never
each other; this module and the CLI are the only places that use both (tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

from voxbatch import keys
from voxbatch.jobstate import MemoryJobStore
from voxbatch.models import JobSpec, JobStatus, Manifest, SynthesisParams
from voxbatch.producer.assemble import assemble_job
from voxbatch.producer.submit import check_voices, load_spec, plan_job, render_tasks, store_spec
from voxbatch.settings import AudioFormat, Settings
from voxbatch.storage import LocalStorage, Storage
from voxbatch.worker.engine import Engine, SynthesisRequest, build_engine
from voxbatch.worker.pipeline import Pipeline

STOP_GRACE_S = 0.5  # after Ctrl-C, how long uploads may finish before the process leaves (threads are daemons)
PROBE_TEXT = "Ready."
PROBE_MAX_TOKENS = 25


class RenderError(ValueError):
    """Render cannot start (voice, model or storage unusable); the message says which and why."""


class RenderInterrupted(Exception):
    """Ctrl-C: the job stopped with `done` of `total` segments stored; running it again resumes it."""

    def __init__(self, job_id: str, done: int, total: int):
        super().__init__(f"job {job_id}: interrupted with {done} of {total} segments stored")
        self.job_id, self.done, self.total = job_id, done, total


def stable_job_id(spec: JobSpec, engine: str, model_dir: str | None) -> str:
    """Job id from what decides the audio (segments, voice, format, params, engine, model) and the name:
    the same command on the same corpus gets the same id, so it finds what an earlier run stored."""
    content = spec.model_dump(mode="json", exclude={"id", "created_at", "source", "cover_key"})
    content["engine"], content["model_dir"] = engine, model_dir
    digest = hashlib.blake2b(json.dumps(content, sort_keys=True).encode(), digest_size=6).hexdigest()
    return f"r{digest}"


def stored_segments(storage: Storage, spec: JobSpec) -> int:
    """How many of the job's segments are already in storage."""
    stored = set(storage.list(keys.job_prefix(spec.id) + "segments/"))
    return sum(keys.segment(spec.id, s.chapter, s.index, spec.format) in stored for s in spec.segments)


def check_ready(storage: Storage, engine: Engine, spec: JobSpec) -> None:
    """Prove storage takes writes and the engine speaks the job's voice, before rendering anything."""
    probe_key = keys.job_prefix(spec.id) + ".write-probe"
    try:
        storage.put(probe_key, b"ok")
        storage.delete(probe_key)
    except OSError as e:
        raise RenderError(f"cannot write to {storage.describe(keys.job_prefix(spec.id))}: {e.strerror or e}") from None
    max_tokens = min(spec.params.max_tokens or PROBE_MAX_TOKENS, PROBE_MAX_TOKENS)
    request = SynthesisRequest("probe", PROBE_TEXT, spec.voice, 0, spec.params.model_copy(update={"max_tokens": max_tokens}))
    try:
        results = list(engine.synthesize([request]))
    except Exception as e:  # noqa: BLE001 - whatever stops the probe would stop every segment
        raise RenderError(f"the {engine.name} engine cannot render voice {spec.voice!r}: {type(e).__name__}: {e}") from None
    if not results or results[0].error:
        error = results[0].error if results else "no audio"
        raise RenderError(f"the {engine.name} engine cannot render voice {spec.voice!r}: {error}")


def render_local(path: str | Path | None, out_dir: str | Path, voice: str | None, settings: Settings, *,
                 name: str | None = None, fmt: AudioFormat | None = None, params: SynthesisParams | None = None,
                 engine: Engine | None = None, cast: dict[str, str] | None = None,
                 lexicon: str | Path | None = None, reuse: bool = True, title: str | None = None,
                 author: str | None = None, resume: str | None = None,
                 on_plan: Callable[[str, int, int], None] | None = None,
                 on_start: Callable[[JobSpec, int], None] | None = None,
                 on_progress: Callable[[JobStatus], None] | None = None) -> Manifest:
    """Render a corpus into `out_dir` (layout as in storage: jobs/<id>/...); returns the manifest.

    Segments are measured with the tokenizer of `settings.model_dir` unless the engine (`engine`, else
    `settings.engine`) is the tone engine or no model dir is set (`producer.submit.segment_length_fn`).
    `resume` continues the stored job of that id instead of planning `path`. `on_plan(stage, done, total)`
    follows the planning (`producer.submit.Progress`); `on_start(spec, already)` is told the job and how many segments were stored before this run; `on_progress` gets the job's
    status while it renders. Raises RenderError before rendering anything when voice, model or
    storage is unusable, and RenderInterrupted on Ctrl-C.
    """
    storage = LocalStorage(out_dir)
    engine_name = engine.name if engine is not None else settings.engine
    if resume is not None:
        spec = load_spec(storage, keys.check_name("job id", resume))
    else:
        if path is None or voice is None:
            raise ValueError("render needs a corpus path and a voice, or a job id to resume")
        spec = plan_job(path, voice, settings, name=name, fmt=fmt, params=params, engine=engine_name, cast=cast,
                        lexicon=lexicon, reuse=reuse, title=title, author=author, progress=on_plan)
        job_id = stable_job_id(spec, engine_name, settings.model_dir)
        cover_key = keys.cover(job_id, spec.cover_key.rsplit(".", 1)[-1]) if spec.cover_key else None
        spec = spec.model_copy(update={"id": job_id, "cover_key": cover_key})  # the cover moves with the id
    check_voices(storage, spec)
    engine = engine or build_engine(settings)
    check_ready(storage, engine, spec)
    store_spec(storage, spec)
    if on_start is not None:
        on_start(spec, stored_segments(storage, spec))
    return _run(spec, storage, engine, settings, on_progress)


def _run(spec: JobSpec, storage: Storage, engine: Engine, settings: Settings,
         on_progress: Callable[[JobStatus], None] | None) -> Manifest:
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    finished = threading.Event()
    pipeline = Pipeline(engine, storage, jobs, settings, on_job_complete=lambda _job: finished.set()).start()
    try:
        handles = [pipeline.submit(task) for task in render_tasks(spec, settings.batch_size)]
        for h in handles:
            while not h.wait(0.2):
                if on_progress is not None:
                    on_progress(jobs.status(spec.id))
    except KeyboardInterrupt:
        pipeline.abandon()
        pipeline.stop(timeout_s=STOP_GRACE_S)
        raise RenderInterrupted(spec.id, stored_segments(storage, spec), len(spec.segments)) from None
    pipeline.stop()
    if on_progress is not None:
        on_progress(jobs.status(spec.id))
    if not finished.is_set():
        raise RuntimeError(f"job {spec.id}: pipeline stopped before every segment finished")
    return assemble_job(storage, spec, jobs.failed(spec.id), engine.sample_rate, settings, jobs.reused_ids(spec.id))
