"""`voxbatch worker --gpus 0,1`: one pinned worker process per GPU, restarted if it dies.

For bare-metal hosts with several GPUs and no orchestrator. Containers do not use it: each runs one
`python -m voxbatch.worker.main` and Kubernetes or compose restarts it (infra/, compose.yaml), so
nothing supervises what the orchestrator already supervises.

CUDA_VISIBLE_DEVICES is set in each child's environment before the child starts, so the pinning
holds before anything imports torch. A child that exits unexpectedly (SIGKILL, OOM, a pipeline
thread that died) is started again after a jittered backoff (voxbatch/outage.py) that doubles with
each quick death and resets once a child has run for `HEALTHY_S`; its unacknowledged task returns to the queue through the broker's visibility timeout,
and the per-segment attempt counter in Redis ends a poison task's loop. SIGTERM/SIGINT are passed
on: each child stops taking tasks, gives its in-flight segments the shutdown window, hands back
what is unfinished (worker/main.py), and the launcher exits when all children have; a child still
running `stop_wait_s` after the signal (its window, its grace and a margin) is killed, and the
launcher then exits 1. A child that exits with `BAD_START_EXIT` could not start with the settings
and files it was given (worker/main.py): every restart would fail the same way, so the launcher stops
the other children and exits 2 instead of restarting it. Each child also gets SIGTERM when the launcher dies, even by SIGKILL
(worker/main.py, `die_with_launcher`), so no worker outlives it holding its GPU.

Each child leads a process group of its own, and whatever is left in that group when the child has
exited is killed before anything else starts on its GPU. An engine's helper processes outlive a worker
that dies without cleanup: vLLM 0.26's engine core (a spawned child holding the KV cache, 35 GiB at the
default memory share) stayed up after its worker aborted on an H100, and the restarted worker's own
core took as much again, so flow and HiFT ran out of memory on every segment after
(bench/results/gpu_h100_s40a_vllm_worker_log.txt).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from voxbatch.outage import backoff_s
from voxbatch.worker.mps import MpsDaemon

# A child that ran this long before dying is not crash-looping: its next restart waits the least.
HEALTHY_S = 60.0
# How long a dead child's leftover processes get to disappear after SIGKILL before the launcher goes on.
REAP_WAIT_S = 10.0
# Exit status of a worker process that cannot start with its settings and files: a bad setting, a missing
# or incomplete model folder, a GPU memory cap below what the engine needs (worker/main.py). Not
# restarted: a restart meets the same input. 2, the CLI's exit status for bad input.
BAD_START_EXIT = 2
# Each child's environment names the launcher's pid here; the child stops itself when that process dies.
LAUNCHER_PID_ENV = "VOXBATCH_LAUNCHER_PID"
# Past a child's shutdown window and grace (worker/main.py), how long its exit may take (closing its
# engine: a vLLM core's shutdown) before the launcher kills it.
EXIT_MARGIN_S = 30.0


def _spawn(gpu: str | None, concurrency: int | None, queues: str | None,
           env_overrides: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, **env_overrides, LAUNCHER_PID_ENV: str(os.getpid())}
    cmd = [sys.executable, "-m", "voxbatch.worker.main"]
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd += ["--gpu", gpu, "--hostname", f"voxbatch-gpu{gpu}@{socket.gethostname()}"]
    if concurrency:
        cmd += ["--concurrency", str(concurrency)]
    if queues:
        cmd += ["--queues", queues]
    return subprocess.Popen(cmd, env=env, start_new_session=True)  # its own process group: see _kill_leftovers


def _kill_leftovers(child: subprocess.Popen) -> None:
    """SIGKILL what is left of an exited child's process group (its helper processes) and wait, at most
    REAP_WAIT_S, until none of them runs: a GPU's memory is free once its holders have exited."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # nothing left
    deadline = time.monotonic() + REAP_WAIT_S
    while _group_running(child.pid):
        if time.monotonic() > deadline:
            print(f"voxbatch: processes of worker pid {child.pid} still running {REAP_WAIT_S:.0f}s after SIGKILL",
                  file=sys.stderr, flush=True)
            return
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` has not exited yet. A killed orphan stays a zombie until its new
    parent reaps it, which holds no memory, so zombies do not count; where /proc cannot be read, any
    member counts."""
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def run_workers(gpus: list[str] | None, concurrency: int | None = None, queues: str | None = None,
                restart: bool = True, env_overrides: dict[str, str] | None = None, mps: bool = False,
                stop_wait_s: float = 120.0) -> int:
    """Start one process per GPU (or one unpinned process when `gpus` is None) and supervise them.

    `env_overrides` carries settings given as CLI flags (VOXBATCH_ENGINE=...) to the children; with
    `mps`, a CUDA MPS daemon of the launcher's own serves them (voxbatch/worker/mps.py) until it exits.
    Told to stop, it waits `stop_wait_s` for each child to finish, then kills what is left (exit 1).
    """
    daemon = MpsDaemon().start() if mps else None
    try:
        return _supervise(gpus, concurrency, queues, restart, {**(env_overrides or {}), **(daemon.env if daemon else {})},
                          stop_wait_s)
    finally:
        if daemon is not None:
            daemon.stop()


def _supervise(gpus: list[str] | None, concurrency: int | None, queues: str | None, restart: bool,
               extra: dict[str, str], stop_wait_s: float) -> int:
    slots: list[str | None] = list(gpus) if gpus else [None]
    procs = {slot: _spawn(slot, concurrency, queues, extra) for slot in slots}
    started = {slot: time.monotonic() for slot in slots}
    stopping = False

    def _forward(signum, _frame):
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, _forward)
    signal.signal(signal.SIGINT, _forward)
    # A closed terminal: each child is in a session of its own (see _spawn) and no longer gets the
    # terminal's SIGHUP, so the launcher stops them as it would on SIGTERM instead of leaving them running.
    signal.signal(signal.SIGHUP, lambda _signum, frame: _forward(signal.SIGTERM, frame))
    restarts = {slot: 0 for slot in slots}
    exit_code = 0
    while True:
        time.sleep(0.5)
        if stopping:
            deadline, code = time.monotonic() + stop_wait_s, 0
            for slot, p in procs.items():
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"voxbatch: worker for GPU {slot} (pid {p.pid}) still running {stop_wait_s:.0f}s after "
                          "the stop signal; killing it", file=sys.stderr, flush=True)
                    code = 1
                _kill_leftovers(p)
                p.wait()
            return max(code, exit_code)
        for slot, p in list(procs.items()):
            code = p.poll()
            if code is None:
                continue
            _kill_leftovers(p)
            if not restart:
                return code
            if code == BAD_START_EXIT:  # its own error line says what; a restart would meet the same
                print(f"voxbatch: worker for GPU {slot} cannot start with these settings (its error is above); "
                      "stopping the others, not restarting", file=sys.stderr, flush=True)
                exit_code = BAD_START_EXIT
                _forward(signal.SIGTERM, None)
                break
            if time.monotonic() - started[slot] >= HEALTHY_S:
                restarts[slot] = 0
            restarts[slot] += 1
            delay = backoff_s(restarts[slot] + 1, 500, 30_000)
            print(f"voxbatch: worker for GPU {slot} exited with {code}; restarting in {delay:.1f}s",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
            if stopping:
                break  # a SIGTERM arrived during the backoff: no new child, nothing to pass it to
            procs[slot] = _spawn(slot, concurrency, queues, extra)
            started[slot] = time.monotonic()
            if stopping:  # it arrived while spawning, before the new child was in `procs`
                procs[slot].send_signal(signal.SIGTERM)
