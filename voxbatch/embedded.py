"""`voxbatch render`: the whole pipeline in one process, a local folder for storage, no Redis.

The same pipeline and assembly as the distributed path, fed as a worker feeds it (a window of the
book in flight, in reading order); only the job store (in memory) and the hand-off to assembly
differ: each chapter is assembled (and mastered) in a thread of its own as soon
as its segments are all stored, while the engine renders later chapters, so the job ends soon after
its last segment instead of assembling the whole book then. Start-up is overlapped the same way: the
engine is built, proven and fingerprinted in a thread while the corpus is read and segmented.
`RenderTimes` records where the wall time went (start-up, first segment, rendering, assembly tail).

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
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from voxbatch import keys
from voxbatch.jobstate import MemoryJobStore
from voxbatch.models import JobSpec, JobStatus, Manifest, RenderTask, SynthesisParams
from voxbatch.producer.assemble import JobAssembly
from voxbatch.producer.submit import check_voices, load_spec, plan_job, render_tasks, store_spec
from voxbatch.settings import AudioFormat, Settings
from voxbatch.storage import LocalStorage, Storage
from voxbatch.worker.engine import Engine, SynthesisRequest, build_engine
from voxbatch.worker.budget import SegmentBudget, inflight_segments, task_threads
from voxbatch.worker.pipeline import Pipeline, TaskAbandoned, end_process

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # after Ctrl-C, how long uploads may finish before the process leaves (threads are daemons)
PROBE_TEXT = "Ready."
PROBE_MAX_TOKENS = 25
# After the probe, the engine-start thread also builds what the engine builds as its batches first
# reach each size (`Engine.warm_graphs`: the LLM's decode graphs for every row count), beside the model
# digest, instead of the LLM thread capturing them as its rows first grow in the first seconds of
# rendering (~1.2 s of its samples there, bench/results/diagnostics/gpu_h100_render2_pyspy.txt). Off: it
# does not pay. `voxbatch render` of a 58-minute book on an H100, A B A: wall 36.8 s with it vs 28.3 /
# 28.5 s without (B/A 1.294): start-up 20.4 s vs 10.7 / 11.1 s (every row count's graphs at every
# attention width, most of which a book never meets) for a first segment 2.7 s vs 3.7 / 4.0 s
# (bench/results/gpu_h100_phase1.json, stage render). Bench switch `render_warm`.
WARM_GRAPHS_AT_START = False


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


def check_storage(storage: Storage, spec: JobSpec) -> None:
    """Prove storage takes writes under the job, before rendering anything."""
    probe_key = keys.job_prefix(spec.id) + ".write-probe"
    try:
        storage.put(probe_key, b"ok")
        storage.delete(probe_key)
    except OSError as e:
        raise RenderError(f"cannot write to {storage.describe(keys.job_prefix(spec.id))}: {e.strerror or e}") from None


def check_engine(engine: Engine, voice: str, params: SynthesisParams) -> None:
    """Prove the engine speaks `voice`: one short render, which also warms it (kernels, the LLM's
    first graphs, flow and HiFT), so the job's first batch does not pay for that."""
    max_tokens = min(params.max_tokens or PROBE_MAX_TOKENS, PROBE_MAX_TOKENS)
    request = SynthesisRequest("probe", PROBE_TEXT, voice, 0, params.model_copy(update={"max_tokens": max_tokens}))
    try:
        results = list(engine.synthesize([request]))
    except Exception as e:  # noqa: BLE001 - whatever stops the probe would stop every segment
        raise RenderError(f"the {engine.name} engine cannot render voice {voice!r}: {type(e).__name__}: {e}") from None
    if not results or results[0].error:
        error = results[0].error if results else "no audio"
        raise RenderError(f"the {engine.name} engine cannot render voice {voice!r}: {error}")


def warm_graphs(engine: Engine) -> None:
    """`Engine.warm_graphs`, a failure of it one line naming the engine (as the probe's)."""
    try:
        engine.warm_graphs()
    except Exception as e:  # noqa: BLE001 - whatever stops the warm-up would stop the first batches
        raise RenderError(f"the {engine.name} engine cannot warm up: {type(e).__name__}: {e}") from None


