"""Does torch's graph bookkeeping race when two threads capture, replay and release CUDA graphs?

The question behind `cuda_graphs.registry` (voxbatch/worker/cosyvoice2/cuda_graphs.py): a worker on vLLM
aborted with "an illegal memory access" at the end of a flow batch whose capture overlapped the other
vocoder thread's (bench/results/gpu_h100_s40a_vllm_worker_log.txt). Each run here is a fresh process
with no other graph (as in a worker on vLLM) in which two threads, per round, capture a graph, replay it
nine times and release the previous one, as the vocoder threads do per flow batch:

- `locked`: through `cuda_graphs.capture` and `cuda_graphs.registry` (what ships);
- `unlocked`: plain `capture_begin`/`capture_end` and a plain release (what shipped before stop 40).

A run fails when its process exits non-zero (an abort counts) or a thread's output is wrong. Prints a
table and writes JSON (commit, GPU, torch). On a machine without CUDA it exits 2 and says so.

    python -m bench.graph_race --runs 5 --rounds 400 --out bench/results --name gpu_graph_race
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from bench.provenance import REPO, commit

VARIANTS = ("locked", "unlocked")


def _thread(variant: str, seed: int, rounds: int, errors: list[str]) -> None:
    """One vocoder-like thread: per round a capture, nine replays, the previous graph released."""
    from voxbatch.worker.cosyvoice2 import cuda_graphs

    try:
        x = torch.randn(128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        out, stream, pool, last = torch.empty_like(x), torch.cuda.Stream(), torch.cuda.graph_pool_handle(), None
        with torch.cuda.stream(stream):
            torch.matmul(x, x, out=out)  # warm-up outside any capture
            for _ in range(rounds):
                graph = torch.cuda.CUDAGraph()
                if variant == "locked":
                    cuda_graphs.capture(graph, stream, pool, lambda: torch.matmul(x, x, out=out).relu_())
                    with cuda_graphs.registry(x.device):
                        last = graph
                else:
                    graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                    torch.matmul(x, x, out=out).relu_()
                    graph.capture_end()
                    last = graph
                for _ in range(9):
                    last.replay()
        stream.synchronize()
        if not torch.allclose(out, (x @ x).relu_()):
            errors.append("wrong output")
    except Exception as e:  # noqa: BLE001 - counted by the parent
        errors.append(f"{type(e).__name__}: {e}"[:300])


def child(variant: str, rounds: int) -> int:
    errors: list[str] = []
    threads = [threading.Thread(target=_thread, args=(variant, seed, rounds, errors)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    print(json.dumps({"errors": errors}))
    return 1 if errors else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh processes per variant")
    ap.add_argument("--rounds", type=int, default=400, help="captures per thread per process")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", default="graph_race")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("graph_race: needs a CUDA device", file=sys.stderr)
        return 2
    if args.child:
        return child(args.child, args.rounds)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.runs):
        for variant in VARIANTS:  # interleaved, so a machine's drift touches both
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "bench.graph_race", "--child", variant, "--rounds", str(args.rounds)],
                                  cwd=REPO, capture_output=True, text=True, timeout=600)
            out = proc.stdout + proc.stderr
            runs[variant].append({"rc": proc.returncode, "wall_s": round(time.perf_counter() - t, 2),
                                  "tail": out[-600:], "error": _first_error(out) if proc.returncode else None})
    result = {"commit": commit(), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "rounds": args.rounds, "runs": runs,
              "failed": {v: sum(r["rc"] != 0 for r in rs) for v, rs in runs.items()}}
    print("| variant | runs | failed | wall s (mean) |\n|---|---|---|---|")
    for v, rs in runs.items():
        print(f"| {v} | {len(rs)} | {result['failed'][v]} | {sum(r['wall_s'] for r in rs) / len(rs):.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["failed"]["locked"] == 0 else 1


def _first_error(output: str) -> str:
    """The lines that say what went wrong in a failed child (an abort's C++ stack runs on below them and
    the tail keeps only that: gpu_h100_s41b_graph_race.json)."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if "error" in line.lower() or "terminate called" in line or "Exception" in line:
            return "\n".join(lines[i:i + 4])[:800]
    return "\n".join(lines[:4])[:800]


if __name__ == "__main__":
    sys.exit(main())
