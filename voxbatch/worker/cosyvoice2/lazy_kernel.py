"""A Triton kernel built on first use that falls back to eager PyTorch for good once it fails.

The engine's Triton kernels (the flow's LayerNorm, HiFT's Snake and conv epilogue) are speed-ups of an
eager form that always works: where Triton is missing, or a kernel does not build or launch on this
GPU, the failure is logged once and every later call returns None at once, so the model runs eagerly.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


def interpreting() -> bool:
    """Under Triton's interpreter (TRITON_INTERPRET=1, Triton's own switch) kernels take CPU tensors:
    how the tests run them without a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_device(t: torch.Tensor) -> AbstractContextManager:
    """Triton launches on the current CUDA device: make it t's (nothing for the interpreter's CPU tensors)."""
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


class LazyKernel:
    """`build()` -> (triton, kernel), called on the first `run`; `what` and `fallback` name the kernel
    and the eager form in the one warning a failure logs."""

    def __init__(self, build: Callable[[], tuple[Any, Any]], what: str, fallback: str):
        self.build, self.what, self.fallback = build, what, fallback
        self.built: tuple[Any, Any] | None | bool = None  # False once it failed here

    @property
    def failed(self) -> bool:
        return self.built is False

    def run(self, launch: Callable[[Any, Any], T]) -> T | None:
        """launch(triton, kernel)'s result, or None once the kernel failed here (use the eager form)."""
        if self.built is False:
            return None
        try:
            if self.built is None:
                self.built = self.build()
            return launch(*self.built)
        except Exception as e:  # noqa: BLE001 - no Triton or no kernel: the eager form still works
            log.warning("%s unavailable (%s: %s); %s", self.what, type(e).__name__, e, self.fallback)
            self.built = False
            return None


def per_layout(build: Callable[[], tuple[Any, tuple[Any, Any]]], what: str, fallback: str) -> dict[bool, LazyKernel]:
    """A LazyKernel per layout of HiFT's (B, C, T) activations, keyed by `channels_last`
    (False: stored (B, C, T), True: stored (B, T, C)), over one `build()` -> (triton, (kernel,
    channels-last kernel)): a channels-last kernel that fails on some GPU leaves the other running."""
    def one(layout: bool) -> Callable[[], tuple[Any, Any]]:
        def pick() -> tuple[Any, Any]:
            triton, kernels = build()
            return triton, kernels[layout]

        return pick

    return {False: LazyKernel(one(False), what, fallback),
            True: LazyKernel(one(True), f"{what} (channels-last)", f"{fallback} on channels-last activations")}


def channels_last(x: torch.Tensor) -> bool | None:
    """Whether a (B, C, T) tensor is stored channels-last ((B, T, C) in memory, True) or contiguous
    (False); None for any other layout. A tensor that is both (C or T of 1) counts as contiguous."""
    if x.dim() != 3:
        return None
    if x.is_contiguous():
        return False
    return True if x.transpose(1, 2).is_contiguous() else None


def layout_grid(triton: Any, shape: torch.Size, stored_channels_last: bool, block: int) -> tuple[int, int]:
    """The launch grid of HiFT's elementwise kernels over x (B, C, T): (B * C rows, blocks of T) stored
    (B, C, T); (blocks of a row's T * C values, B) channels-last, blocks on axis 0 (up to 2^31 - 1: axis 1
    stops at 65,535 blocks, ~175 s of audio at C = 64)."""
    B, C, T = shape
    return (triton.cdiv(T * C, block), B) if stored_channels_last else (B * C, triton.cdiv(T, block))
