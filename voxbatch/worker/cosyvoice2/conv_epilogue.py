"""HiFT's conv epilogue, (conv(x) + bias) * mask [+ skip], as one Triton kernel on CUDA.

PyTorch's cuDNN convolution takes no bias: the conv writes (B, C, T), the bias is added in a pass of
its own, the row mask multiplied in another and, in a residual block, the skip added in a third. At
HiFT's upsampled rates those passes over the activation were most of HiFT's elementwise device time
(the `add_`, `mul` and `add` lines of bench/results/gpu_h200_worker9_profile.txt). Here the conv runs
without its bias and one kernel reads its output (and the skip) once and writes once.

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

BLOCK_T = 1024  # samples per program along time


@functools.cache
def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def epilogue_kernel(y_ptr, bias_ptr, mask_ptr, skip_ptr, out_ptr, T, C, SKIP: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # one (batch, channel) row of T samples
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = t < T
        base = row.to(tl.int64) * T
        bias = tl.load(bias_ptr + row % C)
        m = tl.load(mask_ptr + (row // C).to(tl.int64) * T + t, mask=ok, other=0.0)
        y = (tl.load(y_ptr + base + t, mask=ok, other=0.0) + bias) * m
        if SKIP:
            y = tl.load(skip_ptr + base + t, mask=ok, other=0.0) + y
        tl.store(out_ptr + base + t, y, mask=ok)

    @triton.jit
    def epilogue_kernel_channels_last(y_ptr, bias_ptr, mask_ptr, skip_ptr, out_ptr, T, C, SKIP: tl.constexpr,
                                      BLOCK: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)  # program (block of a row's T * C values, channel fastest; batch)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < T * C
        offs = b * T * C + i
        bias = tl.load(bias_ptr + i % C, mask=ok, other=0.0)
        m = tl.load(mask_ptr + b * T + i // C, mask=ok, other=0.0)
        y = (tl.load(y_ptr + offs, mask=ok, other=0.0) + bias) * m
        if SKIP:
            y = tl.load(skip_ptr + offs, mask=ok, other=0.0) + y
        tl.store(out_ptr + offs, y, mask=ok)

    return triton, (epilogue_kernel, epilogue_kernel_channels_last)


def _supported(y: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, skip: torch.Tensor | None) -> bool:
    return (
        (y.is_cuda or interpreting())
        and y.dtype == torch.float32 and channels_last(y) is not None
        and bias is not None and bias.dtype == y.dtype and bias.shape == (y.shape[1],) and bias.is_contiguous()
        and mask.dtype == y.dtype and mask.shape == (y.shape[0], 1, y.shape[2]) and mask.is_contiguous()
        and (skip is None or (skip.shape == y.shape and skip.dtype == y.dtype and skip.stride() == y.stride()))
    )  # fmt: skip


def conv_epilogue(y: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor | None:
    """y (B, C, T) a conv's output without its bias (contiguous or channels-last), bias (C,), mask
    (B, 1, T) of 0/1, skip (B, C, T) in y's layout or None -> (y + bias) * mask [+ skip], written over
    y; None: use the eager form."""
    if not _supported(y, bias, mask, skip):
        return None
    cl = bool(channels_last(y))
    if _kernels[cl].failed:
        return None

    def launch(triton, kernel) -> torch.Tensor:
        _, C, T = y.shape
        if y.numel():
            with on_device(y):
                kernel[layout_grid(triton, y.shape, cl, BLOCK_T)](
                    y, bias, mask, y if skip is None else skip, y, T, C, SKIP=skip is not None, BLOCK=BLOCK_T)
        return y

    return _kernels[cl].run(launch)


_kernels = per_layout(_build, "fused conv epilogue", "HiFT adds bias and mask eagerly")  # by channels_last(y)
