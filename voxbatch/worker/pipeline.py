"""The double buffer inside a worker: engine → bounded output queue → upload threads.

Render tasks (Celery threads) hand their segments to the engine's intake and wait on a handle.
One engine thread batches from the intake and pushes finished audio into a bounded queue; upload
threads encode it, write it to storage under its final key, record it in the job store and count
the task's segments down. The engine only waits on storage when that queue is full, so the GPU keeps
working while objects upload. This is the one path that finishes a segment (`_record`): stored,
retried with backoff, or failed for good after `max_attempts`.

Outages are not failures (voxbatch/outage.py): every Redis and storage call here waits for its
service to come back instead of raising. A rendered segment whose upload meets a storage outage
keeps its audio and retries the upload, spending no render attempt, for up to `outage_window_s`
(then it is recorded failed with the outage as its reason); while upload threads wait, the output
queue fills and the engine stops rendering what could not be stored. Only an error of the segment
itself (the engine failed on it) counts as an attempt. A pipeline thread that dies anyway takes the
process down (`_guarded`), so the launcher or the orchestrator restarts it: a worker that says
`ready.` and renders nothing is worse than one that restarts. So does a lost engine (a result marked
`engine_lost`: a CUDA kernel fault, or a dead vLLM engine core, leaves nothing in the process able to
render): what is already rendered is stored first, the segment's error is not recorded (its attempt
counts as lost with the worker, as after a SIGKILL), and the process ends (`ENGINE_LOST_EXIT`)
instead of failing every segment that follows.

Storage keys are derived here from (job, chapter, segment) through voxbatch/keys.py, never taken
from a message. A job missing from Redis (a Redis restarted without persistence) is not cancelled:
its audio is still rendered and stored, and `voxbatch retry` records it from storage.

On shutdown the worker may `abandon()` the tasks still waiting: their handles are released marked
abandoned (the task then hands its message back to the broker instead of acking), and segments not
yet taken by the engine leave the intake with their attempt un-counted, so a rolling restart does
not use up a segment's attempts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from voxbatch import keys
from voxbatch.audio import AudioDecodeError, content_type, encode, probe
from voxbatch.jobstate import JobStore
from voxbatch.models import RenderTask, TaskSegment
from voxbatch.outage import OutageTooLong, Stopped, backoff_s, wait_for_service
from voxbatch.reuse import SegmentCache
from voxbatch.settings import Settings
from voxbatch.storage import Storage
from voxbatch.worker import timeline
from voxbatch.worker.engine import Engine, SynthesisRequest, SynthesisResult

log = logging.getLogger(__name__)
T = TypeVar("T")

# Exit status of a worker process whose pipeline thread died (the launcher restarts it).
THREAD_DIED_EXIT = 70
# Exit status of a worker process whose engine can render nothing more (the launcher restarts it).
ENGINE_LOST_EXIT = 75
# How long a process whose engine is lost keeps storing what was rendered before it ends.
ENGINE_LOST_FLUSH_S = 60.0

__all__ = ["Pipeline", "TaskHandle", "TaskAbandoned", "THREAD_DIED_EXIT", "ENGINE_LOST_EXIT", "end_process"]


def end_process(code: int) -> None:
    """Flush the logs and end the process at once with `code` (no thread is waited for), its
    multiprocessing children killed first: a vLLM engine core (spawned through multiprocessing) whose
    parent ends this way runs on, holding its KV cache on the GPU, with nothing left to stop it."""
    logging.shutdown()
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)


def _exit_process(thread_name: str) -> None:
    """Default reaction to a dead pipeline thread."""
    end_process(THREAD_DIED_EXIT)


def _exit_engine_lost(error: str) -> None:
    """Default reaction to a lost engine."""
    end_process(ENGINE_LOST_EXIT)


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
    outage_since: float | None = None  # monotonic time the engine first met an outage rendering it

    @property
    def key(self) -> str:
        """Where the segment's audio goes: derived from (job, segment id, format), never from the message."""
        task = self.handle.task
        return keys.segment_by_id(task.job_id, self.segment.id, task.format)


