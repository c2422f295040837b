"""How fast this machine's host side is, recorded with every GPU result.

The worker's rate follows its host's Python as much as its GPU: two H200 leases with the same GPU
speed (LLM 46.7k vs 49.3k tokens/s) gave 274.8x and 333.8x, and their baselines 1.06x and 3.38x,
because one host ran Python about 3x slower (bench/results/gpu_h200_worker16.json against
gpu_h200_worker15.json). Results from different machines compare only beside these numbers.

Three probes, each the median of 5 timed rounds after one warm-up round:
  python_loop_ns   one iteration of a plain Python loop with an add and a multiply (the interpreter);
  torch_cpu_op_us  one in-place add on a one-element CPU tensor (PyTorch's dispatch, no kernel work);
  cuda_launch_us   one in-place add on a one-element CUDA tensor, queued (what each of a vocoder
                   thread's thousands of launches per batch costs the host), synced once per round.
"""

from __future__ import annotations

import statistics
import time

import torch

ROUNDS = 5
LOOP_ITERS = 200_000
OP_CALLS = 5_000


def _median_per_call(fn, calls: int, rounds: int = ROUNDS) -> float:
    fn()  # warm-up round
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _python_loop() -> None:
    acc = 0
    for i in range(LOOP_ITERS):
        acc += i * 3
    return None


def probe(device: str | None = None) -> dict[str, float | None]:
    """The three probes (cuda_launch_us None without a CUDA device; `device` picks which)."""
    out: dict[str, float | None] = {"python_loop_ns": round(1e9 * _median_per_call(_python_loop, LOOP_ITERS), 2)}
    x = torch.zeros(1)

    def cpu_ops() -> None:
        for _ in range(OP_CALLS):
            x.add_(1)

    out["torch_cpu_op_us"] = round(1e6 * _median_per_call(cpu_ops, OP_CALLS), 3)
    out["cuda_launch_us"] = None
    if torch.cuda.is_available():
        dev = torch.device(device or "cuda:0")
        y = torch.zeros(1, device=dev)

        def launches() -> None:
            for _ in range(OP_CALLS):
                y.add_(1)
            torch.cuda.synchronize(dev)

        out["cuda_launch_us"] = round(1e6 * _median_per_call(launches, OP_CALLS), 3)
    return out
