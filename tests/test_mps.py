"""The launcher's CUDA MPS daemon on a real GPU: a worker-like child pinned by CUDA_VISIBLE_DEVICES runs its
kernels through the daemon's server, and the daemon goes when asked. (The launcher's use of it, with a
stand-in binary on a CPU machine, is in test_distributed.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from voxbatch.worker.mps import CONTROL, MpsDaemon

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(shutil.which(CONTROL) is None, reason=f"needs {CONTROL} (the NVIDIA driver's utilities)")]

# A client: one matmul on its GPU, checked on the host, then it waits for the test to read the server list.
CLIENT = """
import sys, torch
a = torch.ones(256, 256, device="cuda")
assert float((a @ a)[0, 0]) == 256.0
print("ok", flush=True)
sys.stdin.readline()
"""


def test_a_pinned_client_runs_through_the_daemons_server_and_the_daemon_quits():
    daemon = MpsDaemon().start()
    try:
        env = {**os.environ, **daemon.env, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
        child = subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ok", child.stderr.read()
        servers = subprocess.run([daemon.binary], input="get_server_list\n", env=daemon.control_env(), capture_output=True,
                                 text=True, timeout=30).stdout.split()
        assert servers and all(s.isdigit() for s in servers)  # the client's context lives in an MPS server
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0
    finally:
        daemon.stop()
    assert not daemon.root.exists()
