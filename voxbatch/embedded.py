"""`voxbatch render`: the whole pipeline in one process, a local folder for storage, no Redis.

The same pipeline and assembly as the distributed path; only the job store (in memory) and the
hand-off to assembly (a direct call instead of a Celery task) differ.

It lives beside the contract, not in either side, because it composes both: imports go one way only,
`voxbatch.producer` and `voxbatch.worker` each import the shared contract (`voxbatch/*.py`) and never
each other; this module and the CLI are the only places that use both (tests/test_layering.py).
"""

from __future__ import annotations

import threading
from pathlib import Path

from voxbatch.producer.assemble import assemble_job
from voxbatch.producer.submit import check_voices, plan_job, render_tasks, store_spec
from voxbatch.jobstate import MemoryJobStore
from voxbatch.models import Manifest, SynthesisParams
from voxbatch.settings import AudioFormat, Settings
from voxbatch.storage import LocalStorage
from voxbatch.worker.engine import Engine, build_engine
from voxbatch.worker.pipeline import Pipeline


def render_local(path: str | Path, out_dir: str | Path, voice: str, settings: Settings, *,
                 name: str | None = None, fmt: AudioFormat | None = None, params: SynthesisParams | None = None,
                 engine: Engine | None = None, on_progress=None, cast: dict[str, str] | None = None,
                 lexicon: str | Path | None = None, reuse: bool = True, title: str | None = None,
                 author: str | None = None) -> Manifest:
    """Render a corpus into `out_dir` (layout as in storage: jobs/<id>/...); returns the manifest.

    Segments are measured with the tokenizer of `settings.model_dir` unless the engine (`engine`, else
    `settings.engine`) is the tone engine or no model dir is set (`producer.submit.segment_length_fn`)."""
    storage = LocalStorage(out_dir)
    spec = plan_job(path, voice, settings, name=name, fmt=fmt, params=params,
                    engine=engine.name if engine is not None else settings.engine, cast=cast, lexicon=lexicon,
                    reuse=reuse, title=title, author=author)
    check_voices(storage, spec)
    engine = engine or build_engine(settings)
    jobs = MemoryJobStore()
    store_spec(storage, spec)
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    finished = threading.Event()
    with Pipeline(engine, storage, jobs, settings, on_job_complete=lambda _job: finished.set()) as pipeline:
        handles = [pipeline.submit(task) for task in render_tasks(spec, settings.batch_size)]
        for h in handles:
            while not h.wait(0.5):
                if on_progress is not None:
                    on_progress(jobs.status(spec.id))
    if on_progress is not None:
        on_progress(jobs.status(spec.id))
    if not finished.is_set():
        raise RuntimeError(f"job {spec.id}: pipeline stopped before every segment finished")
    return assemble_job(storage, spec, jobs.failed(spec.id), engine.sample_rate, settings, jobs.reused_ids(spec.id))
