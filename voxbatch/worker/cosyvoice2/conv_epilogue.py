"""HiFT's conv epilogue, (conv(x) + bias) * mask [+ skip], as one Triton kernel on CUDA.

PyTorch's cuDNN convolution takes no bias: the conv writes (B, C, T), the bias is added in a pass of
its own, the row mask multiplied in another and, in a residual block, the skip added in a third. At
HiFT's upsampled rates those passes over the activation were most of HiFT's elementwise device time
(the `add_`, `mul` and `add` lines of bench/results/gpu_h200_worker9_profile.txt). Here the conv runs
without its bias and one kernel reads its output (and the skip) once and writes once.

With `snake` (a Snake's alpha and 1 / (alpha + 1e-9)) the kernel also applies the Snake that reads its
result, Snake(z) = z + sin^2(alpha z) / alpha with the Snake kernel's arithmetic (snake_kernel.py), so a
residual block's first conv hands its second one the activated input without writing z and reading it
back (hift.SNAKE_IN_EPILOGUE). There the mask is applied as a select, z = y + b where m is 1 and 0 where
it is 0: the same values as the product for a 0/1 mask, and no product left for the compiler to fuse
into Snake's final add, so the result is the epilogue-then-Snake kernels' bit for bit.

A second kernel takes y (and the skip) channels-last (stored (B, T, C), hift.CHANNELS_LAST) with the same
arithmetic per element. fp32 only (HiFT's dtype, engine.Placement): the kernel does the eager form's roundings in its order,
(y + b) then * m then skip +, and the mask is 0 or 1, so the product is exact and a fused multiply-add
with the skip rounds as the separate add does: bit-identical to eager. `conv_epilogue` returns None
where the kernel cannot run (no Triton, CPU outside the interpreter, another dtype, a kernel that
failed to build, which is logged once) and the caller takes the eager form.
"""

from __future__ import annotations

import functools

import torch

from voxbatch.worker.cosyvoice2.lazy_kernel import channels_last, interpreting, layout_grid, on_device, per_layout
from voxbatch.worker.cosyvoice2.snake_kernel import accurate_sin

BLOCK_T = 1024  # samples per program along time


@functools.cache
def _build():
    import triton
    import triton.language as tl

    sin = accurate_sin()  # a closure of the kernels (the interpreter, which cannot see it, calls tl.sin)

    @triton.jit
    def epilogue_kernel(y_ptr, bias_ptr, mask_ptr, skip_ptr, alpha_ptr, inv_ptr, out_ptr, T, C, SKIP: tl.constexpr,
                        SNAKE: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)  # one (batch, channel) row of T samples
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        base = row.to(tl.int64) * T
        bias = tl.load(bias_ptr + row % C)
        m = tl.load(mask_ptr + (row // C).to(tl.int64) * T + t, mask=ok, other=0.0)
        y = tl.load(y_ptr + base + t, mask=ok, other=0.0) + bias
        y = tl.where(m != 0.0, y, 0.0) if SNAKE else y * m
        if SKIP:
            y = tl.load(skip_ptr + base + t, mask=ok, other=0.0) + y
        if SNAKE:
            alpha = tl.load(alpha_ptr + row % C)
            s = tl.sin(y * alpha) if INTERPRETED else sin(y * alpha)
            y = y + tl.load(inv_ptr + row % C) * (s * s)
        tl.store(out_ptr + base + t, y, mask=ok)

    @triton.jit
    def epilogue_kernel_channels_last(y_ptr, bias_ptr, mask_ptr, skip_ptr, alpha_ptr, inv_ptr, out_ptr, T, C,
                                      SKIP: tl.constexpr, SNAKE: tl.constexpr, BLOCK: tl.constexpr,
                                      INTERPRETED: tl.constexpr):  # fmt: skip
        b = tl.program_id(1).to(tl.int64)  # program (block of a row's T * C values, channel fastest; batch)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < T * C
        offs = b * T * C + i
        bias = tl.load(bias_ptr + i % C, mask=ok, other=0.0)
        m = tl.load(mask_ptr + b * T + i // C, mask=ok, other=0.0)
        y = tl.load(y_ptr + offs, mask=ok, other=0.0) + bias
        y = tl.where(m != 0.0, y, 0.0) if SNAKE else y * m
        if SKIP:
            y = tl.load(skip_ptr + offs, mask=ok, other=0.0) + y
        if SNAKE:
            alpha = tl.load(alpha_ptr + i % C, mask=ok, other=1.0)
            s = tl.sin(y * alpha) if INTERPRETED else sin(y * alpha)
            y = y + tl.load(inv_ptr + i % C, mask=ok, other=1.0) * (s * s)
        tl.store(out_ptr + offs, y, mask=ok)

    return triton, (epilogue_kernel, epilogue_kernel_channels_last)


def _supported(y: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, skip: torch.Tensor | None,
               snake: torch.Tensor | None = None) -> bool:
    return (
        (y.is_cuda or interpreting())
        and y.dtype == torch.float32 and channels_last(y) is not None
        and bias is not None and bias.dtype == y.dtype and bias.shape == (y.shape[1],) and bias.is_contiguous()
        and mask.dtype == y.dtype and mask.shape == (y.shape[0], 1, y.shape[2]) and mask.is_contiguous()
        and (skip is None or (skip.shape == y.shape and skip.dtype == y.dtype and skip.stride() == y.stride()))
        and (snake is None or (snake.shape == (2, y.shape[1]) and snake.dtype == y.dtype and snake.is_contiguous()))
    )  # fmt: skip


def conv_epilogue(y: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, skip: torch.Tensor | None = None,
                  snake: torch.Tensor | None = None) -> torch.Tensor | None:
    """y (B, C, T) a conv's output without its bias (contiguous or channels-last), bias (C,), mask
    (B, 1, T) of 0/1, skip (B, C, T) in y's layout or None -> (y + bias) * mask [+ skip], written over
    y; with snake (2, C) = [alpha, 1 / (alpha + 1e-9)] (`Snake`'s kernel arguments), Snake of that.
    None: use the eager form."""
    if not _supported(y, bias, mask, skip, snake):
        return None
    cl = bool(channels_last(y))
    if _kernels[cl].failed:
        return None

    def launch(triton, kernel) -> torch.Tensor:
        _, C, T = y.shape
        if y.numel():
            with on_device(y):
                kernel[layout_grid(triton, y.shape, cl, BLOCK_T)](
                    y, bias, mask, y if skip is None else skip, bias if snake is None else snake[0],
                    bias if snake is None else snake[1], y, T, C, SKIP=skip is not None, SNAKE=snake is not None,
                    BLOCK=BLOCK_T, INTERPRETED=interpreting())
        return y

    return _kernels[cl].run(launch)


_kernels = per_layout(_build, "fused conv epilogue", "HiFT adds bias and mask eagerly")  # by channels_last(y)
