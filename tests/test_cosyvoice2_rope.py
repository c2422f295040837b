"""The LLM decode step's RoPE + KV-cache write as one Triton kernel (worker/cosyvoice2/rope_kernel.py).

The kernel is checked against the eager form (`llm.decode_rope_write` with FUSED_ROPE off: apply_rope
on q and k, index writes into the cache) on the same inputs, on CUDA and, without a GPU, under Triton's
interpreter (CPU tensors). It rounds as eager does (each product, then the sum, in the activation
dtype; no FMA), so the expected difference is none:
  - CUDA: bit-identical in fp32, fp16 and bf16;
  - interpreter: bit-identical in fp32 and fp16; bf16 within BF16_INTERPRETED_ATOL, because the
    interpreter truncates fp32 -> bf16 where CUDA and eager round to nearest: up to one bf16 ulp on
    each product (2^-6: inputs are clamped below 4) and on the sum (2^-5 below 8) -> at most 0.0625
    (measured 0.031).
Everything the step must not write (rows >= B, other positions of rows < B, the other layer) is
compared bit for bit with what it held before.

The whole decode step on the tiny fixture, FUSED_ROPE on vs off from the same prefilled cache: within
LOGP_TOL with the same argmax for most rows (on CUDA bit-identical is expected, not required); under
the interpreter in fp32, bit-identical; on CPU without the interpreter the flag falls back to eager,
bit for bit. On CUDA, a CUDA graph of the step with the kernel replays what the step computes at new
tokens and positions, and the torch backend (warm-up, capture, replay) decodes the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, interpreted, run_interpreted
from voxbatch.worker.cosyvoice2 import llm
from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM, decode_rope_write, rope_cos_sin
from voxbatch.worker.cosyvoice2.llm_backend import LlmRequest
from voxbatch.worker.cosyvoice2.rope_kernel import fused_rope_cache_write
from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIMS = [(14, 2, 64), (4, 2, 32), (3, 1, 48)]  # (H, KVH, hd): CosyVoice2's Qwen2-0.5B, the tiny fixture, odd sizes
BATCHES = [1, 3, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
T_MAX, LAYERS, SPARE_ROWS, THETA = 40, 2, 2, 1e6
BF16_INTERPRETED_ATOL = 0.07
# abs, on fp32 log-probs (values down to -22) of the decode step. bf16: about twice the distance of the
# bf16 model from fp32 on this fixture (0.105 measured on CPU); the interpreter's truncating bf16
# casts, one ulp on some q/k entries, moved them by 0.128.
LOGP_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}
PROMPTS = [(7, 5), (3, 0), (12, 9), (5, 2)]  # (text tokens, prompt speech tokens) per row: lengths differ
STEPS, SEQ_MAX = 6, 48


def test_under_triton_interpreter() -> None:
    """The `interpreted` tests below, in a child pytest with TRITON_INTERPRET=1 (no GPU needed)."""
    run_interpreted(__file__)


# ---------------------------------------------------------------------------------------------
# The kernel against the eager form


def _inputs(B: int, dims: tuple[int, int, int], dtype: torch.dtype, device: str, stacked: bool):
    """q, k, v (B, 1, n*hd): views of one projection output where `stacked` (as with FUSED_KERNELS),
    else three tensors; cos/sin of distinct scattered positions (B,); a random cache (k/v, layers,
    B + SPARE_ROWS, KVH, T_max, hd), so that what is not written can be told from what is."""
    H, KVH, hd = dims
    t_max = max(T_MAX, 2 * B)
    g = torch.Generator().manual_seed(1000 * B + 10 * H + hd)
    qkv = torch.randn(B, 1, (H + 2 * KVH) * hd, generator=g).clamp(-3.9, 3.9).to(device, dtype)
    q, k, v = qkv.split([H * hd, KVH * hd, KVH * hd], dim=-1)
    if not stacked:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = torch.randperm(t_max, generator=g)[:B].to(device)
    cos, sin = rope_cos_sin(pos[:, None], hd, THETA, dtype)  # (B, 1, hd)
    cache = torch.randn(2, LAYERS, B + SPARE_ROWS, KVH, t_max, hd, generator=g).to(device, dtype)
    return q, k, v, cos, sin, pos, cache


def _assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        diff = float((got.float() - want.float()).abs().max()) if got.numel() else 0.0
        assert torch.equal(got, want), f"{what}: not bit-identical to eager (max |diff| {diff:.3g})"
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_INTERPRETED_ATOL, rtol=0, msg=what)


def _check(B: int, dims: tuple[int, int, int], dtype: torch.dtype, device: str, stacked: bool, exact: bool, monkeypatch) -> None:
    H, KVH, hd = dims
    q, k, v, cos, sin, pos, cache = _inputs(B, dims, dtype, device, stacked)
    before, eager_cache = cache.clone(), cache.clone()
    got = fused_rope_cache_write(q, k, v, cos, sin, cache[0, 1], cache[1, 1], pos)  # layer 1 of 2
    assert got is not None, "the kernel declined"
    monkeypatch.setattr(llm, "FUSED_ROPE", False)
    want = decode_rope_write(q, k, v, cos, sin, eager_cache[0, 1], eager_cache[1, 1], pos)
    assert got.shape == (B, H, 1, hd) and got.dtype == dtype and got.is_contiguous()
    _assert_same(got, want, exact, "rotated q")
    _assert_same(cache, eager_cache, exact, "cache")
    rows = torch.arange(B, device=device)
    assert torch.equal(cache[1, 1][rows, :, pos], v.reshape(B, KVH, hd)), "v is written as it is"
    written = torch.zeros(cache.shape[1:3] + cache.shape[4:5], dtype=torch.bool, device=device)  # (layers, rows, T_max)
    written[1, rows, pos] = True
    kept = cache.transpose(3, 4)[:, ~written]  # (2, unwritten (layer, row, position)s, KVH, hd)
    assert torch.equal(kept, before.transpose(3, 4)[:, ~written]), "the kernel wrote outside [b < B, :, write_pos[b]]"


@interpreted
@pytest.mark.parametrize("stacked", [True, False], ids=["qkv_views", "separate"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("dims", DIMS)
def test_kernel_interpreted(dims, B, dtype, stacked, monkeypatch) -> None:
    _check(B, dims, dtype, "cpu", stacked, exact=dtype != torch.bfloat16, monkeypatch=monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False], ids=["qkv_views", "separate"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [*BATCHES, 256])
@pytest.mark.parametrize("dims", DIMS)
@torch.inference_mode()
def test_kernel_on_gpu(dims, B, dtype, stacked, monkeypatch) -> None:
    _check(B, dims, dtype, "cuda", stacked, exact=True, monkeypatch=monkeypatch)


def test_kernel_declines(monkeypatch) -> None:
    """None (the caller's eager form) where the kernel cannot or should not run."""
    q, k, v, cos, sin, pos, cache = _inputs(3, DIMS[1], torch.float32, "cpu", True)
    if not INTERPRETED:
        assert fused_rope_cache_write(q, k, v, cos, sin, cache[0, 1], cache[1, 1], pos) is None  # a CPU tensor
    if not torch.cuda.is_available():
        return
    q, k, v, cos, sin, pos, cache = _inputs(3, DIMS[1], torch.bfloat16, "cuda", True)
    ck, cv = cache[0, 1], cache[1, 1]
    two = torch.cat([q, q], dim=1)  # (B, 2, H*hd): T == 2 is prefill's business
    assert fused_rope_cache_write(two, k, v, cos, sin, ck, cv, pos) is None
    assert fused_rope_cache_write(q, k, v, cos.float(), sin.float(), ck, cv, pos) is None  # mixed dtypes (autocast)
    assert fused_rope_cache_write(q, k, v, cos, sin, ck, cv, pos.float()) is None  # positions not integers
    assert fused_rope_cache_write(q, k, v, cos, sin, ck[:2], cv[:2], pos) is None  # B > B_max
    assert fused_rope_cache_write(q, k, v, cos, sin, ck.transpose(1, 2), cv.transpose(1, 2), pos) is None  # not a cache layout
    with torch.enable_grad():
        assert fused_rope_cache_write(q.detach().requires_grad_(), k, v, cos, sin, ck, cv, pos) is None  # no backward


# ---------------------------------------------------------------------------------------------
# The whole decode step


def _counting(monkeypatch) -> list[bool]:
    """Records, per call of the kernel's entry point by the LLM, whether the kernel ran."""
    ran: list[bool] = []

    def counted(*args, **kwargs):
        out = fused_rope_cache_write(*args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(llm, "fused_rope_cache_write", counted)
    return ran


def _prefill(model: CosyVoice2LM) -> torch.Tensor:
    """A fresh cache (one spare row) with PROMPTS prefilled into rows [0, B); their lengths (B,)."""
    d, dev = model.dims, model.llm_decoder.weight.device
    g = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(d.vocab_size, (n_text,), generator=g).tolist(), torch.randint(d.speech_token_size, (n_speech,), generator=g).tolist())
               for n_text, n_speech in PROMPTS]  # fmt: skip
    model.setup_cache(batch_max=len(PROMPTS) + 1, seq_max=SEQ_MAX)
    embeds, lengths = model.embed_batch(prompts)
    model.prefill(embeds, lengths)
    return lengths


