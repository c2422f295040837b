"""The double buffer inside a worker: engine → bounded output queue → upload threads.

Render tasks (Celery threads) hand their segments to the engine's intake and wait on a handle.
One engine thread batches from the intake and pushes finished audio into a bounded queue; upload
threads encode it, write it to storage under its final key, record it in the job store and count
the task's segments down. The engine only waits on storage when that queue is full, so the GPU keeps
working while objects upload. This is the one path that finishes a segment (`_record`): stored,
retried with backoff, or failed for good after `max_attempts`.

On shutdown the worker may `abandon()` the tasks still waiting: their handles are released marked
abandoned (the task then hands its message back to the broker instead of acking), and segments not
yet taken by the engine leave the intake with their attempt un-counted, so a rolling restart does
not use up a segment's attempts.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace


from voxbatch.audio import content_type, encode, probe
from voxbatch.jobstate import JobStore
from voxbatch.models import RenderTask, TaskSegment
from voxbatch.reuse import SegmentCache
from voxbatch.settings import Settings
from voxbatch.storage import Storage
from voxbatch.worker.engine import Engine, SynthesisRequest, SynthesisResult

log = logging.getLogger(__name__)


def backoff_s(attempt: int, base_ms: int, max_ms: int) -> float:
    """Jittered exponential backoff before attempt `attempt + 1` ("full jitter")."""
    return random.uniform(0, min(max_ms, base_ms * 2 ** max(attempt - 1, 0))) / 1000


class TaskHandle:
    """Counts one render task's segments down; the Celery thread waits on it before acking.

    `skipped` counts segments found already stored (a redelivery), `abandoned` says the wait ended
    because the worker is shutting down with segments unfinished (the task must not ack).
    """

    def __init__(self, task: RenderTask):
        self.task = task
        self.skipped = 0
        self.abandoned = False
        self._left = len(task.segments)
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self._left == 0:
            self._done.set()

    def segment_finished(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self._done.set()

    def abandon(self) -> None:
        with self._lock:
            if self._left > 0:
                self.abandoned = True
                self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every segment is finished; raises `TaskAbandoned` if the worker gave up first."""
        done = self._done.wait(timeout)
        if done and self.abandoned:
            raise TaskAbandoned(self.task)
        return done


class TaskAbandoned(Exception):
    """A task released unfinished at shutdown. The Celery task turns it into `Reject(requeue=True)`
    (worker/tasks.py), so its message goes straight back to the queue: neither acked (its segments
    would be lost) nor left unacked (it would idle until the visibility timeout). The pipeline itself
    knows nothing of Celery: the GPU benchmark and `voxbatch render` drive it without a broker."""

    def __init__(self, task: RenderTask):
        super().__init__(f"job {task.job_id}: worker shutting down with segments unfinished")


@dataclass(frozen=True)
class _Tag:
    handle: TaskHandle
    segment: TaskSegment
    attempt: int = 0  # set when the engine takes the segment (`_admit`); 0 while it waits in the intake


