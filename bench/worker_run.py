"""The real `voxbatch worker` process fed by `voxbatch submit` through a real Redis on this machine.

What a user runs, measured from outside: a redis-server, a local storage folder holding the voice, a
`voxbatch worker` process (Celery, threads pool, the shipped engine) configured only through
VOXBATCH_* variables, and jobs submitted with `voxbatch submit`. A job's wall time runs from its
creation in Redis (the producer has segmented and stored the spec) to its last segment stored, both
as Redis records them; GPU utilisation is sampled (nvidia-smi) over exactly that window.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from voxbatch.worker.launcher import BAD_START_EXIT

REPO = Path(__file__).resolve().parents[1]
# The line `voxbatch worker`'s supervisor (voxbatch/worker/launcher.py) writes when a worker process dies
# and is started again. One that dies while starting dies again: a forked vLLM core did, in a loop, until
# the bench's 300 s wait ran out (bench/results/gpu_h100_s38_vllm_worker_log.txt).
RESTARTED = re.compile(r"voxbatch: worker for GPU \S+ exited with -?\d+; restarting in")
# How long the bench waits for a stopped `voxbatch worker` before it kills it: above the launcher's own
# bound (the shutdown window, 60 s by default, + 35 s), so the launcher's is the one that acts.
STOP_WAIT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary(given: str | None) -> str:
    path = given or shutil.which("redis-server")
    if not path:
        raise FileNotFoundError("redis-server not found (pass --redis-server PATH)")
    return path


class WorkerHarness:
    """Redis + one `voxbatch worker` process; `run_job` submits a corpus and waits for it."""

    def __init__(self, tmp: Path, env: dict[str, str], redis_server: str | None = None):
        self.tmp = tmp
        self.port = free_port()
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    "PYTHONUNBUFFERED": "1", "VOXBATCH_BROKER_URL": f"redis://127.0.0.1:{self.port}/0", **env}
        self.redis = subprocess.Popen([redis_binary(redis_server), "--port", str(self.port), "--bind", "127.0.0.1",
                                       "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis

        self.client = redis.Redis(port=self.port, decode_responses=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.redis.poll() is not None:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.1)
        self.worker: subprocess.Popen | None = None
        self.log = tmp / "worker.log"

    def start_worker(self, gpus: str | None, timeout_s: float = 300.0) -> float:
        """Start `voxbatch worker`; returns seconds until Celery said ready (engine loaded and warm)."""
        cmd = [sys.executable, "-m", "voxbatch.cli", "worker"] + (["--gpus", gpus] if gpus else [])
        t0 = time.perf_counter()
        self.worker = subprocess.Popen(cmd, env=self.env, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                       start_new_session=True)
        last = t0
        while time.perf_counter() - t0 < timeout_s:
            text = self.log.read_text(errors="replace")
            if " ready." in text:
                return time.perf_counter() - t0
            if time.perf_counter() - last > 20:
                last = time.perf_counter()
                print(f"  worker not ready after {last - t0:.0f}s; log tail: {text[-600:]!r}", flush=True)
            if self.worker.poll() is not None:  # a worker that cannot start with its settings ends the launcher
                code = self.worker.returncode
                why = ": it died while starting (it cannot start with these settings)" if code == BAD_START_EXIT else ""
                raise RuntimeError(f"voxbatch worker exited ({code}){why}:\n{text[-3000:]}")
            if died := RESTARTED.search(text):  # died while starting: its restarts will too
                raise RuntimeError(f"voxbatch worker died while starting (its first failure):\n{text[:died.end()][-3000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"voxbatch worker not ready after {timeout_s} s:\n{self.log.read_text(errors='replace')[-3000:]}")

    def submit(self, corpus: Path, voice: str, batch_size: int, model_dir: Path) -> str:
        env = {**self.env, "VOXBATCH_BATCH_SIZE": str(batch_size)}
        out = subprocess.run([sys.executable, "-m", "voxbatch.cli", "submit", str(corpus), "--voice", voice,
                              "--model-dir", str(model_dir), "--no-reuse"], env=env, capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"voxbatch submit failed ({out.returncode}): {out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1].strip()

    def wait(self, job: str, timeout_s: float) -> dict:
        from voxbatch.jobstate import RedisJobStore

        jobs = RedisJobStore(self.client)
        deadline = time.monotonic() + timeout_s
        shown = time.monotonic()
        while True:
            st = jobs.status(job)
            if st is not None and st.done + st.failed >= st.total:
                return {"segments": st.total, "done": st.done, "failed": st.failed, "audio_s": round(st.audio_s, 1),
                        "created_at": st.created_at, "finished_at": st.updated_at, "errors": dict(list(st.errors.items())[:3])}
            if self.worker is not None and self.worker.poll() is not None:
                raise RuntimeError(f"voxbatch worker died:\n{self.log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job}: {st} after {timeout_s} s; worker log tail:\n{self.log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > shown + 15:
                shown = time.monotonic()
                print(f"  job {job}: {st.done if st else '?'} done, {st.failed if st else '?'} failed of {st.total if st else '?'}", flush=True)
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the worker as a user would (SIGTERM to `voxbatch worker`) and wait for it: the launcher
        exits once its workers have, killing any still running past their stop wait itself, so the next
        worker starts on a GPU this one has left (a worker that kept running beside the next one took the
        memory its vLLM core needed, bench/results/gpu_h100_s42b_vllm_worker_stop_log.txt)."""
        if self.worker is not None and self.worker.poll() is None:
            os.killpg(self.worker.pid, 15)
            try:
                self.worker.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.worker.pid, 9)
                self.worker.wait(10)
        self.redis.terminate()
        self.redis.wait(10)
