"""Capturing a CUDA graph while other threads of the process keep using the GPU.

`torch.cuda.graph(...)` synchronizes the whole device before it captures. In a worker that is an
error whenever another thread is capturing at that moment ("operation not permitted when stream is
capturing"): the flow's Euler-step graphs are captured per batch on the vocoder threads, and vLLM's
RAS processor captures its step on first use of a row count. With vLLM's engine core in the
worker's process that collision failed 484 of 500 segments on an H200
(bench/results/gpu_h200_vllm6.json). Capturing here needs no device-wide sync: the capture stream
waits for the current one, captures in thread-local mode (the other threads' CUDA calls go on), and
the current stream waits for it after.

Captures and releases of graphs also hold one lock for the process (`registry`). Torch up to 2.12 keeps
the graph-safe RNG state of each device's default generator in one object for all captures
(`CUDAGeneratorState`): every capture adds its graph to an unlocked set there, a graph's destructor
removes it, every replay refills two device tensors of that state, and those tensors are freed when the
set empties and made anew at the next capture (torch 2.13 keeps a state per capture instead). The
vocoder threads capture and release a graph per flow batch, so two threads mutated that set at once, and
in a process whose only graphs are those per-batch ones (a worker on vLLM: its LLM's graphs live in the
engine core's process) it could empty while another thread's replay refilled the tensors being freed.
A worker on vLLM aborted on an H100 with "an illegal memory access" at the end of a flow batch whose
capture overlapped the other vocoder thread's (bench/results/gpu_h100_s40a_vllm_worker_log.txt); the
torch worker keeps its LLM's decode graphs for its life, so the set never empties there. Under the lock,
and with one small graph per device kept for the life of the process (`_anchor`), the set never empties
and only one thread changes it at a time. Replays need no lock: the tensors they refill then never move.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# False: `registry` neither locks nor anchors (torch's own behaviour, not safe with two capturing
# threads: bench/results/gpu_h100_s41b_graph_race.json); only for the bench's A/B of what the lock
# costs a worker. Bench switch `glock`.
SERIALIZED = True
_lock = threading.RLock()
_anchors: dict[str, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # device -> a graph kept for the process's life


@contextmanager
def registry(device: torch.device | str) -> Iterator[None]:
    """Hold the process's graph lock, with `device`'s anchor graph made: around every capture and every
    release of a graph (dropping the last reference to one), so one thread at a time changes torch's
    per-generator set of graphs."""
    device = torch.device(device)
    if not SERIALIZED:
        yield
        return
    with _lock:
        if device.type == "cuda":  # elsewhere (a CPU test of the plumbing) there are no graphs to keep apart
            _anchor(device)
        yield


def _anchor(device: torch.device) -> None:
    """One tiny graph on `device`, captured once and never released: the generator's set of graphs is
    never empty again, so the tensors every replay refills are made once and never freed."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    key = str(device)
    if key in _anchors:
        return
    buf = torch.zeros(1, device=device)
    buf.add_(1)  # the kernel's first launch outside the capture
    graph = torch.cuda.CUDAGraph()
    _record(graph, torch.cuda.Stream(device), None, lambda: buf.add_(1))
    _anchors[key] = (graph, buf)


def capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool, fn: Callable[[], object]) -> None:
    """Record `fn()` into `graph` on `stream` (not the legacy default stream), into `pool`, holding the
    graph lock (`registry`). Raises what the capture raises; the current stream then does not wait for `stream`."""
    with registry(stream.device):
        _record(graph, stream, pool, fn)


def _record(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool, fn: Callable[[], object]) -> None:
    """`capture`'s recording, without the lock (the anchor is recorded under it already)."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)  # fn's inputs are written on `current`
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
