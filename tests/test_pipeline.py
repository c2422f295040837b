"""The worker's double buffer and its one finishing path, in process (tone engine, local folder)."""

from __future__ import annotations

import threading
import time

import pytest

from voxbatch.producer.submit import render_tasks
from voxbatch.jobstate import MemoryJobStore
from voxbatch.models import JobSpec, Segment
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage
from voxbatch.worker.pipeline import Pipeline, backoff_s
from voxbatch.worker.tone import FAIL_MARKER, ToneEngine


class SlowStorage(LocalStorage):
    """A local folder whose writes take `delay_s` each: a deliberately slow object store."""

    def __init__(self, root, delay_s: float):
        super().__init__(root)
        self.delay_s = delay_s
        self.puts = 0

    def put(self, key, data, content_type="application/octet-stream"):
        time.sleep(self.delay_s)
        self.puts += 1
        super().put(key, data, content_type)


def make_job(n: int, text: str = "A short sentence to render.") -> JobSpec:
    segments = [Segment(chapter=0, index=i, text=f"{text} {i}") for i in range(n)]
    return JobSpec(id="job1", name="t", voice="tone", chapters=["c"], segments=segments, created_at=0.0, source="-")


def run(spec: JobSpec, storage, settings: Settings, engine=None) -> tuple[Pipeline, MemoryJobStore, float]:
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), 0.0)
    done = threading.Event()
    pipeline = Pipeline(engine or ToneEngine(max_batch=8), storage, jobs, settings, lambda _j: done.set())
    with pipeline:
        handles = [pipeline.submit(t) for t in render_tasks(spec, settings.batch_size)]
        for h in handles:
            assert h.wait(60)
    assert done.wait(5)
    return pipeline, jobs, pipeline.engine_waited_s


def test_engine_never_waits_on_slow_storage_while_the_buffer_has_room(tmp_path):
    spec = make_job(24)
    settings = Settings(output_queue_size=64, upload_threads=2, batch_size=8)
    storage = SlowStorage(tmp_path, delay_s=0.05)
    pipeline, jobs, waited = run(spec, storage, settings)
    assert waited == 0.0  # the engine never blocked on the output queue
    assert storage.puts == 24 and jobs.status("job1").done == 24


def test_engine_waits_only_when_the_buffer_is_full(tmp_path):
    spec = make_job(24)
    settings = Settings(output_queue_size=1, upload_threads=1, batch_size=8)
    pipeline, jobs, waited = run(spec, SlowStorage(tmp_path, delay_s=0.05), settings)
    assert waited > 0.2  # a full buffer back-pressures the engine
    assert jobs.status("job1").done == 24


def test_failing_segment_retried_then_recorded_failed(tmp_path):
    spec = make_job(3)
    bad = Segment(chapter=0, index=3, text=f"broken {FAIL_MARKER}")
    spec = spec.model_copy(update={"segments": [*spec.segments, bad]})
    settings = Settings(max_attempts=3, retry_backoff_ms=10, batch_size=4)
    storage = LocalStorage(tmp_path)
    _, jobs, _ = run(spec, storage, settings)
    status = jobs.status("job1")
    assert status.done == 3 and status.failed == 1 and status.state == "assembling"
    assert "asks the tone engine to fail" in status.errors[bad.id]
    assert jobs.begin_attempt("job1", bad.id) == 4  # three attempts were made
    assert not storage.exists(next(t for t in render_tasks(spec, 4)).segments[-1].key)


def test_redelivered_task_skips_stored_segments_and_records_them(tmp_path):
    spec = make_job(5)
    storage = LocalStorage(tmp_path)
    settings = Settings(batch_size=5)
    run(spec, storage, settings)
    # A second delivery to a fresh worker whose job store has never seen the segments done
    # (the first worker died after storing, before recording): nothing is rendered again.
    engine = ToneEngine()
    calls = []
    original = engine.synthesize
    engine.synthesize = lambda batch: (calls.append(len(batch)), original(batch))[1]
    _, jobs, _ = run(spec, storage, settings, engine=engine)
    assert calls == [] and jobs.status("job1").done == 5
    assert jobs.status("job1").audio_s > 0


@pytest.mark.parametrize("attempt", [1, 2, 5, 20])
def test_backoff_is_jittered_and_capped(attempt):
    values = [backoff_s(attempt, 100, 2000) for _ in range(200)]
    assert all(0 <= v <= min(2.0, 0.1 * 2 ** (attempt - 1)) for v in values)
    assert len(set(values)) > 100
