"""The worker's double buffer and its one finishing path, in process (tone engine, local folder)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
import time

import pytest

from voxbatch import keys
from voxbatch import testing_services as services
from voxbatch.producer.submit import render_tasks
from voxbatch.jobstate import MemoryJobStore
from voxbatch.models import JobSpec, Segment
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage
from voxbatch.outage import backoff_s
from voxbatch.worker.pipeline import Pipeline
from voxbatch.worker.tone import FAIL_MARKER, ToneEngine

REPO = Path(__file__).resolve().parents[1]


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


def run(spec: JobSpec, storage, settings: Settings, engine=None, jobs: MemoryJobStore | None = None) -> tuple[Pipeline, MemoryJobStore, float]:
    if jobs is None:
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
    assert not storage.exists(keys.segment(spec.id, bad.chapter, bad.index, spec.format))


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


class CountingJobs(MemoryJobStore):
    """A job store that counts the done lookups the worker makes."""

    def __init__(self):
        super().__init__()
        self.is_done_calls = self.done_among_calls = 0

    def is_done(self, job_id, seg_id):
        self.is_done_calls += 1
        return super().is_done(job_id, seg_id)

    def state_and_done(self, job_id, seg_ids):
        # A task's done-set at intake (its 5 segments here) or the check before one segment's store.
        if len(seg_ids) > 1:
            self.done_among_calls += 1
        else:
            self.is_done_calls += 1
        return super().state_and_done(job_id, seg_ids)


def test_intake_reads_each_tasks_done_set_in_one_call(tmp_path):
    """At intake the worker asks which of a task's segments are done once per task, not once per
    segment: a first delivery makes only the store-time check per segment (state and done in one
    call), a redelivery of a finished job none at all, and renders nothing."""
    spec, settings = make_job(10), Settings(batch_size=5)
    jobs = CountingJobs()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), 0.0)
    storage = LocalStorage(tmp_path)
    run(spec, storage, settings, jobs=jobs)
    assert (jobs.done_among_calls, jobs.is_done_calls) == (2, 10)  # 2 tasks; the check before each store
    engine = ToneEngine()
    rendered = []
    original = engine.synthesize
    engine.synthesize = lambda batch: (rendered.append(len(batch)), original(batch))[1]
    pipeline = Pipeline(engine, storage, jobs, settings, lambda _j: None)
    with pipeline:
        for h in [pipeline.submit(t) for t in render_tasks(spec, settings.batch_size)]:
            assert h.wait(60)
    assert (jobs.done_among_calls, jobs.is_done_calls, rendered) == (4, 10, [])


@pytest.mark.parametrize("attempt", [1, 2, 5, 20])
def test_backoff_is_jittered_and_capped(attempt):
    values = [backoff_s(attempt, 100, 2000) for _ in range(200)]
    assert all(0 <= v <= min(2.0, 0.1 * 2 ** (attempt - 1)) for v in values)
    assert len(set(values)) > 100


class FlakyStorage(LocalStorage):
    """A local folder that refuses connections while `down` is set, as S3 does while it is stopped."""

    def __init__(self, root):
        super().__init__(root)
        self.down = threading.Event()
        self.refused = 0

    def _check(self):
        if self.down.is_set():
            from botocore.exceptions import EndpointConnectionError

            self.refused += 1
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1/")

    def put(self, key, data, content_type="application/octet-stream"):
        self._check()
        super().put(key, data, content_type)

    def exists(self, key):
        self._check()
        return super().exists(key)


def test_storage_outage_costs_no_attempt_and_loses_nothing(tmp_path):
    """Uploads meet a 2-s outage: they wait with their audio and land afterwards, one attempt each."""
    spec = make_job(24)
    storage = FlakyStorage(tmp_path)
    storage.down.set()
    threading.Timer(2.0, storage.down.clear).start()
    settings = Settings(batch_size=8, upload_threads=2, max_attempts=1)
    t0 = time.monotonic()
    _, jobs, _ = run(spec, storage, settings)
    assert time.monotonic() - t0 >= 1.9 and storage.refused > 0
    status = jobs.status("job1")
    assert (status.done, status.failed) == (24, 0)
    assert all(jobs.begin_attempt("job1", s.id) == 2 for s in spec.segments)  # exactly one attempt was made


def test_storage_outage_longer_than_the_window_fails_with_the_outage_as_reason(tmp_path):
    spec = make_job(3)
    storage = FlakyStorage(tmp_path)
    settings = Settings(batch_size=3, outage_window_s=0.5, max_attempts=3)
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, 3, 0.0)
    engine = ToneEngine()
    original = engine.synthesize
    # The engine renders only once storage is down (else a fast upload could land before it goes).
    engine.synthesize = lambda batch: (storage.down.wait(30), original(batch))[1]
    with Pipeline(engine, storage, jobs, settings, lambda _j: None) as pipeline:
        handle = pipeline.submit(next(render_tasks(spec, 3)))  # the stored-check passes, then storage goes
        storage.down.set()
        assert handle.wait(30)
    status = jobs.status("job1")
    assert status.failed == 3 and all("storage outage" in e and "EndpointConnectionError" in e
                                      for e in status.errors.values())
    assert all(jobs.begin_attempt("job1", s.id) == 2 for s in spec.segments)  # one render each, no re-render


def test_segment_text_over_the_bound_is_failed_without_rendering(tmp_path):
    spec = make_job(2)
    long = Segment(chapter=0, index=2, text="word " * 300)
    spec = spec.model_copy(update={"segments": [*spec.segments, long]})
    engine = ToneEngine()
    seen = []
    original = engine.synthesize
    engine.synthesize = lambda batch: (seen.extend(r.segment_id for r in batch), original(batch))[1]
    _, jobs, _ = run(spec, LocalStorage(tmp_path), Settings(batch_size=3, max_segment_chars=1000), engine=engine)
    status = jobs.status("job1")
    assert status.done == 2 and "over max_segment_chars" in status.errors[long.id]
    assert long.id not in seen


def test_a_pipeline_thread_that_dies_ends_the_process(tmp_path):
    """Not a zombie: an engine loop that raises is reported through `on_thread_death` (the worker
    process exits there, so its launcher or orchestrator restarts it)."""

    class Broken(ToneEngine):
        def serve(self, *args, **kwargs):
            raise RuntimeError("engine loop bug")

    died = threading.Event()
    names = []
    pipeline = Pipeline(Broken(), LocalStorage(tmp_path), MemoryJobStore(), Settings(),
                        lambda _j: None, on_thread_death=lambda name: (names.append(name), died.set()))
    pipeline.start()
    assert died.wait(10) and names == ["engine"]
    pipeline.stop(1)


class PreparingEngine(ToneEngine):
    """A tone engine that records where `prepare` ran and what it saw prepared when it rendered."""

    def __init__(self):
        super().__init__(max_batch=8)
        self.prepared_on: set[str] = set()
        self.rendered_prepared: list[object] = []

    def prepare(self, request):
        self.prepared_on.add(threading.current_thread().name)
        if "unpreparable" in request.text:
            raise LookupError("no such voice (raised ahead)")
        return replace(request, prepared=("made ahead", request.segment_id))

    def synthesize(self, batch):
        self.rendered_prepared += [r.prepared for r in batch]
        yield from super().synthesize(batch)


def test_segments_are_prepared_on_the_submitting_thread_not_the_engines(tmp_path):
    """Engine.prepare runs where the task queues its segments (a Celery task's thread), so the engine
    thread takes work that is ready; every segment reaches the engine prepared, retries included."""
    spec = make_job(10)
    bad = Segment(chapter=0, index=10, text=f"broken {FAIL_MARKER}")
    odd = Segment(chapter=0, index=11, text="unpreparable, but renders")
    spec = spec.model_copy(update={"segments": [*spec.segments, bad, odd]})
    engine = PreparingEngine()
    _, jobs, _ = run(spec, LocalStorage(tmp_path), Settings(batch_size=4, max_attempts=2, retry_backoff_ms=10), engine=engine)
    assert jobs.status("job1").done == 11 and jobs.status("job1").failed == 1  # a failed prepare is no failure
    assert "engine" not in engine.prepared_on and threading.current_thread().name in engine.prepared_on
    ids = [seg.id for seg in spec.segments if seg is not odd]
    assert set(engine.rendered_prepared) == {("made ahead", i) for i in ids} | {None}  # only `odd` unprepared
    assert engine.rendered_prepared.count(("made ahead", bad.id)) >= 2  # its retry was prepared again


class TogetherEngine(PreparingEngine):
    """Prepares a task's requests together (`prepare_many`), recording each call's segment ids; the
    task holding `raise-together` makes it raise, as an engine's batch step might."""

    def __init__(self):
        super().__init__()
        self.calls: list[list[str]] = []

    def prepare_many(self, requests):
        self.calls.append([r.segment_id for r in requests])
        if any("raise-together" in r.text for r in requests):
            raise RuntimeError("batch tokenizer broke")
        return [replace(r, prepared=("together", r.segment_id)) for r in requests]


def test_a_tasks_segments_are_prepared_together_once(tmp_path):
    """A task's segments that may render are prepared in one `Engine.prepare_many` call on the task's
    thread, not one `prepare` each: those recorded done and those over max_segment_chars are left out,
    and a task whose batch prepare raises still renders all its segments, unprepared."""
    spec = make_job(12)
    segs = list(spec.segments)
    segs[5] = segs[5].model_copy(update={"text": "x" * 60})  # over max_segment_chars below: refused, never prepared
    segs[9] = segs[9].model_copy(update={"text": "raise-together, and still renders"})
    spec = spec.model_copy(update={"segments": segs})
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(segs), 0.0)
    jobs.finish(spec.id, segs[1].id, audio_s=0.5)  # recorded done by an earlier delivery
    engine = TogetherEngine()
    run(spec, LocalStorage(tmp_path), Settings(batch_size=4, max_segment_chars=50), engine=engine, jobs=jobs)
    ids = [s.id for s in segs]
    assert engine.calls == [[ids[0], ids[2], ids[3]], [ids[4], ids[6], ids[7]], ids[8:12]]
    assert engine.prepared_on == set()  # no per-segment prepare: none failed, so none was retried
    assert sorted(engine.rendered_prepared, key=str) == sorted(
        [("together", i) for i in (ids[0], ids[2], ids[3], ids[4], ids[6], ids[7])] + [None] * 4, key=str)
    status = jobs.status(spec.id)
    assert status.done == 11 and status.failed == 1


