"""cuda_graphs.capture: a graph captured while another thread of the process is capturing its own."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.gpu
def test_capture_while_another_thread_captures_on_gpu() -> None:
    """A second thread holds a thread-local capture open (as a vocoder thread does with the flow's
    Euler step) while this thread captures through cuda_graphs.capture: it succeeds and its replay
    computes what the eager call computes, and the other capture ends intact. torch.cuda.graph() in
    the same spot syncs the whole device first, which is not permitted during the other capture: that
    failed the worker's vLLM engine with its core in the worker's process (gpu_h200_vllm6.json)."""
    from voxbatch.worker.cosyvoice2 import cuda_graphs

    x = torch.randn(64, 64, device="cuda")
    out = torch.empty_like(x)
    opened, release, errors = threading.Event(), threading.Event(), []

    def other_thread() -> None:
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        y = torch.randn(64, 64, device="cuda")
        try:
            with torch.cuda.stream(s):
                (y @ y).relu_()  # warm-up: cuBLAS's handle and workspace for this thread and stream
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    (y @ y).relu_()
                    opened.set()
                    release.wait(30)
                finally:
                    g.capture_end()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            opened.set()

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert opened.wait(30)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):  # warm-up, as the engine's callers do before they capture
            torch.matmul(x, x, out=out)
        cuda_graphs.capture(graph, stream, torch.cuda.graph_pool_handle(), lambda: torch.matmul(x, x, out=out))
    finally:
        release.set()
        t.join(30)
    assert not errors, errors
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x @ x)



@pytest.mark.gpu
def test_two_threads_capture_replay_and_release_graphs_on_gpu() -> None:
    """Two threads each capture a graph per round, replay it and release the last one, in a process with
    no other graph (a worker on vLLM: the LLM's graphs live in the engine core's process), as the two
    vocoder threads do per flow batch. Torch up to 2.12 keeps all captures' RNG bookkeeping in one
    unlocked object per generator, freed when its last graph goes (cuda_graphs' docstring); through
    cuda_graphs.capture and registry every round ends with the right output and the process exits cleanly.
    The loop is bench/graph_race.py's (its `locked` variant, which the bench sets beside the unlocked one),
    in a process of its own: a corrupted CUDA context would take pytest down with it."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", "bench.graph_race", "--child", "locked", "--rounds", "400"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert '"errors": []' in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: on a GPU the bench measures")
def test_capture_stall_bench_refuses_a_machine_without_cuda() -> None:
    """bench/capture_stall.py measures CUDA launches only: without a CUDA device it exits 2 with one line."""
    proc = subprocess.run([sys.executable, "-m", "bench.capture_stall", "--window-s", "0.1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "capture_stall: needs a CUDA device", proc.stderr[-2000:]
