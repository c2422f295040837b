"""The LLM decode step's fused RoPE and cache write (rope_kernel.py, llm.FUSED_DECODE_ROPE).

Against the eager form it replaces (llm.apply_rope on q and k, then k and v written into the cache at
each row's position), on q/k/v as views of one fused projection, grouped-query heads, rows at different
positions and a cache with more rows than the batch: fp16 bit for bit under Triton's interpreter (bf16
there within one step of bf16, the interpreter truncating where CUDA rounds), both bit for bit on a GPU,
and the whole decode step's log-probs bit for bit on a GPU. Nothing outside the written entries changes.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import INTERPRETED, interpreted, run_interpreted
from voxbatch.worker.cosyvoice2 import llm
from voxbatch.worker.cosyvoice2.llm import apply_rope, rope_cos_sin
from voxbatch.worker.cosyvoice2.rope_kernel import decode_rope_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, H, KVH, HD, B_MAX, T_MAX = 3, 4, 2, 16, 5, 12


def test_under_triton_interpreter() -> None:
    """The `interpreted` tests below, in a child pytest with TRITON_INTERPRET=1 (no GPU needed)."""
    run_interpreted(__file__)


def _inputs(dtype: torch.dtype, device: str):
    """q, k, v as views of one (B, 1, (H + 2 KVH) * HD) projection, cos/sin (B, 1, HD) of the rows'
    positions, a random cache (B_MAX, KVH, T_MAX, HD) and the positions (B,)."""
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(B, 1, (H + 2 * KVH) * HD, generator=g) * 3).to(device, dtype)
    q, k, v = qkv.split([H * HD, KVH * HD, KVH * HD], dim=-1)
    positions = torch.tensor([7, 0, 11], device=device)
    cos, sin = rope_cos_sin(positions[:, None], HD, 1e6, dtype)
    cache = (torch.randn(2, B_MAX, KVH, T_MAX, HD, generator=g) * 2).to(device, dtype)
    return q, k, v, cos, sin, cache, positions


def _eager(q, k, v, cos, sin, cache, positions):
    """What Attention.forward's eager decode does: (q rotated (B, H, 1, HD), the cache after the writes)."""
    cache = cache.clone()
    qr = apply_rope(q.reshape(B, 1, H, HD).transpose(1, 2), cos, sin)
    kr = apply_rope(k.reshape(B, 1, KVH, HD).transpose(1, 2), cos, sin)
    rows = torch.arange(B, device=q.device)
    cache[0][rows, :, positions] = kr[:, :, 0]
    cache[1][rows, :, positions] = v.reshape(B, 1, KVH, HD).transpose(1, 2)[:, :, 0]
    return qr, cache


def _check(dtype: torch.dtype, device: str, exact: bool) -> None:
    q, k, v, cos, sin, cache, positions = _inputs(dtype, device)
    want_q, want_cache = _eager(q, k, v, cos, sin, cache, positions)
    got_cache = cache.clone()
    got_q = decode_rope_cache(q, k, v, cos, sin, got_cache[0], got_cache[1], positions)
    assert got_q is not None and got_q.shape == (B, H, 1, HD) and got_q.dtype == dtype
    if exact:
        assert torch.equal(got_q, want_q) and torch.equal(got_cache, want_cache)
    else:  # one bf16 step of the values' scale (~16)
        torch.testing.assert_close(got_q, want_q, atol=0.125, rtol=1e-2)
        torch.testing.assert_close(got_cache, want_cache, atol=0.125, rtol=1e-2)
    written = torch.zeros_like(cache, dtype=torch.bool)
    written[:, torch.arange(B), :, positions] = True
    assert torch.equal(got_cache[~written], cache[~written])  # every other entry as it was


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@torch.inference_mode()
def test_kernel_interpreted(dtype) -> None:
    _check(dtype, "cpu", exact=dtype == torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@torch.inference_mode()
def test_kernel_on_gpu(dtype) -> None:
    _check(dtype, "cuda", exact=True)


@torch.inference_mode()
def test_kernel_declines_on_cpu() -> None:
    """A CPU tensor outside the interpreter: None (the caller's eager form)."""
    if INTERPRETED:
        pytest.skip("the interpreter takes CPU tensors")
    q, k, v, cos, sin, cache, positions = _inputs(torch.float16, "cpu")
    assert decode_rope_cache(q, k, v, cos, sin, cache[0], cache[1], positions) is None


@interpreted
@torch.inference_mode()
def test_kernel_declines_interpreted() -> None:
    """None where it should not run, though the kernel runs on these tensors otherwise: fp32 (eager
    keeps it), int32 positions, a cache that is not contiguous, autograd on."""
    q, k, v, cos, sin, cache, positions = _inputs(torch.float16, "cpu")
    assert decode_rope_cache(q, k, v, cos, sin, cache[0].clone(), cache[1].clone(), positions) is not None
    q32, k32, v32, cos32, sin32, cache32, _ = _inputs(torch.float32, "cpu")
    assert decode_rope_cache(q32, k32, v32, cos32, sin32, cache32[0], cache32[1], positions) is None
    assert decode_rope_cache(q, k, v, cos, sin, cache[0], cache[1], positions.int()) is None
    assert decode_rope_cache(q, k, v, cos, sin, cache[0][:, :, :, :8], cache[1][:, :, :, :8], positions) is None
    with torch.enable_grad():
        assert decode_rope_cache(q, k, v, cos, sin, cache[0], cache[1], positions) is None


def _decode_steps_same(model_dir, reference, dtype: torch.dtype, device: str, monkeypatch) -> None:
    """The fixture's LLM in `dtype` on `device`: six greedy decode steps over four cache rows at
    different positions give the same log-probs and the same cache with FUSED_DECODE_ROPE as without,
    bit for bit, the kernel having run in every layer of every step."""
    from tests.test_cosyvoice2_llm import _decode_logp, _prompts

    calls = []
    real = llm.decode_rope_cache

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(llm, "decode_rope_cache", counted)
    prompts, rows = _prompts(reference), [2, 0, 3]
    seq_max = 64 + max(len(t) + len(s) + 2 for t, s in prompts)
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(llm, "FUSED_DECODE_ROPE", fused)
        m = llm.CosyVoice2LM.from_model_dir(model_dir).to(device, dtype)
        m.setup_cache(batch_max=4, seq_max=seq_max)
        got[fused] = (_decode_logp(m, prompts, rows, steps=6), m.cache_k.clone(), m.cache_v.clone())
    assert len(calls) == 6 * m.dims.n_layers and all(calls)
    for a, b in zip(got[False][0], got[True][0]):
        assert torch.equal(a, b)
    assert torch.equal(got[False][1], got[True][1]) and torch.equal(got[False][2], got[True][2])


@interpreted
@torch.inference_mode()
def test_decode_steps_bit_for_bit_interpreted(tiny_model_dir, tiny_reference, monkeypatch) -> None:
    _decode_steps_same(tiny_model_dir, tiny_reference, torch.float16, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@torch.inference_mode()
def test_decode_steps_bit_for_bit_on_gpu(tiny_model_dir, tiny_reference, dtype, monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _decode_steps_same(tiny_model_dir, tiny_reference, dtype, "cuda", monkeypatch)
