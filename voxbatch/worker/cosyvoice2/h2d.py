"""Host-to-device copies of small index/parameter arrays that do not drain the GPU's queue.

`torch.tensor(list, device="cuda")` copies from pageable memory, which the driver does synchronously
with respect to the host: it waits until the copy is done, and the copy waits behind every kernel
already queued on the stream. At a refill of the LLM's rows that is the decode steps queued past the
host's look (torch_backend.LOOK_LAG); in the vocoder, the flow batch queued before HiFT. From pinned
memory the copy is asynchronous: the host queues it and moves on; torch's caching host allocator keeps
the pinned block until the copy has run. Not A/B'd on its own: both sides of the packed-prefill A/B
(BENCHMARKS.md) ran with it; an earlier, wider version measured within noise of pageable copies
(bench/results/gpu_h200_worker4.json).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A list / numpy array / tensor on the host -> a tensor of `dtype` on `device`, queued without a
    host wait on CUDA (pinned source, non_blocking); a plain copy elsewhere."""
    device = torch.device(device)
    host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def split_lengths(lengths: torch.Tensor | Sequence[int] | None, B: int, T: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Row lengths both on the device (masks) and on the host (per-row loops): from a host list with
    a pinned, non-blocking copy (no host sync); from a device tensor with one read-back (a sync);
    None: every row is T long."""
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=device, dtype=torch.long), host_lengths(lengths, B, T)
    host = host_lengths(lengths, B, T)
    return to_device(host, torch.long, device), host


def host_lengths(lengths: torch.Tensor | Sequence[int] | None, B: int, T: int) -> list[int]:
    """`split_lengths`' host half alone (no device copy), for code that only loops over rows."""
    host = [T] * B if lengths is None else [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if len(host) != B:
        raise ValueError(f"{len(host)} lengths for {B} rows")
    return host
