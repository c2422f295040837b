"""One worker process: pinned to at most one GPU, engine built and warmed, then Celery consumes.

A container's entry point (the orchestrator exposes one GPU and restarts the process), or started by
the bare-metal launcher (`voxbatch worker --gpus ...`) with CUDA_VISIBLE_DEVICES already set; either
way nothing in this process can touch another GPU. Celery runs the thread pool: the CUDA context lives in this
one process and is never forked.

Shutdown (SIGTERM from the launcher, Kubernetes or compose): Celery stops consuming and waits for the
running render tasks, but without limit (its warm shutdown). `_bound_shutdown` adds the limit: after
`shutdown_window_s` the pipeline abandons what is unfinished, those tasks go back to the queue
(Reject with requeue), and the process exits, storing only what the engine has already rendered.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

from celery import signals

from voxbatch.broker import install_heartbeat
from voxbatch.celery_app import app, configure_celery, send_assemble, shutdown_window_s
from voxbatch.jobstate import RedisJobStore
from voxbatch.settings import load_settings, validation_problems
from voxbatch.storage import open_storage
from voxbatch.worker import timeline
from voxbatch.worker.launcher import BAD_START_EXIT, LAUNCHER_PID_ENV

log = logging.getLogger("voxbatch.worker")

# After the shutdown window, how long the engine and upload threads may still store what is rendered.
STOP_GRACE_S = 5.0


def _bound_shutdown(pipeline, window_s: float) -> None:
    """On Celery's (warm) shutdown, give in-flight tasks `window_s`, then abandon the rest.

    Connected to `worker_shutting_down`, which Celery sends from its SIGTERM/SIGINT handler in the
    main thread; the handler only starts a thread, once however many signals arrive.
    """
    armed = threading.Lock()

    def on_shutting_down(**_) -> None:
        if armed.acquire(blocking=False):
            threading.Thread(target=_abandon_after, args=(pipeline, window_s), name="shutdown-window",
                             daemon=True).start()

    signals.worker_shutting_down.connect(on_shutting_down, weak=False)


def _abandon_after(pipeline, window_s: float) -> None:
    log.warning("shutting down: in-flight render tasks have %.0fs to finish", window_s)
    time.sleep(window_s)
    handed_back = pipeline.abandon()
    log.warning("shutdown window over: %d unfinished render task(s) handed back to the queue", handed_back)


def die_with_launcher() -> None:
    """Under `voxbatch worker`'s launcher: have the kernel send this process SIGTERM (Celery's warm
    shutdown) when the launcher dies, however it dies. Each worker leads a session of its own, so a
    launcher killed by SIGKILL (an OOM kill, a supervisor's timeout) took nothing with it, and its
    workers rendered on, holding their GPUs, beside the next launcher's. Linux only (prctl)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if str(os.getppid()) != launcher:  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def bad_start_exits():
    """A worker that cannot start with the settings and files it was given ends with one line naming
    the problem and BAD_START_EXIT, which the launcher does not restart. That is a ValueError while the
    settings are read or the engine is built: a bad setting (pydantic's error, without the values: a
    broker URL may hold a password), a missing or incomplete model folder (ModelDirError), a memory cap
    below what the engine needs. Anything else (a storage outage, an OSError reading a file, a crash)
    still raises, and the process is restarted."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as e:
        _bad_start(validation_problems(e))
    except ValueError as e:
        _bad_start(str(e))


def _bad_start(message: str) -> None:
    log.critical("cannot start: %s", " ".join(message.split()))
    logging.shutdown()
    sys.exit(BAD_START_EXIT)


def _heartbeat(jobs: RedisJobStore, pipeline, name: str, queues: str, every_s: float) -> None:
    """Tell Redis this worker is alive, and when it last took work, every `every_s` (a daemon thread:
    it dies with the process, and the entry then ages out)."""
    def beat() -> None:
        while True:
            try:
                jobs.worker_beat(name, pipeline.last_took, queues)
            except Exception as e:  # noqa: BLE001 - Redis away: the next beat tries again
                log.warning("heartbeat not written: %s", e)
            time.sleep(every_s)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def serve(gpu: str | None, concurrency: int | None, queues: str | None, hostname: str | None) -> None:
    from voxbatch.worker.engine import build_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    die_with_launcher()
    with bad_start_exits():
        settings = load_settings()
    timeline.configure(settings.timeline_log)
    if settings.gpu_trace_dir:
        from voxbatch.worker import gpu_trace

        gpu_trace.watch(settings.gpu_trace_dir)
    log.info("worker for GPU %s: CUDA_VISIBLE_DEVICES=%s%s", gpu, os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
             f", CUDA MPS pipe {os.environ['CUDA_MPS_PIPE_DIRECTORY']}" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "")
    configure_celery(settings)
    with bad_start_exits():
        engine = build_engine(settings)
    try:
        _serve_with(engine, settings, gpu, concurrency, queues, hostname)
    finally:  # on every way out, a failed start included: Python's exit would wait on an open vLLM core
        engine.close()


def _serve_with(engine, settings, gpu: str | None, concurrency: int | None, queues: str | None,
                hostname: str | None) -> None:
    """The worker around a built engine: warm it, start the pipeline, run Celery until it stops."""
    from voxbatch.worker import tasks
    from voxbatch.worker.budget import inflight_segments, task_threads
    from voxbatch.worker.pipeline import Pipeline

    engine.warmup()
    metrics = None
    if settings.metrics_port:
        from voxbatch.worker.metrics import Metrics

        metrics = Metrics(worker=hostname or socket.gethostname(), gpu=gpu or "cpu")
        metrics.serve(settings.metrics_port + (int(gpu) if gpu and gpu.isdigit() else 0))
    jobs = RedisJobStore.from_url(settings.broker_url)
    pipeline = Pipeline(engine, open_storage(settings), jobs, settings,
                        on_job_complete=lambda job_id: send_assemble(job_id, settings.assemble_queue),
                        metrics=metrics).start()
    tasks.install(pipeline)
    install_heartbeat(settings.broker_url, settings.task_heartbeat_s)
    _bound_shutdown(pipeline, shutdown_window_s(settings))
    name = hostname or f"voxbatch-{'gpu' + gpu if gpu is not None else 'cpu'}@{socket.gethostname()}"
    _heartbeat(jobs, pipeline, f"{name}/{os.getpid()}", queues or settings.render_queue, settings.worker_heartbeat_s)
    threads = concurrency or task_threads(settings, engine.max_batch)
    log.info("engine %s: %d rows; %d segments in flight in %d task threads", engine.name, engine.max_batch,
             inflight_segments(settings, engine.max_batch), threads)
    try:
        app.worker_main([
            "worker", "--pool", "threads", "--concurrency", str(threads),
            "--queues", queues or settings.render_queue, "--hostname", name,
            "--without-gossip", "--without-mingle", "--loglevel", "INFO",
        ])
    finally:
        pipeline.stop(timeout_s=STOP_GRACE_S)


def main() -> None:
    parser = argparse.ArgumentParser(description="one voxbatch worker process: a container's entry point, or "
                                                 "started per GPU by `voxbatch worker --gpus` on a bare-metal host")
    parser.add_argument("--gpu", default=None, help="GPU index for the metrics label and port (CUDA_VISIBLE_DEVICES pins)")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--queues", default=None)
    parser.add_argument("--hostname", default=None)
    a = parser.parse_args()
    serve(a.gpu, a.concurrency, a.queues, a.hostname)


if __name__ == "__main__":
    main()