def _step_tokens(model: CosyVoice2LM, i: int) -> torch.Tensor:
    """Step i's input speech tokens (B,), the same whatever the flag."""
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(model.dims.speech_token_size, (len(PROMPTS),), generator=g).to(model.llm_decoder.weight.device)


@torch.inference_mode()
def _decode_with_and_without(model: CosyVoice2LM, monkeypatch) -> dict[bool, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """FUSED_ROPE on and off: log-probs of STEPS decode steps (STEPS, B, S+3) and the final caches, all fp32 on CPU."""
    out = {}
    for fused in (True, False):
        monkeypatch.setattr(llm, "FUSED_ROPE", fused)
        lengths = _prefill(model)
        logp = torch.stack([model.decode_step(_step_tokens(model, i), lengths + i) for i in range(STEPS)])
        out[fused] = (logp.float().cpu(), model.cache_k.float().cpu(), model.cache_v.float().cpu())
    monkeypatch.setattr(llm, "FUSED_ROPE", True)
    return out


def test_decode_step_on_cpu_is_eager(tiny_model_dir, monkeypatch) -> None:
    """FUSED_ROPE on CPU takes the eager path: bit-identical log-probs and cache."""
    model = CosyVoice2LM.from_model_dir(tiny_model_dir)
    out = _decode_with_and_without(model, monkeypatch)
    for on, off in zip(out[True], out[False]):
        assert torch.equal(on, off)


def _check_decode_step(model_dir, device: str, dtype: torch.dtype, monkeypatch, exact: bool) -> None:
    model = CosyVoice2LM.from_model_dir(model_dir, device, dtype)
    ran = _counting(monkeypatch)
    out = _decode_with_and_without(model, monkeypatch)
    assert len(ran) == STEPS * model.dims.n_layers and all(ran), "the kernel fell back to eager"
    (logp, ck, cv), (logp_e, ck_e, cv_e) = out[True], out[False]
    assert torch.isfinite(logp).all()
    if exact:
        assert torch.equal(logp, logp_e) and torch.equal(ck, ck_e) and torch.equal(cv, cv_e)
        return
    diff = float((logp - logp_e).abs().max())
    assert diff <= LOGP_TOL[dtype], f"log-probs differ by {diff} (> {LOGP_TOL[dtype]})"
    same_argmax = (logp.argmax(-1) == logp_e.argmax(-1)).float().mean().item()
    assert same_argmax >= 0.9, f"only {same_argmax:.0%} of (step, row)s have the same argmax"
    torch.testing.assert_close(cv, cv_e, atol=LOGP_TOL[dtype], rtol=0)
    torch.testing.assert_close(ck, ck_e, atol=LOGP_TOL[dtype], rtol=0)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_interpreted(tiny_model_dir, monkeypatch, dtype) -> None:
    _check_decode_step(tiny_model_dir, "cpu", dtype, monkeypatch, exact=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_on_gpu(tiny_model_dir, monkeypatch, dtype) -> None:
    _check_decode_step(tiny_model_dir, "cuda", dtype, monkeypatch, exact=False)


@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graph_replay_on_gpu(tiny_model_dir, monkeypatch) -> None:
    """A decode step with the kernel captured as a CUDA graph (warm-up outside capture, as
    `_Rows.capture` does) replays what the step computes eagerly, at new tokens and positions."""
    model = CosyVoice2LM.from_model_dir(tiny_model_dir, "cuda", torch.bfloat16)
    ran = _counting(monkeypatch)
    lengths = _prefill(model)
    tokens, positions = _step_tokens(model, 0), lengths.clone()  # the graph's static inputs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.decode_step(tokens, positions, kv_len=SEQ_MAX)  # warm-up: the kernel compiles here
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logp = model.decode_step(tokens, positions, kv_len=SEQ_MAX)
    assert ran and all(ran), "the kernel fell back to eager"
    for i in range(1, 4):
        tokens.copy_(_step_tokens(model, i))
        positions.copy_(lengths + i)
        start = model.cache_k.clone(), model.cache_v.clone()
        graph.replay()
        got = static_logp.clone(), model.cache_k.clone(), model.cache_v.clone()
        model.cache_k.copy_(start[0])
        model.cache_v.copy_(start[1])
        want = model.decode_step(tokens, positions, kv_len=SEQ_MAX), model.cache_k, model.cache_v  # eagerly, kernel on
        for name, g, w in zip(("log-probs", "cache_k", "cache_v"), got, want):
            torch.testing.assert_close(g.float(), w.float(), atol=LOGP_TOL[torch.bfloat16], rtol=0, msg=f"step {i}: {name}")
        rows = torch.arange(len(PROMPTS), device="cuda")
        assert not torch.equal(got[2][:, rows, :, positions], start[1][:, rows, :, positions]), "replay wrote no new v"


@pytest.mark.gpu
def test_backend_tokens_on_gpu(tiny_model_dir, monkeypatch) -> None:
    """The torch backend's graphs (warm-up, capture and replay in `_Rows`) with the kernel decode the
    same greedy fp32 tokens as with FUSED_ROPE off."""
    ran = _counting(monkeypatch)
    g = torch.Generator().manual_seed(9)
    reqs = [LlmRequest(torch.randint(100, 900, (n_text,), generator=g).tolist(), list(range(n_speech)), min_tokens=4, max_tokens=30,
                       seed=i, greedy=True) for i, (n_text, n_speech) in enumerate(PROMPTS)]  # fmt: skip
    tokens = {}
    for fused in (True, False):
        monkeypatch.setattr(llm, "FUSED_ROPE", fused)
        backend = TorchLlmBackend.from_model_dir(tiny_model_dir, "cuda", torch.float32, max_batch=4, max_seq=2 * SEQ_MAX)
        assert backend.cuda_graphs
        tokens[fused] = {r.index: r.tokens for r in backend.generate(reqs)}
        backend.close()
    assert ran and all(ran), "the kernel fell back to eager"
    assert tokens[True] == tokens[False]
