"""HiFT's Snake activation, x + sin^2(alpha_c x) / alpha_c, as one Triton kernel on CUDA.

Eager PyTorch runs it as five elementwise kernels, each reading and writing the whole (B, C, T_wav)
activation; at 24 kHz those passes were a third of HiFT's GPU time. One kernel reads x once and
writes once, computing in fp32 whatever the storage dtype. `sin` is libdevice's accurate sine (not
the fast approximation, which drifts for the large arguments HiFT's activations reach), and
1 / (alpha + 1e-9) comes from PyTorch (the caller's `alpha_inv`, made once per weight), so the kernel
differs from the eager form only by the rounding of one fused multiply-add.

`fused_snake` returns None where the kernel cannot run (no Triton, a non-contiguous input, or a
kernel that failed to build, which is logged once), and the caller falls back to eager.
"""

from __future__ import annotations

import torch

from voxbatch.worker.cosyvoice2.lazy_kernel import LazyKernel, on_device

BLOCK_T = 1024  # samples per program along time


def _build():
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice

        sin = libdevice.sin
    except ImportError:  # older Triton
        sin = tl.sin

    @triton.jit
    def snake_kernel(x_ptr, inv_ptr, alpha_ptr, out_ptr, T, C, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of T samples
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        base = row.to(tl.int64) * T
        c = row % C
        alpha = tl.load(alpha_ptr + c).to(tl.float32)
        inv = tl.load(inv_ptr + c).to(tl.float32)
        x = tl.load(x_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        s = sin(x * alpha)
        tl.store(out_ptr + base + t, (x + inv * (s * s)).to(out_ptr.dtype.element_ty), mask=ok)

    return triton, snake_kernel


def fused_snake(x: torch.Tensor, alpha_inv: torch.Tensor) -> torch.Tensor | None:
    """x (B, C, T) on CUDA, alpha_inv (2, C) fp32 = [alpha, 1 / (alpha + 1e-9)] -> Snake(x), or None
    (use the eager form)."""
    if _kernel.failed or not x.is_contiguous() or x.dim() != 3:
        return None

    def launch(triton, kernel) -> torch.Tensor:
        B, C, T = x.shape
        out = torch.empty_like(x)
        if x.numel():
            with on_device(x):
                kernel[(B * C, triton.cdiv(T, BLOCK_T))](x, alpha_inv[1], alpha_inv[0], out, T, C, BLOCK=BLOCK_T)
        return out

    return _kernel.run(launch)


_kernel = LazyKernel(_build, "fused Snake kernel", "HiFT uses the eager Snake")
