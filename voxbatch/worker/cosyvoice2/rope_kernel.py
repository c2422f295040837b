"""The LLM decode step's rotary embedding and KV-cache write as one Triton kernel on CUDA.

A decode step is one token per row, so each layer's attention input is tiny (B rows of (H + 2 KVH)
heads of 64), and eager PyTorch spends a kernel per operation on it: rotate-half is a negation, a
concatenation, two products and a sum, for q and again for k, then two indexed writes of k and v into
the cache. In the 256-row decode step's profile the kinds of small kernel these are
(`elementwise_kernel`, `CatArrayBatchedCopy`, `index_elementwise_kernel`; not all of them this
rotation's and these writes') take ~19% of the step's device time
(bench/results/gpu_h100_worker26_profile.txt, "decode_step_graphs"); per layer the kernel replaces 12
launches with one (bench/results/kernel_census.json, `rope=1`). Here one program per (row, head)
reads its head once: q heads are rotated into a (B, H, 1, hd) output, k heads rotated and v heads copied
straight into the cache at the row's position.

The arithmetic is eager's, rounding for rounding, in fp16 and bf16 (the dtypes it takes): each product
x * cos and rotate_half(x) * sin is exact in fp32 (two 8- or 11-bit significands) and is rounded once to
the storage dtype, as eager rounds it, and their sum is formed in fp32 and rounded once, as eager's add
does; no multiply meets an add unrounded, so no fused multiply-add can change a bit. The GPU test holds
the decode steps to eager's bit for bit. fp32 (Settings.llm_dtype = "float32") keeps the eager form.

`decode_rope_cache` returns None where the kernel cannot run (no Triton, CPU outside the interpreter,
another dtype or layout, a kernel that failed to build, which is logged once): the caller runs eagerly.
"""

from __future__ import annotations

import functools

import torch

from voxbatch.worker.cosyvoice2.lazy_kernel import LazyKernel, interpreting, on_device

DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_cache_kernel(q_ptr, k_ptr, v_ptr, q_row, k_row, v_row, cos_ptr, sin_ptr, pos_ptr, q_out_ptr,
                          ck_ptr, cv_ptr, H, KVH, T_MAX, HD: tl.constexpr):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)  # the batch row (its cache row too)
        head = tl.program_id(1)  # [0, H): q heads; [H, H + KVH): k heads; then v heads
        i = tl.arange(0, HD)
        if head < H + KVH:
            if head < H:
                src = q_ptr + b * q_row + head * HD
                dst = q_out_ptr + (b * H + head) * HD
            else:
                src = k_ptr + b * k_row + (head - H) * HD
                dst = ck_ptr + ((b * KVH + (head - H)) * T_MAX + tl.load(pos_ptr + b)) * HD
            x = tl.load(src + i)
            half = HD // 2
            partner = tl.load(src + (i + half) % HD).to(tl.float32)  # rotate_half: [-x2, x1]
            rotated = tl.where(i < half, -partner, partner)
            c = tl.load(cos_ptr + b * HD + i).to(tl.float32)
            s = tl.load(sin_ptr + b * HD + i).to(tl.float32)
            a = (x.to(tl.float32) * c).to(x.dtype)  # rounded as eager's x * cos
            r = (rotated * s).to(x.dtype)  # rounded as eager's rotate_half(x) * sin
            tl.store(dst + i, (a.to(tl.float32) + r.to(tl.float32)).to(x.dtype))
        else:
            kvh = head - H - KVH
            x = tl.load(v_ptr + b * v_row + kvh * HD + i)
            tl.store(cv_ptr + ((b * KVH + kvh) * T_MAX + tl.load(pos_ptr + b)) * HD + i, x)

    return triton, rope_cache_kernel


def _supported(q, k, v, cos, sin, cache_k, cache_v, positions) -> bool:
    B = q.shape[0]
    return (
        (q.is_cuda or interpreting())
        and q.dtype in DTYPES and k.dtype == v.dtype == cos.dtype == sin.dtype == cache_k.dtype == cache_v.dtype == q.dtype
        and q.dim() == k.dim() == v.dim() == 3 and q.shape[1] == k.shape[1] == v.shape[1] == 1
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and cache_k.dim() == 4 and cache_k.shape == cache_v.shape and cache_k.is_contiguous() and cache_v.is_contiguous()
        and cache_k.shape[0] >= B and k.shape[2] == v.shape[2] == cache_k.shape[1] * cache_k.shape[3]
        and q.shape[2] % cache_k.shape[3] == 0 and cache_k.shape[3] % 2 == 0
        and (cache_k.shape[3] & (cache_k.shape[3] - 1)) == 0  # a power of two: one block per head
        and cos.shape == sin.shape == (B, 1, cache_k.shape[3]) and cos.is_contiguous() and sin.is_contiguous()
        and positions.shape == (B,) and positions.dtype == torch.int64
        and not torch.is_grad_enabled()
    )  # fmt: skip


def decode_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cache_k: torch.Tensor, cache_v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """One decode token per row: q (B, 1, H*hd), k and v (B, 1, KVH*hd) (views of one projection are
    fine: unit stride in the last dim), cos and sin (B, 1, hd), the layer's cache (B_max, KVH, T_max, hd),
    positions (B,) int64 -> q rotated (B, H, 1, hd); k rotated and v written into cache row b at
    positions[b]. None: run the eager form."""
    if _kernel.failed or not _supported(q, k, v, cos, sin, cache_k, cache_v, positions):
        return None

    def launch(triton, kernel) -> torch.Tensor:
        B, KVH, T_max, hd = q.shape[0], cache_k.shape[1], cache_k.shape[2], cache_k.shape[3]
        H = q.shape[2] // hd
        out = torch.empty((B, H, 1, hd), device=q.device, dtype=q.dtype)
        if B:
            with on_device(q):
                kernel[(B, H + 2 * KVH)](q, k, v, q.stride(0), k.stride(0), v.stride(0), cos, sin, positions, out,
                                         cache_k, cache_v, H, KVH, T_max, HD=hd)
        return out

    return _kernel.run(launch)


_kernel = LazyKernel(_build, "fused RoPE and cache write", "the LLM's decode step rotates and writes eagerly")
