"""Tokens/s of the two language-model backends (`torch`, `vllm`) side by side, on one machine.

Both decode the same requests (the fixture's prompt, RAS or greedy, fixed seeds, eos masked for the
whole length so every request runs to max_tokens unless a sampled extra stop id ends it; the tokens
really produced are counted). Each backend is warmed up first; start-up time is reported separately.

    python -m bench.llm_backends --model-dir ../shared/fixtures/cosyvoice2-tiny --batch 1 8 32

Writes a table to stdout and JSON + Markdown to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    backend: str
    mode: str  # "ras" or "greedy"
    batch: int
    tokens: int  # generated, all requests
    seconds: float
    tokens_per_s: float
    first_result_s: float  # until the first finished request came back


def hardware() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, object] = {
        "cpu": cpu,
        "cpus_visible": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def requests_for(model_dir: Path, batch: int, max_tokens: int, greedy: bool) -> list[LlmRequest]:
    with np.load(model_dir / "reference.npz") as z:
        text = [int(t) for t in np.concatenate([z["llm_prompt_text_token"], z["llm_text_token"]])]
        speech = [int(t) for t in z["llm_prompt_speech_token"]]
    # Vary the prompt a little per request so the batch holds mixed lengths.
    return [
        LlmRequest(text[: len(text) - i % 4], speech[: len(speech) - i % 7], min_tokens=max_tokens, max_tokens=max_tokens, seed=1000 + i, greedy=greedy)
        for i in range(batch)
    ]


def measure(backend: LlmBackend, reqs: list[LlmRequest], mode: str) -> Row:
    start = time.perf_counter()
    first = None
    tokens = 0
    for result in backend.generate(reqs):
        if first is None:
            first = time.perf_counter() - start
        tokens += len(result.tokens)
    seconds = time.perf_counter() - start
    return Row(backend.name, mode, len(reqs), tokens, round(seconds, 4), round(tokens / seconds, 1), round(first or 0.0, 4))


def build_backends(model_dir: Path, max_batch: int, max_seq: int, which: list[str]) -> dict[str, tuple[Callable[[], LlmBackend], float]]:
    out: dict[str, tuple[Callable[[], LlmBackend], float]] = {}
    if "torch" in which:
        from worker.cosyvoice2.torch_backend import TorchLlmBackend

        t = time.perf_counter()
        tb = TorchLlmBackend.from_model_dir(model_dir, device="cuda" if torch.cuda.is_available() else "cpu", max_batch=max_batch, max_seq=max_seq)
        out["torch"] = (lambda tb=tb: tb, time.perf_counter() - t)
    if "vllm" in which:
        from worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions

        t = time.perf_counter()
        vb = VllmLlmBackend(model_dir, VllmOptions(max_model_len=max_seq, max_num_seqs=max_batch))
        out["vllm"] = (lambda vb=vb: vb, time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=REPO.parent / "shared" / "fixtures" / "cosyvoice2-tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["ras", "greedy"], choices=["ras", "greedy"])
    ap.add_argument("--backends", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the torch backend")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    max_batch = max(args.batch)
    backends = build_backends(args.model_dir, max_batch, 512 + args.max_tokens, args.backends)
    rows: list[Row] = []
    for name, (get, _startup) in backends.items():
        backend = get()
        if name == "torch":
            torch.set_num_threads(args.threads)  # vLLM's CPU worker may have re-pinned the threads
        for mode in args.modes:
            greedy = mode == "greedy"
            list(backend.generate(requests_for(args.model_dir, 2, 8, greedy)))  # warm-up
            for batch in args.batch:
                rows.append(measure(backend, requests_for(args.model_dir, batch, args.max_tokens, greedy), mode))
                print(f"{rows[-1].backend:6s} {mode:6s} B={batch:3d}  {rows[-1].tokens_per_s:9.1f} tok/s", flush=True)

    hw = hardware()
    hw["torch_threads"] = args.threads
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = {
        "when": stamp,
        "model_dir": str(args.model_dir),
        "max_tokens": args.max_tokens,
        "hardware": hw,
        "startup_s": {name: round(s, 2) for name, (_, s) in backends.items()},
        "rows": [asdict(r) for r in rows],
    }
    lines = [
        f"# LLM backends, {stamp}",
        "",
        f"hardware: {hw['cpu']} ({hw['cpus_visible']} CPUs visible), GPU {hw['cuda']}; torch {hw['torch']}, vLLM {hw['vllm']}; "
        f"model {args.model_dir.name}; {args.max_tokens} tokens per request",
        "",
        "| mode | batch | " + " | ".join(f"{b} tok/s" for b in backends) + " | " + " | ".join(f"{b} first result s" for b in backends) + " |",
        "|---|---|" + "---|" * (2 * len(backends)),
    ]
    for mode in args.modes:
        for batch in args.batch:
            by = {r.backend: r for r in rows if r.mode == mode and r.batch == batch}
            lines.append(
                f"| {mode} | {batch} | "
                + " | ".join(f"{by[b].tokens_per_s:.1f}" for b in backends)
                + " | "
                + " | ".join(f"{by[b].first_result_s:.3f}" for b in backends)
                + " |"
            )
    lines += ["", "start-up s: " + ", ".join(f"{k} {v}" for k, v in report["startup_s"].items())]
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "gpu" if hw["cuda"] else "cpu"
    name = f"llm_backends_{device}_{args.model_dir.name}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
