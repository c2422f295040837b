"""Weights rearranged for speed, made once from the checkpoint's own tensors.

The official state dicts keep q/k/v (and gate/up, conv kernels) as separate tensors, and the modules
keep those names so `*.pt` files load unchanged. Inference wants them stacked (one matmul instead of
three) or re-laid-out (a conv kernel as per-tap matrices). `DerivedWeight` holds such a copy and
rebuilds it only when a source tensor changes (another storage, dtype, device or in-place version),
so `model.to(...)` or loading new weights never leaves a stale copy behind.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _key(w: torch.Tensor) -> tuple:
    """What a derived copy depends on: storage, shape, dtype, device and, where tracked, the in-place
    version (inference tensors have none; they are never written in place)."""
    version = -1 if w.is_inference() else w._version  # checked, not caught: this runs on every forward
    return (w.data_ptr(), version, w.device, w.dtype, tuple(w.shape))


class DerivedWeight:
    """A tensor computed from source tensors by `make`, cached until a source changes."""

    def __init__(self, make: Callable[..., torch.Tensor]):
        self.make = make
        self._key: tuple | None = None
        self._value: torch.Tensor | None = None

    def __call__(self, *sources: torch.Tensor | None) -> torch.Tensor:
        key = tuple(_key(s) if s is not None else None for s in sources)
        if self._value is None or key != self._key:
            with torch.no_grad():
                self._value = self.make(*(s.detach() if s is not None else None for s in sources))
            self._key = key
        return self._value


def stacked() -> DerivedWeight:
    """Row-stacked matrices (or biases): (out_1 + out_2 + ..., in)."""
    return DerivedWeight(lambda *ws: torch.cat(ws))

