"""Kernel launches per call of the flow's estimator and encoder, HiFT's decode and the LLM's decode step, per bench switch.

The fusions of stop 33 (bench/switches.py: `resid`, `temb`, `enc_sdpa`, `rope`, ...) take work off the GPU
by launching fewer kernels over the activations; how much each saves in time needs a GPU, but what each
removes can be counted anywhere. This runs the classes a worker runs (CosyVoice2-0.5B's estimator,
encoder and HiFT with random weights, the fixture's LLM for the decode step) on the CPU under Triton's
interpreter, so the Triton kernels (fused LayerNorm, Snake, conv epilogue, RoPE and cache write) run as
they do on a GPU instead of their eager fallbacks, and counts per call every aten op that launches a kernel (views and other
metadata-only ops excluded) plus every Triton launch, each variant side by side with the shipped form.
On a GPU three things differ from this CPU census, the same in every variant: FlashAttention runs where
the CPU calls SDPA (one op either way), the FFN's GELU rides in its matmul (here an op of its own), and
the decode step replays as a CUDA graph (the same kernels).

Usage (repo root): python -m bench.kernel_census [--ab resid=1 temb=1 resid=1,temb=1 enc_sdpa=1 snake_epi=1 rope=1]
Writes bench/results/kernel_census.json and .md (commit, hardware, per-op counts of every variant).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton: the kernels run on CPU tensors

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.gpu_models import build_flow, build_hift, write_model_dir  # noqa: E402
from bench.provenance import FIXTURE, commit  # noqa: E402
from bench.switches import parse_switches, switched  # noqa: E402
from voxbatch.worker.cosyvoice2 import lazy_kernel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ROWS, FRAMES, TOKENS = 2, 96, 48  # estimator rows (one CFG pair) and mel frames; encoder tokens per row
HIFT_FRAMES = 8  # mel frames of HiFT's decode (one row; the interpreter runs each Triton program in numpy)


class _Launches(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (not views), and Triton launches (`LazyKernel.run`)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func.__name__ not in ("detach.default", "lift_fresh.default"):
            self.ops[f"aten::{func.__name__.split('.')[0]}"] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _counting():
    """A `_Launches` over the block, Triton launches counted as `triton::<kernel>` (their own tensor
    handling under the interpreter not counted)."""
    mode = _Launches()
    real = lazy_kernel.LazyKernel.run

    def run(self, launch):
        mode.paused += 1
        try:
            out = real(self, launch)
        finally:
            mode.paused -= 1
        if out is not None:
            mode.ops[f"triton::{self.what}"] += 1
        return out

    lazy_kernel.LazyKernel.run = run
    try:
        with mode:
            yield mode.ops
    finally:
        lazy_kernel.LazyKernel.run = real


def _model_calls(model_dir: Path):
    """(name, call) for the full-size estimator, encoder and HiFT decode on fixed random inputs."""
    flow = build_flow(model_dir, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([FRAMES, FRAMES * 2 // 3])
    mask = (torch.arange(FRAMES)[None, :] < lens[:, None]).float()[:, None]  # (B, 1, T)
    x, mu, cond = (torch.randn(ROWS, 80, FRAMES, generator=g) for _ in range(3))
    t, spks = torch.rand(ROWS, generator=g), torch.randn(ROWS, 80, generator=g)
    tokens = torch.randint(0, flow.dims.vocab_size, (ROWS, TOKENS), generator=g)
    token_lens = torch.tensor([TOKENS, TOKENS // 2])
    hift = build_hift(model_dir, "cpu", torch.float32)
    mel = torch.randn(1, 80, HIFT_FRAMES, generator=g)
    source = torch.randn(1, 1, HIFT_FRAMES * hift.d.samples_per_frame, generator=g) * 0.1
    return [("estimator", lambda: flow.decoder.estimator(x, mask, mu, t, spks, cond)),
            ("encoder", lambda: flow.encode(tokens, token_lens)), ("HiFT decode", lambda: hift.decode(mel, source))]


def _decode_call():
    """The fixture LLM's decode step in fp16 (the dtype the RoPE kernel takes), two rows mid-sequence."""
    from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM

    m = CosyVoice2LM.from_model_dir(FIXTURE).to(torch.float16)
    m.setup_cache(batch_max=2, seq_max=64)
    tokens, positions = torch.tensor([5, 9]), torch.tensor([17, 30])
    return m.dims.n_layers, lambda: m.decode_step(tokens, positions, kv_len=32)


