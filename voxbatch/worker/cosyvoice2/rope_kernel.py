"""The LLM decode step's RoPE and KV-cache write as one Triton kernel per layer.

At T == 1 the eager attention spends ~13 small kernels per layer between the qkv projection and
SDPA: rotate-half RoPE on q and on k (neg, cat, mul, mul, add on non-contiguous views) and two
index_put writes into the KV cache (plus an arange). On the H200 the decode step at 256 rows is
about a thousand kernels of ~2.5 us each, captured in a CUDA graph (bench/results/
h200_probe1_profile.txt, "decode_step_graphs"), so those 13 x 24 layers are a good part of it.
Here one program per batch row reads the row's q, k, v (views of the projection output), rotates
its H query heads and KVH key heads as one tile, writes q into a fresh (B, H, 1, hd) tensor for
SDPA and rotated k and v into this layer's cache (B_max, KVH, T_max, hd) at [b, :, write_pos[b], :].
Rows of the cache beyond B, and every other position, are left as they are. A write_pos outside
[0, T_max) writes nothing (eager indexing would raise; here a device assert would be the only other
choice).

Exactness: eager computes `x * cos + rotate_half(x) * sin` in the activation dtype, one op at a
time: each product rounded to that dtype, then the sum rounded. The kernel does the same roundings:
a product of two bf16/fp16 values is exact in fp32, so rounding it gives eager's product, and the
launch sets `enable_fp_fusion=False`, without which the compiler contracts product and sum into one
FMA (one rounding instead of two; seen in the sm_90 PTX for bf16 as for fp32). On CUDA it is
therefore bit-identical to eager; under Triton's interpreter too, except bf16, whose fp32 -> bf16
cast the interpreter truncates instead of rounding (one ulp). Each row's result depends on that
row's inputs alone, so it is batch-invariant.

CUDA graphs: no host sync, one output allocation of a shape fixed by the inputs' shapes. The kernel
compiles on its first launch, which in the torch backend is the warm-up step `_Rows.capture` runs
before capturing. Its integer arguments (strides, sizes) do not depend on B or the attention width,
so one compiled kernel serves every captured graph.

`fused_rope_cache_write` returns None where the kernel cannot run (no Triton, a CPU tensor outside
the interpreter, dtypes or shapes it does not take, autograd on, or a kernel that failed to build,
which is logged once), and the caller falls back to eager. Under Triton's interpreter
(TRITON_INTERPRET=1) it runs on CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext

import torch

log = logging.getLogger(__name__)

_kernel = None  # the jitted kernel, or False once it is known not to work here
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
POSITION_DTYPES = (torch.int32, torch.int64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"  # Triton's own switch, read by Triton too


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, ck_ptr, cv_ptr,
                          q_row, k_row, v_row, cs_row, c_b, c_h, c_t, H, KVH, HD, T_MAX,
                          BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # one batch row per program
        d = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        half = HD // 2
        first_half = d < half
        partner = tl.where(first_half, d + half, d - half)  # the element rotate_half brings to d
        d_ok = d < HD
        cos = tl.load(cos_ptr + b * cs_row + d, mask=d_ok, other=0.0).to(tl.float32)  # exact: from the stored dtype
        sin = tl.load(sin_ptr + b * cs_row + d, mask=d_ok, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        n_kv = tl.where((pos >= 0) & (pos < T_MAX), KVH, 0)  # K/V heads to write: none at a position off the cache

        # One tile of heads (BLOCK_H, BLOCK_D): the H query heads, then the KVH key heads, rotated alike;
        # q goes to q_out[b, h], k to the cache at [b, h - H, pos].
        h = tl.arange(0, BLOCK_H)
        is_q = h < H
        hk = h - H
        src = tl.where(is_q, q_ptr + b * q_row + h * HD, k_ptr + b * k_row + hk * HD)  # (BLOCK_H,) head starts
        dst = tl.where(is_q, q_out_ptr + b * (H * HD) + h * HD, ck_ptr + b * c_b + hk * c_h + pos * c_t)
        ok = (h < H + n_kv)[:, None] & d_ok[None, :]
        x = tl.load(src[:, None] + d[None, :], mask=ok, other=0.0)
        xp = tl.load(src[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        rot = tl.where(first_half[None, :], -xp, xp)  # rotate_half(x) = [-x2, x1]
        # x * cos + rot * sin with eager's roundings: each product to x's dtype, then the sum
        a = (x.to(tl.float32) * cos[None, :]).to(x.dtype)
        r = (rot * sin[None, :]).to(x.dtype)
        tl.store(dst[:, None] + d[None, :], (a.to(tl.float32) + r.to(tl.float32)).to(x.dtype), mask=ok)

        hv = tl.arange(0, BLOCK_KV)
        ok = (hv < n_kv)[:, None] & d_ok[None, :]  # (BLOCK_KV, BLOCK_D)
        v = tl.load(v_ptr + b * v_row + hv[:, None] * HD + d[None, :], mask=ok)
        tl.store(cv_ptr + b * c_b + hv[:, None] * c_h + pos * c_t + d[None, :], v, mask=ok)

    return triton, rope_cache_kernel


def _supported(q, k, v, cos, sin, cache_k, cache_v, write_pos) -> bool:
    if q.dim() != 3 or cache_k.dim() != 4:
        return False
    B, T, q_width = q.shape
    _, kv_heads, _, hd = cache_k.shape
    floats = (q, k, v, cos, sin, cache_k, cache_v)
    return (
        (q.is_cuda or _interpreting())
        and T == 1
        and 0 < hd <= MAX_HEAD_DIM and hd % 2 == 0 and q_width % hd == 0
        and k.shape == v.shape == (B, 1, kv_heads * hd)
        and cos.shape == sin.shape == (B, 1, hd) and cos.stride() == sin.stride()
        and cache_v.shape == cache_k.shape and cache_v.stride() == cache_k.stride() and B <= cache_k.shape[0]
        and write_pos.shape == (B,) and write_pos.dtype in POSITION_DTYPES and write_pos.is_contiguous()
        and q.dtype in DTYPES and all(t.dtype == q.dtype for t in floats)  # autocast's mixed dtypes included
        and all(t.stride(-1) == 1 for t in floats)  # heads of a row contiguous, as the projection writes them
        and all(t.device == q.device for t in (*floats, write_pos))
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in floats))  # no backward
    )  # fmt: skip


def fused_rope_cache_write(
    q: torch.Tensor,  # (B, 1, H*hd) this step's queries (a view of the qkv projection output will do)
    k: torch.Tensor,  # (B, 1, KVH*hd)
    v: torch.Tensor,  # (B, 1, KVH*hd)
    cos: torch.Tensor,  # (B, 1, hd) in the activation dtype (llm.rope_cos_sin)
    sin: torch.Tensor,
    cache_k: torch.Tensor,  # (B_max, KVH, T_max, hd) this layer's cache, written in place
    cache_v: torch.Tensor,
    write_pos: torch.Tensor,  # (B,) int: the position each row's token is written at
) -> torch.Tensor | None:
    """Rotated q (B, H, 1, hd), with rotated k and v written into the cache at [b, :, write_pos[b]];
    None: use the eager form."""
    global _kernel
    if _kernel is False or not _supported(q, k, v, cos, sin, cache_k, cache_v, write_pos):
        return None
    try:
        if _kernel is None:
            _kernel = _build()
        triton, kernel = _kernel
        B, hd, kv_heads = q.shape[0], cache_k.shape[3], cache_k.shape[1]
        heads = q.shape[2] // hd
        q_out = torch.empty((B, heads, 1, hd), dtype=q.dtype, device=q.device)
        if B:
            block_h, block_d = triton.next_power_of_2(heads + kv_heads), triton.next_power_of_2(hd)
            with torch.cuda.device(q.device) if q.is_cuda else nullcontext():  # Triton launches on the current device
                kernel[(B,)](
                    q, k, v, cos, sin, write_pos, q_out, cache_k, cache_v,
                    q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
                    cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), heads, kv_heads, hd, cache_k.shape[2],
                    BLOCK_H=block_h, BLOCK_KV=triton.next_power_of_2(kv_heads), BLOCK_D=block_d,
                    num_warps=min(8, max(1, block_h * block_d // 256)), enable_fp_fusion=False,
                )  # fmt: skip
        return q_out
    except Exception as e:  # noqa: BLE001 - no Triton or no kernel: the eager form still works
        log.warning("fused RoPE kernel unavailable (%s: %s); the LLM decode step uses eager RoPE", type(e).__name__, e)
        _kernel = False
        return None
