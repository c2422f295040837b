"""Capturing a CUDA graph while other threads of the process keep using the GPU.

`torch.cuda.graph(...)` synchronizes the whole device before it captures. In a worker that is an
error whenever another thread is capturing at that moment ("operation not permitted when stream is
capturing"): the flow's Euler-step graphs are captured per batch on the vocoder threads, and vLLM's
RAS processor captures its step on first use of a row count. With vLLM's engine core in the
worker's process that collision failed 484 of 500 segments on an H200
(bench/results/gpu_h200_vllm6.json). Capturing here needs no device-wide sync: the capture stream
waits for the current one, captures in thread-local mode (the other threads' CUDA calls go on), and
the current stream waits for it after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool, fn: Callable[[], object]) -> None:
    """Record `fn()` into `graph` on `stream` (not the legacy default stream), into `pool`.
    Raises what the capture raises; the current stream then does not wait for `stream`."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)  # fn's inputs are written on `current`
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