def census(specs: list[str], tiny: bool = False) -> dict:
    """Per variant (the shipped form first, then each spec's switches): launches per call, by op.
    `tiny`: the fixture's sizes for the flow and HiFT (a quick run, as CI's)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp), tiny=tiny, fixture_yaml=FIXTURE / "cosyvoice2.yaml")
        calls = _model_calls(model_dir)
    layers, decode = _decode_call()
    calls.append(("decode step", decode))
    variants = {"shipped": {}} | {spec: parse_switches(spec) for spec in specs}
    out: dict = {}
    for name, run in variants.items():
        out[name] = {}
        with switched(run), torch.inference_mode():
            for call_name, call in calls:
                call()  # first call: derived weights, kernel builds
                with _counting() as ops:
                    call()
                out[name][call_name] = {"launches": sum(ops.values()), "triton": sum(v for k, v in ops.items() if k.startswith("triton::")),
                                        "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]))}
        print(f"  {name}: " + ", ".join(f"{c} {out[name][c]['launches']}" for c, _ in calls), flush=True)
    return {"variants": out, "decode_layers": layers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ab", nargs="+", default=["resid=1", "temb=1", "resid=1,temb=1", "enc_sdpa=1", "snake_epi=1", "rope=1"],
                    metavar="SPEC",
                    help="bench switches of each variant (bench/switches.py)")
    ap.add_argument("--tiny", action="store_true", help="the fixture's sizes for the flow and HiFT (CI's quick run)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kernel_census.json")
    args = ap.parse_args()
    try:
        for spec in args.ab:
            parse_switches(spec)
    except SystemExit as e:
        ap.error(str(e))
    r = census(args.ab, tiny=args.tiny)
    result = {"bench": "kernel_census", "commit": commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(["python -m bench.kernel_census", *sys.argv[1:]]),
              "shapes": {"estimator": {"rows": ROWS, "frames": FRAMES,
                                       "model": "the fixture's sizes" if args.tiny else "CosyVoice2-0.5B sizes, random weights"},
                         "encoder": {"rows": ROWS, "tokens": TOKENS}, "HiFT decode": {"rows": 1, "mel_frames": HIFT_FRAMES},
                         "decode step": {"rows": 2, "model": "the fixture's LLM, fp16"}},
              **r, "hardware": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                                "torch": torch.__version__, "triton_interpreter": True}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    calls = list(next(iter(r["variants"].values())))
    base = r["variants"]["shipped"]
    table = ["| variant | " + " | ".join(f"{c} launches (of them Triton) | {c} / shipped" for c in calls) + " |",
             "|---|" + "---|---|" * len(calls)]
    for name, v in r["variants"].items():
        table.append(f"| {name} | " + " | ".join(f"{v[c]['launches']} ({v[c]['triton']}) | {v[c]['launches'] / base[c]['launches']:.3f}"
                                                for c in calls) + " |")
    md = (f"# Kernel launches per call ({result['when']}, commit {result['commit'][:7]})\n\n"
          f"CPU under Triton's interpreter, {os.cpu_count()} cores, torch {torch.__version__}; the estimator: {ROWS} rows x "
          f"{FRAMES} mel frames (one U-Net pass, {result['shapes']['estimator']['model']}); the encoder: {ROWS} rows x {TOKENS} tokens; HiFT's "
          f"decode: one row of {HIFT_FRAMES} mel frames (source given); the "
          f"decode step: the fixture's {r['decode_layers']}-layer LLM (per layer: divide by {r['decode_layers']}).\n\n"
          + "\n".join(table) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