def test_is_engine_lost_is_only_a_cuda_kernel_fault():
    """A CUDA error that leaves the process's CUDA context unusable is a lost device; out of memory, a
    CUDA error that is only a bad call, and other errors are not."""
    import torch

    from voxbatch.worker.engine import is_engine_lost

    assert is_engine_lost(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert is_engine_lost(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert not is_engine_lost(torch.AcceleratorError("CUDA error: invalid argument"))
    assert not is_engine_lost(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert not is_engine_lost(ValueError("illegal memory access in the text"))


def test_is_out_of_memory_reads_torch_and_library_allocation_failures_and_their_chain():
    """torch's OutOfMemoryError and cuBLAS/cuDNN failing to allocate a workspace are the device out of
    memory, also where another error was raised while handling one (a graph capture ended after it);
    a kernel fault and other errors are not."""
    import torch

    from voxbatch.worker.engine import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        assert is_out_of_memory(e)
    assert not is_out_of_memory(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(ValueError("text out of memory"))  # not a RuntimeError
    assert not is_out_of_memory(RuntimeError("flow: CUDNN_STATUS_EXECUTION_FAILED"))


def test_a_lost_device_stores_what_is_rendered_then_ends_the_process(tmp_path):
    """An engine whose device faults mid-job (a CUDA kernel fault: every later batch would fail too)
    does not fail segments one by one until their attempts are spent: what was rendered before is
    stored, the faulting segment's error is not recorded (its attempt counts as lost with the worker),
    and the pipeline calls `on_engine_lost` (the worker process exits there and is restarted)."""
    import torch

    class FaultingEngine(ToneEngine):
        def synthesize(self, batch):
            for req in batch:
                if "fault" in req.text:
                    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
                yield from super().synthesize([req])

    spec = make_job(4)
    spec = spec.model_copy(update={"segments": [*spec.segments, Segment(chapter=0, index=4, text="this one meets a fault")]})
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), 0.0)
    lost, errors = threading.Event(), []
    storage = SlowStorage(tmp_path, delay_s=0.05)  # uploads still running when the fault arrives
    pipeline = Pipeline(FaultingEngine(max_batch=8), storage, jobs, Settings(batch_size=8, max_attempts=3),
                        lambda _j: None, on_engine_lost=lambda error: (errors.append(error), lost.set()))
    with pipeline:
        for task in render_tasks(spec, 8):
            pipeline.submit(task)
        assert lost.wait(30)
        status = jobs.status("job1")
    assert errors == ["AcceleratorError: CUDA error: an illegal memory access was encountered"]
    assert status.done == 4 and storage.puts == 4  # stored before the process would end
    assert status.failed == 0 and status.errors == {}  # nothing recorded against the segment


def test_ending_the_process_at_once_takes_its_multiprocessing_children_with_it(tmp_path):
    """`end_process` (a dead pipeline thread, a lost engine, render's lost engine) skips Python's exit:
    a spawned child, as vLLM's engine core is, would run on with nothing to stop it. It is killed first."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import multiprocessing, time\n"
        "from voxbatch.worker.pipeline import end_process\n"
        "if __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(600,))\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    end_process(3)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while services.process_running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not services.process_running(child)

