"""Host <-> device copies that never drain a CUDA stream.

A plain `torch.tensor(values, device="cuda")` or `cpu_tensor.to("cuda")` copies from pageable memory
and then synchronizes the current stream: the host waits for every kernel queued there. On the
engine's hot paths that undid the queueing the scheduler relies on (the LLM's refill drained the
decode steps queued behind a look; flow/HiFT drained their stream between the two models). Here the
values go through pinned memory with `non_blocking=True`, which only orders the copy on the stream;
PyTorch's caching host allocator keeps the pinned block until the copy has run. On CPU these are plain
tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# False: plain synchronous copies (the behaviour before this module; the bench's `devcopy=0` A/B).
NON_BLOCKING = True


def to_device(values: Sequence | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Python numbers (or a CPU tensor) -> a tensor on `device`, queued on the current stream."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":  # already on a device
        return values.to(device=device, dtype=dtype or values.dtype)
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda" or not NON_BLOCKING:
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> np.ndarray:
    """Device -> host through pinned memory on the current stream: the copy waits only for this
    stream's work (flow/HiFT), never for the LLM decoding on another."""
    if t.device.type != "cuda":
        return t.numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()