class _EngineStart:
    """The engine built, proven on the job's voice and fingerprinted in a thread of its own, while the
    main thread reads and segments the corpus: start-up is weights, kernels and hashing the model
    files, none of which needs the corpus. `result()` waits for it and raises what it raised."""

    def __init__(self, settings: Settings, voice: str, params: SynthesisParams):
        self._engine: Engine | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._abandoned = False
        self._thread = threading.Thread(target=self._start, args=(settings, voice, params), name="engine-start",
                                        daemon=True)  # a corpus refused meanwhile ends the process without it
        self._thread.start()

    def _start(self, settings: Settings, voice: str, params: SynthesisParams) -> None:
        engine = None
        try:
            engine = build_engine(settings)
            # The model digest (sha256 of ~2.5 GB, for the reuse cache's keys) while the probe renders.
            digest = threading.Thread(target=engine.fingerprint, name="model-digest", daemon=True)
            digest.start()
            check_engine(engine, voice, params)
            if WARM_GRAPHS_AT_START:
                warm_graphs(engine)
            digest.join()
            with self._lock:
                self._engine = engine
                if self._abandoned:
                    engine.close()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by result()
            self._error = e
            if engine is not None:  # built, then refused the voice: nothing will render on it
                engine.close()

    def abandon(self) -> None:
        """The render ended before it needed the engine (a refused corpus, voice or store): close the
        engine now if it is built, else as soon as it is, so no engine-core process is left running
        for Python's exit to wait on (a process that exits meanwhile waits only until then)."""
        with self._lock:
            self._abandoned = True
            if self._engine is not None:
                self._engine.close()

    def result(self) -> Engine:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._engine is not None
        return self._engine


