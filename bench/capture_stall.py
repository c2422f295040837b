"""Does one thread's CUDA graph capture hold up another thread's GPU launches?

The question behind the vocoder-only tail's dips: on an H200 the GPU fell to 12-48% busy at each flow
batch's turnover, when one vocoder thread began a batch (eager encoder and first Euler step, then the
step's graph capture under `cuda_graphs.registry`) while the other thread's batch was mid-way and
launching (bench/results/gpu_h200_worker23.json, raw utilisation against its log); the GIL probe read
only 0.13-0.46 ms there. If a capture (recording ~1,250 ops, then instantiating the graph) blocked
the other thread's launches in the driver, the fix would be fewer captures; if it costs that thread
only what the same ops launched eagerly cost, the dips are host work, and the fix is fewer launches.

Two threads on their own CUDA streams, as the vocoder threads are, at the worker's GIL switch
interval (settings.gil_switch_interval_ms, 1 ms):

- the *launcher* launches small kernels (in-place elementwise ops on a 1M-element tensor, a few
  microseconds each on the GPU, so its rate is its launch rate) for the whole window;
- the *other* thread, per variant: nothing (`alone`); the same op chain as a flow step (`--ops`
  kernels) launched eagerly, again and again (`eager`); that chain captured as a CUDA graph through
  `cuda_graphs.capture` (what ships: the process's graph lock, thread-local mode), replayed nine
  times and the previous graph released under `cuda_graphs.registry`, as a vocoder thread does per
  batch (`capture`).

Reported per variant: the launcher's launches per second and their ratio to `alone`, the other
thread's rounds and milliseconds per round. Variants run interleaved (`--rounds` times each, one
process), so a machine's drift touches all. Prints a table and writes JSON (commit, GPU, torch);
on a machine without CUDA it exits 2 and says so.

    python -m bench.capture_stall --window-s 2 --rounds 2 --out bench/results --name gpu_capture_stall
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

from bench.provenance import REPO, commit
from voxbatch.settings import Settings

VARIANTS = ("alone", "eager", "capture")
SWITCH_INTERVAL_S = Settings.model_fields["gil_switch_interval_ms"].default / 1000  # the worker's default


def _chain(x: torch.Tensor, n: int) -> None:
    """n small in-place kernels on x (values stay bounded: a scale below 1, then a shift back)."""
    for i in range(n):
        if i % 2:
            x.add_(0.001)
        else:
            x.mul_(0.999)


def _launcher(stop: threading.Event, counted: list[int]) -> None:
    x = torch.ones(1 << 20, device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()):
        n = 0
        while not stop.is_set():
            _chain(x, 100)
            n += 100
        torch.cuda.current_stream().synchronize()
    counted.append(n)


def _other(variant: str, ops: int, stop: threading.Event, rounds_ms: list[float]) -> None:
    from voxbatch.worker.cosyvoice2 import cuda_graphs

    x = torch.ones(1 << 20, device="cuda")
    stream, pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
    held: list[torch.cuda.CUDAGraph] = []  # this round's graph and, until it is captured, the last one
    with torch.cuda.stream(stream):
        _chain(x, ops)  # warm-up outside any capture
        while not stop.is_set():
            began = time.perf_counter()
            if variant == "eager":
                _chain(x, ops)
            else:
                held.append(torch.cuda.CUDAGraph())
                cuda_graphs.capture(held[-1], stream, pool, lambda: _chain(x, ops))
                for _ in range(9):
                    held[-1].replay()
                with cuda_graphs.registry(x.device):
                    del held[:-1]  # the previous round's graph is released here
            rounds_ms.append(1000 * (time.perf_counter() - began))
        stream.synchronize()
    with cuda_graphs.registry(x.device):
        held.clear()  # the last graph released under the lock too


def measure(variant: str, window_s: float, ops: int) -> dict:
    """One window of `variant`: the launcher's launches per second, the other thread's rounds."""
    stop, counted, rounds_ms = threading.Event(), [], []
    threads = [threading.Thread(target=_launcher, args=(stop, counted))]
    if variant != "alone":
        threads.append(threading.Thread(target=_other, args=(variant, ops, stop, rounds_ms)))
    began = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(window_s)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    return {"launches_per_s": round(counted[0] / wall), "other_rounds": len(rounds_ms),
            "other_ms_per_round": round(sum(rounds_ms) / len(rounds_ms), 2) if rounds_ms else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window-s", type=float, default=2.0, help="seconds per measured window")
    ap.add_argument("--rounds", type=int, default=2, help="windows per variant, interleaved")
    ap.add_argument("--ops", type=int, default=1250, help="kernels in the other thread's chain (a flow step's ~1,250)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", default="capture_stall")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("capture_stall: needs a CUDA device", file=sys.stderr)
        return 2
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    measure("alone", 0.5, args.ops)  # CUDA context, kernels and streams made before anything counts
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            runs[variant].append(measure(variant, args.window_s, args.ops))
    alone = sum(r["launches_per_s"] for r in runs["alone"]) / len(runs["alone"])
    summary = {}
    for v, rs in runs.items():
        rate = sum(r["launches_per_s"] for r in rs) / len(rs)
        per_round = [r["other_ms_per_round"] for r in rs if r["other_ms_per_round"] is not None]
        summary[v] = {"launches_per_s": round(rate), "of_alone": round(rate / alone, 3),
                      "other_ms_per_round": round(sum(per_round) / len(per_round), 2) if per_round else None}
    result = {"commit": commit(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "window_s": args.window_s, "rounds": args.rounds, "ops": args.ops,
              "switch_interval_s": SWITCH_INTERVAL_S, "runs": runs, "summary": summary}
    print("| other thread | launcher launches/s | of alone | other thread ms per round |\n|---|---|---|---|")
    for v, s in summary.items():
        print(f"| {v} | {s['launches_per_s']:,} | {s['of_alone']:.3f} | {s['other_ms_per_round'] or '-'} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
