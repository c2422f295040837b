"""Key-padding self-attention as one FlashAttention varlen call on the padded layout (CUDA, fp16/bf16).

SDPA with a boolean mask runs a masked kernel (cuDNN's on the H200) over every padded key, and cuDNN
spends ~230 us of host time building each call: 34% of the flow's CUDA time at ~150 TFLOP/s
(bench/results/gpu_h200_engine_profile.txt, "flow"). FlashAttention's varlen form takes the batch as
flattened rows with per-row key counts instead of a mask: row b's queries are its T' frames (rows
start at `cu_seq[b] = b * T'`), its keys the first `lens[b]` of them (`seqused_k`), so key blocks
past a row's length are never read and no mask tensor exists.

Why the padded layout, not the valid frames gathered into a packed batch:
  - q, k and v are views of the qkv projection's output, (B*T', H, D) with unit stride in D as flash
    needs: no gather before the call, no scatter after it;
  - all it needs is on the device or in a shape (T'), so no host sync, per call or per forward (a
    packed batch needs its total length on the host);
  - the work it wastes is the padding frames' queries. Their output is what SDPA gives them today
    (they attend to the row's valid keys) and nothing reads it: every conv input, the skip's
    resnet and the final projection are masked, and keys past `lens[b]` are never attended to. The
    engine's length buckets keep padding under 1.41x, and the rest of the U-Net computes those
    frames anyway.

The call is `torch.nn.attention.varlen.varlen_attn` where it takes `seqused_k` (torch 2.12's does;
added by pytorch/pytorch#175897, March 2026, so the GPU image's 2.11 most likely lacks it), else
the aten op it wraps, `torch.ops.aten._flash_attention_forward`, which has taken `seqused_k` since
torch 2.5; the choice is logged (INFO). Any failure (no flash build, an op that changed) is logged
once and `padded_attention` returns None from then on: the caller uses SDPA.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FlashCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
_flash: FlashCall | None | bool = None  # the resolved call; False once it is known not to work here
_DEVICES = ("cuda",)  # where flash runs (tests emulate it elsewhere)
_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PaddedRows:
    """B rows of T' frames each, flattened to (B*T', ...); row b's valid frames are [0, lens[b])."""

    cu_seq: torch.Tensor  # (B+1,) int32: b * T', where each row starts
    lens: torch.Tensor  # (B,) int32: valid frames (keys) per row
    frames: int  # T'

    @classmethod
    def of(cls, lens: torch.Tensor, frames: int) -> PaddedRows:
        """lens (B,) on the activations' device; made on the device, no host sync."""
        B = lens.size(0)
        cu_seq = torch.arange(B + 1, device=lens.device, dtype=torch.int32) * frames
        return cls(cu_seq, lens.to(torch.int32).contiguous(), frames)


def _public() -> FlashCall | None:
    """`torch.nn.attention.varlen.varlen_attn`, where this torch has one that takes `seqused_k`."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    if "seqused_k" not in inspect.signature(varlen_attn).parameters:
        return None

    def call(q, k, v, cu_seq, T, lens):
        return varlen_attn(q, k, v, cu_seq, cu_seq, T, T, seqused_k=lens)

    return call


def _aten() -> FlashCall:
    """The aten op `varlen_attn` wraps (AttributeError where this torch has none)."""
    op = torch.ops.aten._flash_attention_forward

    def call(q, k, v, cu_seq, T, lens):
        # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask)
        return op(q, k, v, cu_seq, cu_seq, T, T, 0.0, False, False, seqused_k=lens)[0]

    return call


def _resolve() -> FlashCall:
    """This torch's flash varlen call: (q, k, v, cu_seq, T', lens) -> out (B*T', H, D)."""
    call = _public()
    log.info("flow attention: flash varlen via %s", "torch.nn.attention.varlen" if call else "aten")
    return call or _aten()


def padded_attention(qkv: torch.Tensor, rows: PaddedRows) -> torch.Tensor | None:
    """qkv (B, T', 3, H, D) -> (B, T', H, D), row b attending to keys [0, lens[b]); None where flash
    cannot run here (CPU, fp32, a failed call: use SDPA with the mask)."""
    global _flash
    if _flash is False or qkv.device.type not in _DEVICES or qkv.dtype not in _DTYPES:
        return None
    B, T, _, H, D = qkv.shape
    if T != rows.frames:
        raise ValueError(f"padded_attention: {T} frames per row, rows made for {rows.frames}")
    flat = qkv.view(B * T, 3, H, D)  # rows of (3, H, D): views below keep D at unit stride
    try:
        if _flash is None:
            _flash = _resolve()
        out = _flash(flat[:, 0], flat[:, 1], flat[:, 2], rows.cu_seq, rows.frames, rows.lens)  # (B*T', H, D)
    except Exception as e:  # noqa: BLE001 - no flash here: the masked SDPA still works
        log.warning("flash varlen attention unavailable (%s: %s); the flow uses masked SDPA", type(e).__name__, e)
        _flash = False
        return None
    return out.reshape(B, T, H, D)


# -- packed causal attention (the LLM's prefill) ------------------------------------------------------
#
# The LLM's prefill runs B prompts of different lengths. Padded to the longest, SDPA with a (B, 1, T, T)
# boolean mask computes every padded query and key, and cuDNN builds a new plan for every new (B, T)
# (refills bring new shapes all the time). Laid end to end instead
# (N = sum of the lengths, no padding), one flash varlen call with is_causal=True and the prompts'
# starts as `cu_seq` on both sides does the same attention: flash takes grouped-query K/V (KVH heads
# dividing H) as they are, and a causal row never sees past its own prompt.

CausalCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
_causal: CausalCall | None | bool = None  # the resolved call; False once it is known not to work here


def _aten_causal() -> CausalCall:
    op = torch.ops.aten._flash_attention_forward

    def call(q, k, v, cu_seq, longest):
        return op(q, k, v, cu_seq, cu_seq, longest, longest, 0.0, True, False)[0]

    return call


def packed_causal_ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `packed_causal_attention` may run for activations on `device` in `dtype`."""
    return _causal is not False and device.type in _DEVICES and dtype in _DTYPES


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq: torch.Tensor, longest: int) -> torch.Tensor | None:
    """q (N, H, D), k and v (N, KVH, D): sequences laid end to end, sequence b at [cu_seq[b],
    cu_seq[b+1]) (int32, (B+1,)), `longest` the longest of them -> (N, H, D), each position attending to
    its own sequence's positions up to itself. None where flash cannot run here (the caller pads)."""
    global _causal
    if not packed_causal_ready(q.device, q.dtype):
        return None
    try:
        if _causal is None:
            _causal = _aten_causal()
            log.info("llm prefill: packed causal flash varlen via aten")
        return _causal(q, k, v, cu_seq, longest)
    except Exception as e:  # noqa: BLE001 - no flash here: the padded prefill still works
        log.warning("packed flash attention unavailable (%s: %s); the LLM prefill pads its prompts", type(e).__name__, e)
        _causal = False
        return None
