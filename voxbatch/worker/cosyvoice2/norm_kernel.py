"""LayerNorm over the last dim, optionally with the flow's Mish and row mask fused in, as one Triton kernel.

On the H200 the flow estimator is about half the engine's GPU time, and PyTorch's LayerNorm
(`vectorized_layer_norm_kernel`, one 256-wide row per block) was 17.5% of it: 1433 calls per
flow batch of 64 rows at ~126 us each on fp16 (128, ~600, 256) activations, about 1/8 of the
memory bandwidth (bench/results/gpu_h200_engine_profile.txt, section "flow"). Here one program
normalises BLOCK_M rows at once (mean and variance in fp32, two passes over registers), and the
`CausalBlock1D` epilogue mish(LN(x)) * mask, three eager passes, rides along in the same one.

Mish as z * tanh(softplus(z)) = z * n(n + 2) / (n(n + 2) + 2) with n = exp(z): one exp, no
cancellation for negative z (the ratio tends to n), and z clamped at 20 before the exp, past
which the ratio is 1 in fp32. The ratio damps the error of its exp (a relative error d in n moves
it by at most 2d, and by far less for z > 1), so Triton's fast exp and rsqrt (a few fp32 ulps, as
PyTorch's own rsqrtf) keep fp32 within ~2e-6 of eager and need no libdevice (which Triton's
interpreter lacks). The result is
rounded once to the input dtype (eager rounds the LayerNorm output, then Mish's), so fp16 differs
from eager by about an ulp.

`fused_layer_norm` returns None where the kernel cannot run (no Triton, a CPU or non-contiguous
input, a dtype or width it does not take, autocast or autograd on, or a kernel that failed to
build, which is logged once), and the caller falls back to eager. Under Triton's interpreter
(TRITON_INTERPRET=1) it runs on CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch

from voxbatch.worker.cosyvoice2.lazy_kernel import LazyKernel, interpreting, on_device

MAX_C = 8192  # widest row one program holds in registers
ROW_ELEMS = 4096  # elements per program: 16 rows of 256 (8 KB of fp16 read, 8 KB written)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def layer_norm_kernel(x_ptr, shift_ptr, w_ptr, b_ptr, mask_ptr, add_ptr, out_ptr, N, C, T, eps,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, MISH: tl.constexpr,
                          SHIFT: tl.constexpr, ROW_ADD: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
        cols = tl.arange(0, BLOCK_C)  # (BLOCK_C,)
        row_ok = rows < N
        col_ok = cols < C
        ok = row_ok[:, None] & col_ok[None, :]  # (BLOCK_M, BLOCK_C)
        offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if SHIFT:  # x + shift rounded to x's dtype, as the eager sum is, then normalised in fp32
            shift = tl.load(shift_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK_C,)
            x = (x + shift[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)  # summed in fp32, rounded once
        # Correctly rounded divisions: Triton's default `/` is approximate (2 ulp), and a constant row's
        # mean off by an ulp becomes ~6e-5 after 1/sqrt(eps) (seen on the H200 at C = 80, 192).
        mean = tl.div_rn(tl.sum(x, axis=1), C * 1.0)  # (BLOCK_M,)
        xc = tl.where(ok, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.div_rn(tl.sum(xc * xc, axis=1), C * 1.0) + eps)  # biased variance, as LayerNorm
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :] + b[None, :]
        if MISH:
            n = tl.exp(tl.minimum(y, 20.0))
            p = n * (n + 2.0)
            keep = tl.load(mask_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # one scalar per row
            y = y * (p / (p + 2.0))
            if ROW_ADD:  # + add[b] for row r = b * T + t, before the mask
                batch = (rows // T).to(tl.int64)
                add = tl.load(add_ptr + batch[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
                y = y + add
            y = y * keep[:, None]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    return triton, layer_norm_kernel


def _supported(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mask: torch.Tensor | None,
               shift: torch.Tensor | None = None, row_add: torch.Tensor | None = None) -> bool:
    C = x.shape[-1] if x.dim() else 0
    return (
        (x.is_cuda or interpreting())
        and x.dtype in DTYPES
        and x.is_contiguous()
        and 0 < C <= MAX_C
        and weight is not None and weight.shape == (C,) and weight.is_contiguous()
        and bias is not None and bias.shape == (C,) and bias.is_contiguous()
        and (mask is None or (mask.shape == (*x.shape[:-1], 1) and mask.is_contiguous()))
        and (shift is None or (shift.shape == (C,) and shift.dtype == x.dtype and shift.is_contiguous()))
        and (row_add is None or (mask is not None and x.dim() == 3 and row_add.shape == (x.shape[0], C)
                                 and row_add.dtype == x.dtype and row_add.is_contiguous()))
        and not torch.is_autocast_enabled(x.device.type)  # eager LayerNorm returns fp32 there
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad))
    )  # fmt: skip


def fused_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, mask: torch.Tensor | None = None,
    shift: torch.Tensor | None = None, row_add: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """x (..., C) -> F.layer_norm(x, (C,), weight, bias, eps) in x's dtype; with mask (..., 1),
    F.mish(that) * mask; with shift (C,) in x's dtype, the LayerNorm of x + shift (the residual
    stream's biases not yet added, flow_estimator.DEFERRED_BIAS); with row_add (B, C) for x (B, T, C)
    and a mask, (F.mish(that) + row_add[b]) * mask (a resnet's time embedding,
    flow_estimator.TIME_EMBEDDING_IN_NORM). None: use the eager form."""
    if _kernel.failed or not _supported(x, weight, bias, mask, shift, row_add):
        return None

    def launch(triton, kernel) -> torch.Tensor:
        C = x.shape[-1]
        N = x.numel() // C
        block_c = triton.next_power_of_2(C)
        block_m = max(1, min(16, ROW_ELEMS // block_c))
        out = torch.empty_like(x)
        if N:
            with on_device(x):
                kernel[(triton.cdiv(N, block_m),)](
                    x, x if shift is None else shift, weight, bias, x if mask is None else mask,
                    x if row_add is None else row_add, out, N, C, x.shape[1] if row_add is not None else 1, float(eps),
                    BLOCK_M=block_m, BLOCK_C=block_c, MISH=mask is not None, SHIFT=shift is not None,
                    ROW_ADD=row_add is not None,
                    num_warps=max(4, block_m * block_c // 1024),
                )  # fmt: skip
        return out

    return _kernel.run(launch)


_kernel = LazyKernel(_build, "fused LayerNorm kernel", "the flow uses eager LayerNorm")