class Pipeline:
    def __init__(self, engine: Engine, storage: Storage, jobs: JobStore, settings: Settings,
                 on_job_complete: Callable[[str], None], metrics=None):
        self.engine, self.storage, self.jobs, self.settings = engine, storage, jobs, settings
        self.on_job_complete = on_job_complete
        self.metrics = metrics
        self.cache = SegmentCache(storage, engine.fingerprint())
        self.intake: queue.Queue[SynthesisRequest | None] = queue.Queue()
        self.output: queue.Queue[SynthesisResult | None] = queue.Queue(maxsize=settings.output_queue_size)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._timers: set[threading.Timer] = set()
        self._handles: weakref.WeakSet[TaskHandle] = weakref.WeakSet()  # tasks in flight, for abandon()
        self._handles_lock = threading.Lock()
        self._abandoned = threading.Event()
        self.engine_waited_s = 0.0  # time the engine spent blocked on a full output queue
        self.last_took = 0.0  # unix time the engine last took a batch (the worker heartbeat reports it)
        self._unstored = 0  # results emitted by the engine and not yet stored or failed
        self._unstored_cv = threading.Condition()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Pipeline":
        observe = None
        if self.metrics is not None:
            observe = self.metrics.batch_done
            self.metrics.track_queues(self.intake, self.output)
        t = threading.Thread(target=self.engine.serve, args=(self.intake, self._emit, self._stop, observe, self._admit),
                             name="engine", daemon=True)
        self._threads.append(t)
        for i in range(self.settings.upload_threads):
            self._threads.append(threading.Thread(target=self._upload_loop, name=f"upload-{i}", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the threads, letting them store what is already rendered for up to `timeout_s` in all."""
        self.intake.put(None)
        self._stop.set()
        for _ in range(self.settings.upload_threads):
            self.output.put(None)
        for timer in list(self._timers):
            timer.cancel()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def abandon(self) -> int:
        """Release every task still waiting, marked abandoned; returns how many were released.

        Called when the shutdown window ends. Segments still in the intake never reached the engine,
        so they spent no attempt (attempts are counted as the engine takes a batch): they are taken
        out. Whatever the engine is rendering now may still be stored; the redelivered task then finds
        it stored and skips it.
        """
        self._abandoned.set()
        for timer in list(self._timers):
            timer.cancel()
        self._clear_intake()
        with self._handles_lock:
            handles = list(self._handles)
        for handle in handles:
            handle.abandon()
        return sum(h.abandoned for h in handles)

    def _clear_intake(self) -> None:
        while True:
            try:
                req = self.intake.get_nowait()
            except queue.Empty:
                return
            if req is None:  # stop() was called: leave its sentinel for the engine
                self.intake.put(None)
                return

    def __enter__(self) -> "Pipeline":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- intake ------------------------------------------------------------------------------
    def submit(self, task: RenderTask) -> TaskHandle:
        """Queue a task's segments for rendering; segments already stored are not rendered again."""
        handle = TaskHandle(task)
        if self._abandoned.is_set():
            handle.abandon()
            return handle
        with self._handles_lock:
            self._handles.add(handle)
        state = self.jobs.state(task.job_id)
        for seg in task.segments:
            if state in (None, "cancelled") or self._already_stored(task, seg):
                handle.skipped += 1
                handle.segment_finished()
                continue
            self._enqueue(handle, seg)
        if handle.skipped:
            # A redelivery (or a task of a cancelled job): say so, it is the only trace it leaves.
            log.info("job %s: %d of %d segments (%s..%s) already stored or cancelled, not rendered",
                     task.job_id, handle.skipped, len(task.segments), task.segments[0].id, task.segments[-1].id)
        return handle

    def _already_stored(self, task: RenderTask, seg: TaskSegment) -> bool:
        if self.jobs.is_done(task.job_id, seg.id):
            return True
        if not self.storage.exists(seg.key):
            return task.reuse and self._reuse(task, seg)
        # Stored by an earlier delivery that died before recording it: record it now, don't re-render.
        self._record(task.job_id, seg.id, audio_s=probe(self.storage.get(seg.key), seg.key).duration_s)
        return True

    def _reuse(self, task: RenderTask, seg: TaskSegment) -> bool:
        """Take the segment's audio from the content-addressed cache when it is there (reuse.py)."""
        key = self.cache.key(task, seg)
        try:
            data = self.storage.get(key)
            self.storage.copy(key, seg.key)
        except KeyError:
            return False
        self.jobs.mark_reused(task.job_id, seg.id)
        self._record(task.job_id, seg.id, audio_s=probe(data, key).duration_s)
        return True

    def _enqueue(self, handle: TaskHandle, seg: TaskSegment) -> None:
        task = handle.task
        if self._abandoned.is_set():
            handle.abandon()  # shutting down: not worth starting, the redelivery renders it
            return
        self.intake.put(SynthesisRequest(seg.id, seg.text, task.voice, seg.seed, task.params, tag=_Tag(handle, seg)))

    def _admit(self, batch: list[SynthesisRequest]) -> list[SynthesisRequest]:
        """Count an attempt for each segment the engine is about to render (engine thread).

        Counting here, not at intake, means a worker crash charges only the batch being rendered.
        A segment over max_attempts is given up (a poison segment cannot loop). A segment whose
        earlier attempt left no error died with its worker (a suspect): in a batch with others it
        is put back, uncounted, to come alone; alone, it waits until everything rendered before it
        is stored. So a poison segment's next crash takes no batch-mate and no finished audio with it.
        """
        admitted = []
        self.last_took = time.time()
        attempts = self.jobs.begin_attempts([(r.tag.handle.task.job_id, r.tag.segment.id) for r in batch])
        for req, attempt in zip(batch, attempts):
            tag: _Tag = req.tag
            task, seg = tag.handle.task, tag.segment
            if attempt > self.settings.max_attempts:
                # The attempt is refused, not made, so the counter stays at max_attempts.
                self.jobs.forget_attempt(task.job_id, seg.id)
                error = self.jobs.last_error(task.job_id, seg.id) or "worker lost while rendering"
                self._record(task.job_id, seg.id, error=f"gave up after {attempt - 1} attempts: {error}")
                tag.handle.segment_finished()
                continue
            if attempt > 1 and self.jobs.last_error(task.job_id, seg.id) is None:  # died with its worker
                if len(batch) > 1:
                    self.jobs.forget_attempt(task.job_id, seg.id)
                    log.info("segment %s/%s: its worker died while rendering it; rendering it alone", task.job_id, seg.id)
                    self.intake.put(replace(req, solo=True))
                    continue
                self._wait_until_stored()
            admitted.append(replace(req, tag=replace(tag, attempt=attempt)))
        return admitted

    def _emit(self, result: SynthesisResult) -> None:
        with self._unstored_cv:
            self._unstored += 1
        try:
            self.output.put_nowait(result)
        except queue.Full:
            t0 = time.perf_counter()
            self.output.put(result)
            self.engine_waited_s += time.perf_counter() - t0

    # -- output ------------------------------------------------------------------------------
    def _upload_loop(self) -> None:
        while True:
            result = self.output.get()
            if result is None:
                return
            tag: _Tag = result.request.tag
            try:
                if result.error is not None:
                    raise RuntimeError(result.error)
                self._store(tag, result)
            except Exception as e:  # noqa: BLE001 - every failure goes through the one retry path
                self._failed_attempt(tag, f"{type(e).__name__}: {e}" if result.error is None else result.error)
            finally:
                with self._unstored_cv:
                    self._unstored -= 1
                    self._unstored_cv.notify_all()

    def _wait_until_stored(self, timeout_s: float = 120.0) -> None:
        """Block the engine until every result it emitted is stored (or failed): before a suspect
        renders, so that if it kills the process it takes nothing already rendered with it."""
        with self._unstored_cv:
            self._unstored_cv.wait_for(lambda: self._unstored == 0 or self._stop.is_set(), timeout=timeout_s)

    def _store(self, tag: _Tag, result: SynthesisResult) -> None:
        task, seg = tag.handle.task, tag.segment
        if self.jobs.state(task.job_id) in (None, "cancelled"):
            tag.handle.segment_finished()  # rendered before the cancel reached us: keep storage as Redis says
            return
        t0 = time.perf_counter()
        data = encode(result.audio, self.engine.sample_rate, task.format)
        cache_key = self.cache.key(task, seg)  # the cache first: stored under seg.key means cached too
        self.storage.put(cache_key, data, content_type(task.format))
        self.storage.copy(cache_key, seg.key)
        audio_s = len(result.audio) / self.engine.sample_rate
        if self.metrics is not None:
            self.metrics.segment_stored(audio_s, time.perf_counter() - t0)
        self._record(task.job_id, seg.id, audio_s=audio_s)
        tag.handle.segment_finished()

    def _failed_attempt(self, tag: _Tag, error: str) -> None:
        task, seg = tag.handle.task, tag.segment
        log.warning("segment %s/%s attempt %d failed: %s", task.job_id, seg.id, tag.attempt, error)
        self.jobs.note_error(task.job_id, seg.id, error)
        if self.metrics is not None:
            self.metrics.segment_failed()
        if tag.attempt >= self.settings.max_attempts:
            self._record(task.job_id, seg.id, error=error)
            tag.handle.segment_finished()
            return
        delay = backoff_s(tag.attempt, self.settings.retry_backoff_ms, self.settings.retry_backoff_max_ms)
        timer = threading.Timer(delay, self._retry, args=(tag,))
        timer.daemon = True
        self._timers.add(timer)
        timer.start()

    def _retry(self, tag: _Tag) -> None:
        self._timers.discard(threading.current_thread())  # type: ignore[arg-type]
        if self._abandoned.is_set():
            return  # the handle was released; the redelivered task retries this segment
        if self.jobs.state(tag.handle.task.job_id) in (None, "cancelled"):
            tag.handle.segment_finished()
            return
        self._enqueue(tag.handle, tag.segment)

    def _record(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None) -> None:
        """Record a segment's outcome; the call that finishes a job's last segment triggers assembly."""
        if self.jobs.finish(job_id, seg_id, audio_s=audio_s, error=error) == 1:
            self.on_job_complete(job_id)
