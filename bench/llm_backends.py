"""The two language-model backends (`torch`, `vllm`) side by side on one machine, and the whole engine.

Part 1, LLM tokens/s: both backends decode the same requests (the fixture's prompt, RAS or greedy,
fixed seeds, eos masked for the whole length so every request runs to max_tokens unless a sampled
extra stop id ends it; the tokens really produced are counted).
Part 2, engine CPU time per second of audio: `CosyVoice2Engine` (LLM + flow + HiFT, the code path of
`voxbatch render` and the worker) on a batch of segments with each LLM backend; process CPU time (all
threads) and wall time over seconds of audio produced. The LLM decodes greedily here, so both
backends decode the same tokens and flow/HiFT do the same work (with RAS the random weights sometimes
draw one of the two extra stop ids, at different steps per backend; RAS decode cost is part 1's);
each segment's text is long enough that eos stays masked (2 x text tokens >= `--e2e-tokens`).

Fair by construction: one intra-op thread count for both backends at a time (`--threads`, default 1
and all visible CPUs, each a separate set of rows; the vLLM driver thread adopts the process's count,
and the count is read back from each backend and recorded); each
backend warmed up before it is timed; every timing repeats the batch until it lasts at least
`--min-seconds` (default 2 s), and is taken `--repeats` times (default 3): the median is reported,
min and max are kept in the JSON. Backends run one after the other, each closed before the next
starts. The load average before and after is recorded (the machine may be shared).

    python -m bench.llm_backends --model-dir ../shared/fixtures/cosyvoice2-tiny

Writes a table to stdout and JSON + Markdown to bench/results/llm_backends_<cpu|gpu>_<model>.*.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from bench.provenance import FIXTURE
from voxbatch.worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest

REPO = Path(__file__).resolve().parents[1]
PROMPT_TEXT = "Good morning, we are testing speech synthesis today."
E2E_TEXT = (
    "The boat came in at dawn, and the gulls circled the mast while the crew tied up at the old pier.",
    "By nine the market was full, and the smell of fresh bread drifted across the square.",
    "Nobody on the pier said a word until the last of the nets had been lifted onto the stones.",
    "Later that evening the wind turned, and the first drops of rain began to fall on the harbour.",
)


@dataclass
class Row:
    backend: str
    mode: str  # "ras" or "greedy"
    batch: int
    rounds: int  # generate() calls of the whole batch per timing
    tokens: int  # generated per timing, all requests and rounds
    seconds: float  # median timing
    tokens_per_s: float  # median of the repeats
    tokens_per_s_min: float
    tokens_per_s_max: float
    first_result_s: float  # median time until the first finished request of a call came back
    threads: int  # intra-op threads the backend ran with


@dataclass
class E2eRow:
    backend: str
    segments: int
    speech_tokens: int  # per timing, all segments
    audio_s: float  # seconds of audio per timing
    wall_s: float  # median
    cpu_s: float  # median process CPU time (all threads)
    cpu_s_per_audio_s: float  # median of the repeats
    cpu_s_per_audio_s_min: float
    cpu_s_per_audio_s_max: float
    rtf: float  # wall seconds per second of audio (median)
    threads: int


def hardware() -> dict[str, object]:
    cpu, physical = platform.processor(), set()
    try:
        core: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (s.strip() for s in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key in ("physical id", "core id"):
                core[key] = value
                if len(core) == 2:
                    physical.add((core["physical id"], core["core id"]))
                    core = {}
    except OSError:
        pass
    info: dict[str, object] = {
        "cpu": cpu,
        "cpus_logical": os.cpu_count(),
        "cores_physical": len(physical) or None,
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


def repeat_timed(run: Callable[[], object], min_seconds: float, repeats: int) -> tuple[int, list[tuple[float, object]]]:
    """Rounds per timing so that one timing lasts >= min_seconds (from a probe), then `repeats` timings."""
    t = time.perf_counter()
    run()
    probe = time.perf_counter() - t
    rounds = max(1, math.ceil(min_seconds / max(probe, 1e-3)))
    timings = []
    for _ in range(repeats):
        t = time.perf_counter()
        outs = [run() for _ in range(rounds)]
        timings.append((time.perf_counter() - t, outs))
    return rounds, timings


def measure_llm(backend: LlmBackend, reqs: list[LlmRequest], mode: str, threads: int, min_seconds: float, repeats: int) -> Row:
    def once() -> tuple[int, float]:
        start, first, tokens = time.perf_counter(), None, 0
        for result in backend.generate(reqs):
            if first is None:
                first = time.perf_counter() - start
            tokens += len(result.tokens)
        return tokens, first or 0.0

    rounds, timings = repeat_timed(once, min_seconds, repeats)
    rates = [sum(n for n, _ in outs) / s for s, outs in timings]
    tokens = sum(n for n, _ in timings[0][1])
    return Row(
        backend.name, mode, len(reqs), rounds, tokens, round(statistics.median(s for s, _ in timings), 3),
        round(statistics.median(rates), 1), round(min(rates), 1), round(max(rates), 1),
        round(statistics.median(f for _, outs in timings for _, f in outs), 4), threads,
    )


def build_llm(name: str, model_dir: Path, max_batch: int, max_seq: int) -> LlmBackend:
    if name == "torch":
        from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

        return TorchLlmBackend.from_model_dir(model_dir, device="cuda" if torch.cuda.is_available() else "cpu", max_batch=max_batch, max_seq=max_seq)
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions

    return VllmLlmBackend(model_dir, VllmOptions(max_model_len=max_seq, max_num_seqs=max_batch))


def backend_threads(backend: LlmBackend) -> int:
    """The intra-op threads the backend decodes with (vLLM: those its driver thread set for itself)."""
    return int(getattr(backend, "_threads", torch.get_num_threads()))


def close(backend: object) -> None:
    if hasattr(backend, "close"):
        backend.close()


def measure_engine(name: str, model_dir: Path, segments: int, tokens: int, min_seconds: float, repeats: int) -> E2eRow:
    """CPU and wall time per second of audio of the whole engine with LLM backend `name`."""
    from voxbatch.producer.voice import create_voice
    from voxbatch.models import SynthesisParams
    from voxbatch.settings import Settings
    from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine, _Item
    from voxbatch.worker.engine import SynthesisRequest

    profile = create_voice(model_dir, "bench", model_dir / "prompt_24k.wav", PROMPT_TEXT)
    settings = Settings(engine="cosyvoice2", llm_backend=name, model_dir=str(model_dir), engine_max_batch=segments)
    engine = CosyVoice2Engine.from_model_dir(model_dir, load_voice=lambda _: profile, llm_backend=name, max_batch=segments,
                                             settings=settings)
    try:
        engine.warmup()
        texts = [" ".join(E2E_TEXT[(i + k) % len(E2E_TEXT)] for k in range(3)) for i in range(segments)]
        batch = [SynthesisRequest(f"s{i}", t, "bench", 7 + i, SynthesisParams(max_tokens=tokens)) for i, t in enumerate(texts)]
        voice = engine.voices.get("bench")
        llm = [dataclasses.replace(engine.llm_request(r, voice), greedy=True) for r in batch]
        if min(r.min_tokens for r in llm) < tokens:
            raise ValueError(f"--e2e-tokens {tokens}: eos would be unmasked after {min(r.min_tokens for r in llm)} tokens")

        def once() -> tuple[float, int]:
            cpu = time.process_time()
            samples = 0
            # synthesize() minus the voice lookup and llm_request (done above, greedy): the same path after.
            for result in engine._run([_Item(r, voice, q) for r, q in zip(batch, llm)]):
                if result.error:
                    raise RuntimeError(result.error)
                samples += len(result.audio)
            return time.process_time() - cpu, samples

        rounds, timings = repeat_timed(once, min_seconds, repeats)
        audio_s = sum(n for _, n in timings[0][1]) / engine.sample_rate
        cpu = [sum(c for c, _ in outs) for _, outs in timings]
        per_audio = [c / audio_s for c in cpu]
        wall = statistics.median(s for s, _ in timings)
        return E2eRow(
            name, segments * rounds, sum(n for _, n in timings[0][1]) // engine.samples_per_token, round(audio_s, 2),  # per timing
            round(wall, 3), round(statistics.median(cpu), 3), round(statistics.median(per_audio), 4),
            round(min(per_audio), 4), round(max(per_audio), 4), round(wall / audio_s, 4), backend_threads(engine.llm),
        )
    finally:
        close(engine.llm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=FIXTURE)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=256, help="speech tokens per request (LLM part)")
    ap.add_argument("--modes", nargs="+", default=["ras", "greedy"], choices=["ras", "greedy"])
    ap.add_argument("--backends", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="intra-op thread counts, each run for both backends (default: 1 and the visible CPUs)")
    ap.add_argument("--min-seconds", type=float, default=2.0, help="shortest timing; the batch is repeated to reach it")
    ap.add_argument("--repeats", type=int, default=3, help="timings per row; the median is reported")
    ap.add_argument("--e2e-segments", type=int, default=8, help="segments per engine batch (0: skip part 2)")
    ap.add_argument("--e2e-tokens", type=int, default=250, help="speech tokens per segment in part 2 (250 = 10 s)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args()

    visible = len(os.sched_getaffinity(0))
    thread_counts = args.threads or sorted({1, visible})
    load_before = os.getloadavg()
    max_batch = max(args.batch)
    max_seq = 128 + args.max_tokens
    rows: list[Row] = []
    e2e: list[E2eRow] = []
    startup: dict[str, float] = {}
    for threads in thread_counts:
        # torch._C's setter: once a vLLM CPU engine has started, torch.set_num_threads is a no-op.
        torch._C.set_num_threads(threads)
        for name in args.backends:
            t = time.perf_counter()
            backend = build_llm(name, args.model_dir, max_batch, max_seq)
            startup[f"{name}, {threads} thread(s)"] = round(time.perf_counter() - t, 2)
            if backend_threads(backend) != threads:
                raise RuntimeError(f"{name} runs with {backend_threads(backend)} threads, not {threads}")
            try:
                for mode in args.modes:
                    greedy = mode == "greedy"
                    list(backend.generate(requests_for(args.model_dir, 2, 8, greedy)))  # warm-up
                    for batch in args.batch:
                        reqs = requests_for(args.model_dir, batch, args.max_tokens, greedy)
                        rows.append(measure_llm(backend, reqs, mode, backend_threads(backend), args.min_seconds, args.repeats))
                        r = rows[-1]
                        print(f"{r.backend:6s} {mode:6s} B={batch:3d}  {r.tokens_per_s:9.1f} tok/s (min {r.tokens_per_s_min}, max "
                              f"{r.tokens_per_s_max}; {r.rounds} round(s), {r.seconds:.2f} s, {r.threads} threads)", flush=True)
            finally:
                close(backend)
            if args.e2e_segments:
                e2e.append(measure_engine(name, args.model_dir, args.e2e_segments, args.e2e_tokens, args.min_seconds, args.repeats))
                r2 = e2e[-1]
                print(f"{name:6s} engine: {r2.cpu_s_per_audio_s:.4f} CPU s per audio s, RTF {r2.rtf:.4f} "
                      f"({r2.audio_s} s of audio per timing, {r2.threads} threads)", flush=True)
    load_after = os.getloadavg()

    hw = hardware()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    report = {
        "when": stamp,
        "command": " ".join(["python -m bench.llm_backends", *sys.argv[1:]]),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_dir": str(args.model_dir),
        "max_tokens": args.max_tokens,
        "max_seq": max_seq,
        "threads": thread_counts,
        "min_seconds": args.min_seconds,
        "repeats": args.repeats,
        "hardware": hw,
        "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
        "loadavg_1_5_15_after": [round(x, 2) for x in load_after],
        "startup_s": startup,
        "rows": [asdict(r) for r in rows],
        "engine": {"segments": args.e2e_segments, "tokens_per_segment": args.e2e_tokens, "rows": [asdict(r) for r in e2e]},
    }
    names = list(args.backends)
    lines = [
        f"# LLM backends, {stamp}",
        "",
        f"hardware: {hw['cpu']}, {hw['cpus_visible']} CPUs visible ({hw['cores_physical']} physical cores, "
        f"{hw['cpus_logical']} logical); GPU {hw['cuda']}; torch {hw['torch']}, vLLM {hw['vllm']}; model {args.model_dir.name}",
        f"both backends at the same intra-op thread count (column 'threads'); {args.max_tokens} speech tokens per request; each cell the median of "
        f"{args.repeats} timings of >= {args.min_seconds} s (the batch repeated 'rounds' times); load average before/after "
        f"{load_before[0]:.2f}/{load_after[0]:.2f}",
        "",
        "| threads | mode | batch | " + " | ".join(f"{b} tok/s (min-max)" for b in names) + " | "
        + " | ".join(f"{b} rounds" for b in names) + " | " + " | ".join(f"{b} first result s" for b in names) + " |",
        "|---|---|---|" + "---|" * (3 * len(names)),
    ]
    for threads, mode, batch in [(t, m, b) for t in thread_counts for m in args.modes for b in args.batch]:
        by = {r.backend: r for r in rows if r.mode == mode and r.batch == batch and r.threads == threads}
        lines.append(
            f"| {threads} | {mode} | {batch} | "
            + " | ".join(f"{by[b].tokens_per_s:.0f} ({by[b].tokens_per_s_min:.0f}-{by[b].tokens_per_s_max:.0f})" for b in names)
            + " | " + " | ".join(str(by[b].rounds) for b in names)
            + " | " + " | ".join(f"{by[b].first_result_s:.3f}" for b in names)
            + " |"
        )
    lines += ["", "start-up s: " + ", ".join(f"{k} {v}" for k, v in startup.items())]
    if e2e:
        lines += [
            "",
            f"## Engine end to end (LLM + flow + HiFT), {args.e2e_segments} segments x {args.e2e_tokens} speech tokens "
            f"({args.e2e_tokens / 25:.0f} s of audio each), greedy (the same tokens with both backends)",
            "",
            "| LLM backend | audio s per timing | CPU s per audio s (min-max) | wall s per audio s (RTF) | threads |",
            "|---|---|---|---|---|",
        ]
        lines += [f"| {r.backend} | {r.audio_s} | {r.cpu_s_per_audio_s:.4f} ({r.cpu_s_per_audio_s_min:.4f}-{r.cpu_s_per_audio_s_max:.4f}) "
                  f"| {r.rtf:.4f} | {r.threads} |" for r in e2e]
    table = "\n".join(lines)
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    device = "gpu" if hw["cuda"] else "cpu"
    name = f"llm_backends_{device}_{args.model_dir.name}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
