"""cuda_graphs.capture: a graph captured while another thread of the process is capturing its own."""

import threading

import pytest
import torch


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