class Pipeline:
    def __init__(self, engine: Engine, storage: Storage, jobs: JobStore, settings: Settings,
                 on_job_complete: Callable[[str], None], metrics=None,
                 on_thread_death: Callable[[str], None] = _exit_process,
                 on_engine_lost: Callable[[str], None] = _exit_engine_lost):
        self.engine, self.storage, self.jobs, self.settings = engine, storage, jobs, settings
        self.on_job_complete = on_job_complete
        self.metrics = metrics
        self.on_thread_death = on_thread_death
        self.on_engine_lost = on_engine_lost
        self._engine_lost_once = threading.Lock()  # the first lost-engine result ends the process; later ones wait
        self.cache = SegmentCache(storage, engine.fingerprint())
        # A task's segments are looked up in storage (done? cached?) this many at a time: a resubmitted
        # book is mostly cache hits, two storage round trips each.
        self._lookups = ThreadPoolExecutor(settings.upload_threads, thread_name_prefix="lookup")
        self.intake: queue.Queue[SynthesisRequest | None] = queue.Queue()
        self.output: queue.Queue[SynthesisResult | None] = queue.Queue(maxsize=settings.output_queue_size)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._timers: set[threading.Timer] = set()
        self._handles: weakref.WeakSet[TaskHandle] = weakref.WeakSet()  # tasks in flight, for abandon()
        self._handles_lock = threading.Lock()
        self._abandoned = threading.Event()  # set by abandon() and stop(): submit stops waiting on services
        self.engine_waited_s = 0.0  # time the engine spent blocked on a full output queue
        self.last_took = 0.0  # unix time the engine last took a batch (the worker heartbeat reports it)
        self._unstored = 0  # results emitted by the engine and not yet stored or failed
        self._unstored_cv = threading.Condition()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Pipeline":
        # Process-wide, and set here because this is what every process running an engine starts (the
        # worker, `voxbatch render`, the benchmarks); settings.gil_switch_interval_ms says why.
        sys.setswitchinterval(self.settings.gil_switch_interval_ms / 1000)
        observe = None
        if self.metrics is not None:
            observe = self.metrics.batch_done
            self.metrics.track_queues(self.intake, self.output)
        engine_args = (self.intake, self._emit, self._stop, observe, self._admit)
        self._threads.append(threading.Thread(target=self._guarded(self.engine.serve, *engine_args), name="engine",
                                              daemon=True))
        for i in range(self.settings.upload_threads):
            self._threads.append(threading.Thread(target=self._guarded(self._upload_loop), name=f"upload-{i}",
                                                  daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _guarded(self, fn: Callable[..., object], *args) -> Callable[[], None]:
        """`fn(*args)` for a pipeline thread: a shutdown ends it quietly, anything else it raises
        ends the process (`on_thread_death`) instead of leaving a worker that takes tasks and
        renders nothing."""

        def run() -> None:
            try:
                fn(*args)
            except Stopped:
                return
            except BaseException:  # noqa: BLE001 - a dead pipeline thread must not go unnoticed
                name = threading.current_thread().name
                log.critical("pipeline thread %s died; ending the worker process so it is restarted", name,
                             exc_info=True)
                self.on_thread_death(name)

        return run

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the threads, letting them store what is already rendered for up to `timeout_s` in all."""
        self.intake.put(None)
        self._stop.set()
        self._abandoned.set()
        for _ in range(self.settings.upload_threads):
            self.output.put(None)
        for timer in list(self._timers):
            timer.cancel()
        self._lookups.shutdown(wait=False, cancel_futures=True)
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

    @property
    def stopping(self) -> threading.Event:
        """Set once the pipeline is abandoning its tasks or stopping: callers stop waiting on services."""
        return self._abandoned

    def __enter__(self) -> "Pipeline":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- services ----------------------------------------------------------------------------
    def _service(self, fn: Callable[[], T], what: str, *, stop: threading.Event | None = None,
                 window_s: float | None = None) -> T:
        """A Redis or storage call, waited through outages (`Stopped` once `stop` is set)."""
        return wait_for_service(fn, what, log=log, stop=stop or self._stop, window_s=window_s)

    # -- intake ------------------------------------------------------------------------------
    def submit(self, task: RenderTask) -> TaskHandle:
        """Queue a task's segments for rendering; segments already stored are not rendered again."""
        handle = TaskHandle(task)
        if self._abandoned.is_set():
            handle.abandon()
            return handle
        with self._handles_lock:
            self._handles.add(handle)
        try:
            # The job's state and which segments are recorded done: one call for the task.
            ids = [seg.id for seg in task.segments]
            state, done = self._service(lambda: self.jobs.state_and_done(task.job_id, ids), f"job {task.job_id}",
                                        stop=self._abandoned)
            if state == "cancelled":
                stored, requests = [True] * len(task.segments), {}
            else:
                # Which of the segments not recorded done are stored anyway (a delivery that died before
                # recording them): one question for the task (on S3 one listing, not a request per key).
                unrecorded = {seg.id: _Tag(handle, seg).key for seg, d in zip(task.segments, done) if not d}
                present = self._service(lambda: self.storage.existing(list(unrecorded.values())), f"job {task.job_id}",
                                        stop=self._abandoned) if unrecorded else set()
                # Lazily, in order: each other segment goes to the intake as soon as its own cache lookup
                # is back, not after the whole task's (a task of 256 held the engine's first rows for all
                # its round trips).
                stored = self._lookups.map(
                    lambda seg, d: d or self._already_stored(handle, seg, unrecorded[seg.id], present), task.segments, done)
                # While the lookups run: the segments that may render, prepared together (Engine.prepare_many).
                # One found stored or cached after all was prepared for nothing, which costs little.
                requests = self._requests(handle, [seg for seg, d in zip(task.segments, done)
                                                   if not d and len(seg.text) <= self.settings.max_segment_chars])
            for seg, skip in zip(task.segments, stored):
                if skip:
                    handle.skipped += 1
                    handle.segment_finished()
                elif len(seg.text) > self.settings.max_segment_chars:
                    # More than the model can speak in one go: refused, never rendered (nor retried).
                    self._record(task.job_id, seg.id, error=f"text of {len(seg.text)} characters is over "
                                                            f"max_segment_chars ({self.settings.max_segment_chars})")
                    handle.segment_finished()
                else:
                    self._enqueue(handle, seg, request=requests.get(id(seg)))
        except Stopped:
            handle.abandon()  # shutting down while a service was away: the redelivery takes it from here
            return handle
        if handle.skipped:
            # A redelivery (or a task of a cancelled job): say so, it is the only trace it leaves.
            log.info("job %s: %d of %d segments (%s..%s) already stored or cancelled, not rendered",
                     task.job_id, handle.skipped, len(task.segments), task.segments[0].id, task.segments[-1].id)
        return handle

    def _already_stored(self, handle: TaskHandle, seg: TaskSegment, key: str, present: set[str]) -> bool:
        """For a segment not recorded done when its task came in (stored under `key`): whether it needs no
        render (`present`: which of the task's unrecorded keys storage held as it came in)."""
        job_id = handle.task.job_id
        where = f"segment {job_id}/{seg.id}"
        # The segment's own key before the cache: a redelivery whose first delivery stored it must not
        # copy over it (an object is written once; bench/chaos.py counts writes per key).
        if key not in present:
            return handle.task.reuse and self._reuse(handle, seg, key)
        # Stored: another delivery may have recorded it since the task's done-set was read.
        if self._service(lambda: self.jobs.is_done(job_id, seg.id), where, stop=self._abandoned):
            return True
        # Stored by an earlier delivery that died before recording it: record it now, don't re-render.
        data = self._service(lambda: self.storage.get(key), where, stop=self._abandoned)
        try:
            audio_s = probe(data, key).duration_s
        except AudioDecodeError as e:  # never written by us (puts are atomic): render it again over it
            log.warning("%s: stored object is not audio (%s); rendering it again", where, e)
            return False
        # Not rendered by this run: reported reused (an unchanged book rendered again into the same
        # folder has the same stable job id and finds every segment here, not in the cache).
        self._service(lambda: self.jobs.mark_reused(job_id, seg.id), where, stop=self._abandoned)
        self._record(job_id, seg.id, audio_s=audio_s, stop=self._abandoned)
        return True

    def _reuse(self, handle: TaskHandle, seg: TaskSegment, key: str) -> bool:
        """Take the segment's audio (its key: `key`) from the content-addressed cache when it is there (reuse.py)."""
        task = handle.task
        where = f"segment {task.job_id}/{seg.id}"
        try:
            cache_key = self.cache.key(task, seg)  # KeyError: no such voice (the engine reports it)
            data = self._service(lambda: self.storage.get(cache_key), where, stop=self._abandoned)
            self._service(lambda: self.storage.copy(cache_key, key), where, stop=self._abandoned)
        except KeyError:
            return False
        self._service(lambda: self.jobs.mark_reused(task.job_id, seg.id), where, stop=self._abandoned)
        self._record(task.job_id, seg.id, audio_s=probe(data, cache_key).duration_s, stop=self._abandoned)
        return True

    def _request(self, handle: TaskHandle, seg: TaskSegment, outage_since: float | None = None) -> SynthesisRequest:
        task = handle.task
        return SynthesisRequest(seg.id, seg.text, task.voice, seg.seed, task.params,
                                tag=_Tag(handle, seg, outage_since=outage_since))

    def _requests(self, handle: TaskHandle, segs: list[TaskSegment]) -> dict[int, SynthesisRequest]:
        """The engine's requests for a task's `segs`, prepared together (`Engine.prepare_many`), by the
        segment object (a message may repeat a segment id); as they were if the engine could not (see `_prepared`)."""
        requests = [self._request(handle, seg) for seg in segs]
        try:
            prepared = self.engine.prepare_many(requests)
            if len(prepared) != len(requests):
                raise ValueError(f"{len(prepared)} requests back for {len(requests)}")
        except Exception as e:  # noqa: BLE001 - not this thread's to report (see `_prepared`)
            log.debug("job %s: task not prepared ahead (%s: %s)", handle.task.job_id, type(e).__name__, e)
            prepared = requests
        return {id(seg): r for seg, r in zip(segs, prepared)}

    def _enqueue(self, handle: TaskHandle, seg: TaskSegment, outage_since: float | None = None,
                 request: SynthesisRequest | None = None) -> None:
        """Queue the segment for the engine: `request` when the task's intake prepared it (`_requests`),
        else a new one, prepared here (a retry)."""
        if self._abandoned.is_set():
            handle.abandon()  # shutting down: not worth starting, the redelivery renders it
            return
        self.intake.put(request if request is not None else self._prepared(self._request(handle, seg, outage_since)))

    def _prepared(self, request: SynthesisRequest) -> SynthesisRequest:
        """`Engine.prepare` on this thread (a task's, or a retry's timer), so the engine thread only
        takes the request. A request it cannot prepare goes in as it is: the engine meets the same
        problem when it takes it and reports it there, where the segment's attempt is counted."""
        try:
            return self.engine.prepare(request)
        except Exception as e:  # noqa: BLE001 - not this thread's to report (see above)
            log.debug("segment %s: not prepared ahead (%s: %s)", request.segment_id, type(e).__name__, e)
            return request

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
        timeline.event("admit", len(batch))
        pairs = [(r.tag.handle.task.job_id, r.tag.segment.id) for r in batch]
        attempts = self._service(lambda: self.jobs.begin_attempts(pairs), "engine: counting attempts")
        for req, attempt in zip(batch, attempts):
            tag: _Tag = req.tag
            task, seg = tag.handle.task, tag.segment
            where = f"segment {task.job_id}/{seg.id}"
            if attempt > self.settings.max_attempts:
                # The attempt is refused, not made, so the counter stays at max_attempts.
                self._service(lambda: self.jobs.forget_attempt(task.job_id, seg.id), where)
                error = self._service(lambda: self.jobs.last_error(task.job_id, seg.id), where)
                self._record(task.job_id, seg.id,
                             error=f"gave up after {attempt - 1} attempts: {error or 'worker lost while rendering'}")
                tag.handle.segment_finished()
                continue
            if attempt > 1 and self._service(lambda: self.jobs.last_error(task.job_id, seg.id), where) is None:
                # Its last attempt left no error: it died with its worker.
                if len(batch) > 1:
                    self._service(lambda: self.jobs.forget_attempt(task.job_id, seg.id), where)
                    log.info("%s: its worker died while rendering it; rendering it alone", where)
                    self.intake.put(replace(req, solo=True))
                    continue
                self._wait_until_stored()
            admitted.append(replace(req, tag=replace(tag, attempt=attempt)))
        return admitted

    def _emit(self, result: SynthesisResult) -> None:
        if result.engine_lost:
            self._lose_engine(result)
            return
        with self._unstored_cv:
            self._unstored += 1
        try:
            self.output.put_nowait(result)
        except queue.Full:
            t0 = time.perf_counter()
            self.output.put(result)
            self.engine_waited_s += time.perf_counter() - t0

    def _lose_engine(self, result: SynthesisResult) -> None:
        """The engine can render nothing more: store what is already rendered (at most
        ENGINE_LOST_FLUSH_S), record nothing for this segment, and end the process (`on_engine_lost`).
        Other engine threads that report the same loss meanwhile wait here."""
        with self._engine_lost_once:
            tag = result.request.tag
            where = f"{tag.handle.task.job_id}/{tag.segment.id}" if isinstance(tag, _Tag) else result.request.segment_id
            log.critical("engine lost (%s, rendering segment %s); storing what is rendered, then ending the "
                         "worker process so it is restarted", result.error, where)
            try:
                self._wait_until_stored(ENGINE_LOST_FLUSH_S)
            finally:
                self.on_engine_lost(result.error or "engine lost")

    # -- output ------------------------------------------------------------------------------
    def _upload_loop(self) -> None:
        while True:
            result = self.output.get()
            if result is None:
                return
            tag: _Tag = result.request.tag
            try:
                if result.outage:
                    self._engine_outage(tag, result.error or "service unavailable")
                elif result.error is not None:
                    self._failed_attempt(tag, result.error)
                else:
                    try:
                        self._store(tag, result)
                    except Stopped:
                        raise
                    except Exception as e:  # noqa: BLE001 - not an outage (those are waited out): the segment's own
                        self._failed_attempt(tag, f"{type(e).__name__}: {e}")
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
        where = f"segment {task.job_id}/{seg.id}"
        state, (done,) = self._service(lambda: self.jobs.state_and_done(task.job_id, [seg.id]), where)
        if state == "cancelled":
            tag.handle.segment_finished()  # rendered before the cancel reached us: keep storage as Redis says
            return
        if done:
            tag.handle.segment_finished()  # another delivery of its task stored it meanwhile: write it once
            return
        t0 = time.perf_counter()
        data = encode(result.audio, self.engine.sample_rate, task.format)
        key, cache_key = tag.key, self.cache.key(task, seg)
        tries = 0

        def put() -> None:  # the cache first: stored under the segment's key means cached too
            nonlocal tries
            tries += 1
            # After an outage cut a try short, its write may have landed with only the reply lost:
            # look before writing again, so the object is written once.
            if tries > 1 and self.storage.exists(key):
                return
            self.storage.put(cache_key, data, content_type(task.format))
            self.storage.copy(cache_key, key)

        try:
            self._service(put, f"{where}: upload", window_s=self.settings.outage_window_s)
        except OutageTooLong as e:
            self._record(task.job_id, seg.id, error=f"storage outage: {e}")  # the outage is the reason, not the segment
            tag.handle.segment_finished()
            return
        audio_s = len(result.audio) / self.engine.sample_rate
        if self.metrics is not None:
            self.metrics.segment_stored(audio_s, time.perf_counter() - t0)
        self._record(task.job_id, seg.id, audio_s=audio_s)
        tag.handle.segment_finished()

    def _failed_attempt(self, tag: _Tag, error: str) -> None:
        task, seg = tag.handle.task, tag.segment
        log.warning("segment %s/%s attempt %d failed: %s", task.job_id, seg.id, tag.attempt, error)
        self._service(lambda: self.jobs.note_error(task.job_id, seg.id, error), f"segment {task.job_id}/{seg.id}")
        if self.metrics is not None:
            self.metrics.segment_failed()
        if tag.attempt >= self.settings.max_attempts:
            self._record(task.job_id, seg.id, error=error)
            tag.handle.segment_finished()
            return
        self._later(backoff_s(tag.attempt, self.settings.retry_backoff_ms, self.settings.retry_backoff_max_ms),
                    tag)

    def _engine_outage(self, tag: _Tag, error: str) -> None:
        """The engine could not render a segment because a service was away (a voice profile it
        could not fetch): its attempt is given back and it is tried again, within the outage window."""
        task, seg = tag.handle.task, tag.segment
        now = time.monotonic()
        since = tag.outage_since if tag.outage_since is not None else now
        self._service(lambda: self.jobs.forget_attempt(task.job_id, seg.id), f"segment {task.job_id}/{seg.id}")
        if now - since >= self.settings.outage_window_s:
            self._record(task.job_id, seg.id, error=f"service outage for {now - since:.0f} s: {error}")
            tag.handle.segment_finished()
            return
        log.warning("segment %s/%s: service unavailable while rendering (%s); trying again", task.job_id, seg.id, error)
        self._later(backoff_s(int((now - since) // 5) + 1, self.settings.retry_backoff_ms, 5000),
                    replace(tag, outage_since=since))

    def _later(self, delay_s: float, tag: _Tag) -> None:
        timer = threading.Timer(delay_s, self._guarded(self._retry, tag))
        timer.daemon = True
        self._timers.add(timer)
        timer.start()

    def _retry(self, tag: _Tag) -> None:
        self._timers.discard(threading.current_thread())  # type: ignore[arg-type]
        if self._abandoned.is_set():
            return  # the handle was released; the redelivered task retries this segment
        if self._service(lambda: self.jobs.state(tag.handle.task.job_id), "retry") == "cancelled":
            tag.handle.segment_finished()
            return
        self._enqueue(tag.handle, tag.segment, tag.outage_since)

    def _record(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None,
                stop: threading.Event | None = None) -> None:
        """Record a segment's outcome; the call that finishes a job's last segment triggers assembly."""
        where = f"segment {job_id}/{seg_id}"
        if self._service(lambda: self.jobs.finish(job_id, seg_id, audio_s=audio_s, error=error), where,
                         stop=stop) == 1:
            self._service(lambda: self.on_job_complete(job_id), f"job {job_id}: sending its assembly", stop=stop)
