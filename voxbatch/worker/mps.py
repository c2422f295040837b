"""A CUDA MPS control daemon of the launcher's own, so a worker and its vLLM core share the GPU's SMs.

Why: without MPS, kernels of different processes never run on a GPU at the same time; the driver
gives each process's context the whole GPU in turn (time slices). A worker on vLLM is two processes
on one GPU: its engine core (the LLM's decode steps, a few ms of small kernels each) and the worker
(flow and HiFT, big kernels). Time-sliced, the decode step cannot take the SMs that flow's kernels
leave free, as it does in the torch worker (one process, the LLM on a higher-priority stream), and
every switch between the two contexts costs GPU time. Under MPS both processes' kernels go through
one server context and run side by side.

The daemon is private to one launcher (its pipe and log folders are fresh temporary folders, given
to each worker through CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, which the vLLM core and
any other child inherit), so it neither joins nor disturbs a host-wide MPS setup. One daemon serves
every GPU of the launcher; each worker keeps its CUDA_VISIBLE_DEVICES pinning, which MPS reads
relative to the devices the daemon sees (all of them: it starts without CUDA_VISIBLE_DEVICES). It is
asked to quit when the launcher exits.
Containers that run `python -m voxbatch.worker.main` directly get MPS from their orchestrator
(e.g. the NVIDIA device plugin's MPS sharing) instead: docs/scaling.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"  # ships with the NVIDIA driver's utilities
QUIT_TIMEOUT_S = 30.0


class MpsError(RuntimeError):
    """The MPS daemon could not be started (no binary, or it refused); the message is one line."""


class MpsDaemon:
    """`nvidia-cuda-mps-control -d` over folders of its own; `env` is what its clients need."""

    def __init__(self, root: Path | None = None):
        self.binary = shutil.which(CONTROL)
        if self.binary is None:
            raise MpsError(f"cuda_mps is on but {CONTROL} is not on PATH (it comes with the NVIDIA driver's "
                           "utilities; in a container, the 'utility' driver capability)")
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="voxbatch-mps-"))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        self.running = False

    def start(self) -> "MpsDaemon":
        for d in self.env.values():
            Path(d).mkdir(parents=True, exist_ok=True)
        try:
            # -d forks the daemon into the background and returns; its server starts at the first client.
            done = subprocess.run([self.binary, "-d"], env=self.control_env(), capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            shutil.rmtree(self.root, ignore_errors=True)
            raise MpsError(f"{CONTROL} -d did not start: {type(e).__name__}: {e}") from None
        if done.returncode != 0:
            shutil.rmtree(self.root, ignore_errors=True)
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise MpsError(f"{CONTROL} -d exited {done.returncode}: {last[0]}")
        self.running = True
        return self

    def stop(self) -> None:
        """Ask the daemon to quit (it stops its server once the last client has gone) and drop its folders."""
        if self.running:
            self.running = False
            try:
                subprocess.run([self.binary], input="quit\n", env=self.control_env(), capture_output=True, text=True,
                               timeout=QUIT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass  # a daemon that does not answer keeps its folders (it may still be using them)
            else:
                shutil.rmtree(self.root, ignore_errors=True)

    def control_env(self) -> dict[str, str]:
        """The daemon sees every GPU (the workers' CUDA_VISIBLE_DEVICES pick theirs among them)."""
        env = {**os.environ, **self.env}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return env