@dataclass
class RenderTimes:
    """Where a render's wall time went, as `time.monotonic()` instants; `phases()` in seconds."""

    start: float = field(default_factory=time.monotonic)  # the command started (or render_local was called)
    ready: float | None = None  # engine built and proven, job stored: rendering starts
    first_stored: float | None = None  # the first segment stored (or found stored by a resumed run)
    last_stored: float | None = None  # the job's last segment stored or failed
    done: float | None = None  # the last chapter assembled, the book and the manifest written

    def phases(self) -> dict[str, float | None]:
        """start-up (to `ready`), the first segment and rendering (from `ready`), the assembly tail
        (after the last segment) and the wall time; None for a phase not reached."""

        def span(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else round(b - a, 3)

        return {"startup_s": span(self.start, self.ready), "first_segment_s": span(self.ready, self.first_stored),
                "rendering_s": span(self.ready, self.last_stored), "assembly_tail_s": span(self.last_stored, self.done),
                "wall_s": span(self.start, self.done)}


def render_local(path: str | Path | None, out_dir: str | Path, voice: str | None, settings: Settings, *,
                 name: str | None = None, fmt: AudioFormat | None = None, params: SynthesisParams | None = None,
                 engine: Engine | None = None, cast: dict[str, str] | None = None,
                 lexicon: str | Path | None = None, reuse: bool = True, title: str | None = None,
                 author: str | None = None, resume: str | None = None,
                 on_plan: Callable[[str, int, int], None] | None = None,
                 on_start: Callable[[JobSpec, int], None] | None = None,
                 on_progress: Callable[[JobStatus], None] | None = None,
                 times: RenderTimes | None = None) -> Manifest:
    """Render a corpus into `out_dir` (layout as in storage: jobs/<id>/...); returns the manifest.

    Segments are measured with the tokenizer of `settings.model_dir` unless the engine (`engine`, else
    `settings.engine`) is the tone engine or no model dir is set (`producer.submit.segment_length_fn`).
    `resume` continues the stored job of that id instead of planning `path`. `on_plan(stage, done, total)`
    follows the planning (`producer.submit.Progress`); `on_start(spec, already)` is told the job and how
    many segments were stored before this run; `on_progress` gets the job's status while it renders;
    `times` is filled in as the render goes (`RenderTimes`). Without `engine`, the engine of `settings`
    is built and proven in a thread while the corpus is planned. Raises RenderError before rendering
    anything when voice, model or storage is unusable, and RenderInterrupted on Ctrl-C.
    """
    times = times or RenderTimes()
    storage = LocalStorage(out_dir)
    engine_name = engine.name if engine is not None else settings.engine
    if resume is not None:
        spec = load_spec(storage, keys.check_name("job id", resume))
        voice, params = spec.voice, spec.params
    elif path is None or voice is None:
        raise ValueError("render needs a corpus path and a voice, or a job id to resume")
    params = params or SynthesisParams()
    starting = _EngineStart(settings, voice, params) if engine is None else None
    try:
        if resume is None:
            spec = plan_job(path, voice, settings, name=name, fmt=fmt, params=params, engine=engine_name, cast=cast,
                            lexicon=lexicon, reuse=reuse, title=title, author=author, progress=on_plan)
            job_id = stable_job_id(spec, engine_name, settings.model_dir)
            cover_key = keys.cover(job_id, spec.cover_key.rsplit(".", 1)[-1]) if spec.cover_key else None
            spec = spec.model_copy(update={"id": job_id, "cover_key": cover_key})  # the cover moves with the id
        check_voices(storage, spec)
        check_storage(storage, spec)
    except BaseException:
        if starting is not None:
            starting.abandon()
        raise
    if starting is not None:
        engine = starting.result()
    else:
        check_engine(engine, spec.voice, spec.params)
    try:
        store_spec(storage, spec)
        if on_start is not None:
            on_start(spec, stored_segments(storage, spec))
        times.ready = time.monotonic()
        manifest = _run(spec, storage, engine, settings, on_progress, times)
    finally:
        if starting is not None:  # an engine this render built is this render's to close (a given one is not)
            engine.close()
    log.info("job %s: %s", spec.id, ", ".join(f"{k} {v}" for k, v in times.phases().items()))
    return manifest


class _ChapterWatch:
    """Which chapters have every segment finished (stored, found stored, or failed for good). The job
    store tells it each outcome as it is recorded (`_WatchedJobs`); the assembler waits on it."""

    def __init__(self, spec: JobSpec, times: RenderTimes):
        self._left: dict[int, set[str]] = {i: set() for i in range(len(spec.chapters))}
        for s in spec.segments:
            self._left.setdefault(s.chapter, set()).add(s.id)
        self._chapter_of = {s.id: s.chapter for s in spec.segments}
        self._unfinished = len(spec.segments)
        self._stopped = False
        self._cv = threading.Condition()
        self.times = times

    def finished(self, seg_id: str) -> None:
        now = time.monotonic()
        with self._cv:
            left = self._left.get(self._chapter_of.get(seg_id, -1))
            if left is None or seg_id not in left:
                return
            left.discard(seg_id)
            self._unfinished -= 1
            if self.times.first_stored is None:
                self.times.first_stored = now
            if self._unfinished == 0:
                self.times.last_stored = now
            if not left:
                self._cv.notify_all()

    def wait(self, index: int) -> bool:
        """Block until chapter `index` is finished (True) or the watch is stopped (False)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._left[index] or self._stopped)
            return not self._left[index]

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()


class _WatchedJobs(MemoryJobStore):
    """The in-memory job store, telling `watch` of each segment whose outcome it records first."""

    def __init__(self, watch: _ChapterWatch):
        super().__init__()
        self.watch = watch

    def finish(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None) -> int:
        recorded = super().finish(job_id, seg_id, audio_s=audio_s, error=error)
        if recorded >= 0:
            self.watch.finished(seg_id)
        return recorded


class _Assembler:
    """Chapters assembled in reading order, each as soon as its segments are finished, in a thread
    of its own while the engine renders later chapters; `join()` raises what assembling raised."""

    def __init__(self, assembly: JobAssembly, watch: _ChapterWatch, jobs: MemoryJobStore, spec: JobSpec):
        self.assembly, self.watch, self.jobs, self.spec = assembly, watch, jobs, spec
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="assemble", daemon=True)

    def start(self) -> "_Assembler":
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            for index in range(len(self.spec.chapters)):
                if not self.watch.wait(index):
                    return
                self.assembly.add(index, self.jobs.failed(self.spec.id))
                log.info("job %s: chapter %d assembled", self.spec.id, index)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by join()
            self._error = e
            self.watch.stop()

    def join(self) -> None:
        """Wait for the last chapter; raise what assembling raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stopped(self, timeout_s: float) -> bool:
        """Whether the thread is done within `timeout_s` (after `watch.stop()`: a chapter in progress finishes)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def feed_like_a_worker(pipeline: Pipeline, tasks: Iterator[RenderTask], settings: Settings, rows: int) -> list[threading.Thread]:
    """Hand tasks to the pipeline as a worker's Celery threads do (voxbatch/worker/budget.py): in
    order, at most `inflight_segments` segments at once, `task_threads` threads. The engine picks
    among what is in its intake (longest first), so holding a whole book there would finish chapters
    in any order; a window of the book finishes them nearly in order, and each can be assembled while
    later ones render. Returns the started threads; each ends when the tasks run out (or the pipeline
    abandons them on Ctrl-C). The GPU benchmark feeds the engine stage with it too."""
    lock = threading.Lock()
    budget = SegmentBudget(inflight_segments(settings, rows))

    def feed() -> None:
        while True:
            with lock:
                task = next(tasks, None)
            if task is None:
                return
            with budget.hold(len(task.segments)):
                try:
                    pipeline.submit(task).wait()
                except TaskAbandoned:
                    return

    threads = [threading.Thread(target=feed, name=f"feed-{i}", daemon=True) for i in range(task_threads(settings, rows))]
    for t in threads:
        t.start()
    return threads


def _engine_lost(error: str) -> None:
    """`voxbatch render`'s end when the engine fails for good mid-job (a CUDA kernel fault, a dead LLM
    engine: nothing more can render in this process): one line, and exit 1. The segments stored so far
    stay; the same command renders only the rest."""
    print(f"voxbatch render: the engine failed for good ({error}); the segments stored so far are kept, run "
          "the same command again to render the rest", file=sys.stderr, flush=True)
    end_process(1)


def _run(spec: JobSpec, storage: Storage, engine: Engine, settings: Settings,
         on_progress: Callable[[JobStatus], None] | None, times: RenderTimes) -> Manifest:
    watch = _ChapterWatch(spec, times)
    jobs = _WatchedJobs(watch)
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    finished = threading.Event()
    assembly = JobAssembly(storage, spec, engine.sample_rate, settings)  # lists what an earlier run left first
    assembler = _Assembler(assembly, watch, jobs, spec).start()
    try:
        pipeline = Pipeline(engine, storage, jobs, settings, on_job_complete=lambda _job: finished.set(),
                            on_engine_lost=_engine_lost).start()
        try:
            for feeder in feed_like_a_worker(pipeline, render_tasks(spec, settings.batch_size), settings, engine.max_batch):
                while feeder.is_alive():
                    feeder.join(0.2)
                    if on_progress is not None:
                        on_progress(jobs.status(spec.id))
        except KeyboardInterrupt:
            watch.stop()
            pipeline.abandon()
            pipeline.stop(timeout_s=STOP_GRACE_S)
            raise RenderInterrupted(spec.id, stored_segments(storage, spec), len(spec.segments)) from None
        pipeline.stop()
        if on_progress is not None:
            on_progress(jobs.status(spec.id))
        if not finished.is_set():
            watch.stop()
            raise RuntimeError(f"job {spec.id}: pipeline stopped before every segment finished")
        assembler.join()
        manifest = assembly.finish(jobs.failed(spec.id), jobs.reused_ids(spec.id))
    finally:
        watch.stop()
        if assembler.stopped(STOP_GRACE_S):  # else still in a chapter (Ctrl-C): its temporary files stay
            assembly.close()
    times.done = time.monotonic()
    return manifest
