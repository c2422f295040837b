"""HiFT's Snake activation, x + sin^2(alpha_c x) / alpha_c, as one Triton kernel on CUDA.

Eager PyTorch runs it as five elementwise kernels, each reading and writing the whole (B, C, T_wav)
activation; at 24 kHz those passes were a third of HiFT's GPU time. One kernel reads x once and
writes once, computing in fp32 whatever the storage dtype. `sin` is libdevice's accurate sine (not
the fast approximation, which drifts for the large arguments HiFT's activations reach), and
1 / (alpha + 1e-9) comes from PyTorch (the caller's `alpha_inv`, made once per weight), so the kernel
differs from the eager form only by the rounding of one fused multiply-add.

A second kernel takes x channels-last (stored (B, T, C), hift.CHANNELS_LAST) with the same arithmetic
per element; only its walk over memory differs. `fused_snake` returns None where the kernel cannot run
(no Triton, any other layout, or a kernel that failed to build, which is logged once), and the caller
falls back to eager.
"""

from __future__ import annotations

import functools

import torch

from voxbatch.worker.cosyvoice2.lazy_kernel import channels_last, interpreting, layout_grid, on_device, per_layout

BLOCK_T = 1024  # samples per program along time


def accurate_sin():
    """libdevice's accurate sine for Triton kernels (Triton's own `tl.sin` where it has no libdevice): the
    Snake here and in the conv epilogue (conv_epilogue.py) use the same one. The kernels call it as a
    closure of their `_build`, which Triton's interpreter cannot see: interpreted (INTERPRETED), they call
    `tl.sin` (numpy's) instead."""
    import triton.language as tl

    try:
        from triton.language.extra import libdevice

        return libdevice.sin
    except ImportError:  # older Triton
        return tl.sin


@functools.cache
def _build():
    import triton
    import triton.language as tl

    sin = accurate_sin()

    @triton.jit
    def snake_kernel(x_ptr, inv_ptr, alpha_ptr, out_ptr, T, C, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of T samples
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        base = row.to(tl.int64) * T
        c = row % C
        alpha = tl.load(alpha_ptr + c).to(tl.float32)
        inv = tl.load(inv_ptr + c).to(tl.float32)
        x = tl.load(x_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
        s = tl.sin(x * alpha) if INTERPRETED else sin(x * alpha)
        tl.store(out_ptr + base + t, (x + inv * (s * s)).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def snake_kernel_channels_last(x_ptr, inv_ptr, alpha_ptr, out_ptr, T, C, BLOCK: tl.constexpr,
                                   INTERPRETED: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # program (block of a row's T * C values, batch)
        ok = i < T * C
        offs = tl.program_id(1).to(tl.int64) * T * C + i
        alpha = tl.load(alpha_ptr + i % C, mask=ok, other=1.0).to(tl.float32)  # channel fastest in memory
        inv = tl.load(inv_ptr + i % C, mask=ok, other=1.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.sin(x * alpha) if INTERPRETED else sin(x * alpha)
        tl.store(out_ptr + offs, (x + inv * (s * s)).to(out_ptr.dtype.element_ty), mask=ok)

    return triton, (snake_kernel, snake_kernel_channels_last)


def fused_snake(x: torch.Tensor, alpha_inv: torch.Tensor) -> torch.Tensor | None:
    """x (B, C, T) on CUDA (contiguous or channels-last), alpha_inv (2, C) fp32 = [alpha, 1 / (alpha +
    1e-9)] -> Snake(x) in x's layout, or None (use the eager form)."""
    cl = channels_last(x)
    if cl is None or _kernels[cl].failed:
        return None

    def launch(triton, kernel) -> torch.Tensor:
        _, C, T = x.shape
        out = torch.empty_like(x)  # x's strides (a dense tensor's are kept)
        if x.numel():
            with on_device(x):
                kernel[layout_grid(triton, x.shape, cl, BLOCK_T)](x, alpha_inv[1], alpha_inv[0], out, T, C, BLOCK=BLOCK_T,
                                                                  INTERPRETED=interpreting())
        return out

    return _kernels[cl].run(launch)


_kernels = per_layout(_build, "fused Snake kernel", "HiFT uses the eager Snake")  # by channels_last(x)
