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

On Hopper (sm90) FlashAttention-2's kernel runs at ~220 TFLOP/s here, 45% of the flow's device time
(bench/results/gpu_h200_worker9_profile.txt). FlashAttention-3, written for Hopper's warp-group MMAs
and TMA, ships inside vLLM (`vllm/vllm_flash_attn/_vllm_fa3_C`), which the mission's workers install
for the LLM. Where that extension is present and the GPU is sm90 (`FA3`), the same call goes to it:
the op library is loaded from vLLM's package folder without importing vLLM (whose import pulls in
its whole runtime), queries as flattened rows (`cu_seqlens_q`), keys as the padded batch (B, T', H,
D) with `seqused_k`. Anything else (no vLLM, another GPU, a failed load or call) falls back to
FlashAttention-2, logged once. Engine on the H200: 288.1x (291.1, 288.1) with FA3 vs 278.2x (280.0,
278.2) with FA2, runs in A B B A order (bench/results/gpu_h200_worker11.json); its call takes 1.26 ms
against FA2's 1.48 ms at 128 rows (gpu_h200_worker12b_profile.txt vs gpu_h200_worker9_profile.txt).
"""

from __future__ import annotations

import glob
import importlib.util
import inspect
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

FlashCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
_flash: FlashCall | None | bool = None  # the resolved call; False once it is known not to work here
_DEVICES = ("cuda",)  # where flash runs (tests emulate it elsewhere)
_DTYPES = (torch.float16, torch.bfloat16)
FA3 = True  # use vLLM's FlashAttention-3 where it is installed and the GPU is sm90 (bench switch `fa3`)
# FA3's key splits (num_splits), 0: its own heuristic, what every H200 result measured. The heuristic splits
# the flow's keys and runs a combine kernel after every call (65 ms of a 128-row batch's 1.70 s,
# gpu_h200_worker12b_profile.txt) although 2B rows x 8 heads of query blocks fill the GPU unsplit;
# `fa3_splits=1` (bench switch) measured within the run-to-run spread: engine 304.8x (304.8, 319.0) vs
# 299.4x (299.4, 314.2) with the heuristic, runs in A..A order (bench/results/gpu_h200_worker13.json):
# not kept, for want of a difference larger than the noise.
FA3_SPLITS = 0
# Skip the padding frames' queries (`seqused_q`; their output rows stay zero in a zeroed `out`): up to
# ~1/3 less attention at half-octave buckets, ~15% on the bench corpus' batches. What the padding frames
# get is never read by a valid frame (the tests hold the estimator to that with zeroed padding rows):
# keys past lens[b] are never attended to and every conv input is masked. Bench switch `fa3_q`, off: engine
# 303.5x (303.5, 307.3) vs 299.4x (299.4, 314.2) without (bench/results/gpu_h200_worker13.json), no
# difference beyond the noise; its GPU test passed on the H200 (gpu_h200_worker13_gpu_tests.txt).
FA3_SKIP_PADDING = False
_fa3: FlashCall | None | bool = None  # the resolved FA3 call; False where it cannot run here
_fa3_lock = threading.Lock()  # two vocoder threads may meet the first call together


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


def fa3_library() -> str | None:
    """vLLM's FlashAttention-3 op library (<vllm>/vllm_flash_attn/_vllm_fa3_C*.so), found through the
    package's folder: `find_spec` of a top-level package does not import it."""
    spec = importlib.util.find_spec("vllm")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(os.path.join(root, "vllm_flash_attn", "_vllm_fa3_C*.so")))
        if found:
            return found[0]
    return None


def _load_fa3(device: torch.device) -> FlashCall:
    """The FA3 call on `device` (raises where it cannot run: no extension, not sm90)."""
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        raise RuntimeError(f"FlashAttention-3 needs an sm90 GPU, this one is sm{major}{minor}")
    path = fa3_library()
    if path is None:
        raise ImportError("vLLM's FlashAttention-3 extension (vllm/vllm_flash_attn/_vllm_fa3_C) is not installed")
    torch.ops.load_library(path)
    log.info("flow attention: FlashAttention-3 from %s", path)
    return bind_fa3(torch.ops._vllm_fa3_C.fwd)


def _fa3_fixed() -> dict:
    """The FA3 `fwd` arguments both our calls leave at their defaults. Every argument goes by its name in
    the op's schema (vLLM 0.26's), none by position: a vLLM whose op renamed, added or dropped one fails
    the first call (the fallback from then on) instead of reading our values as other arguments."""
    unused = ("k_new", "v_new", "q_v", "out", "cu_seqlens_k", "cu_seqlens_k_new", "seqused_q", "page_table", "kv_batch_idx",
              "leftpad_k", "rotary_cos", "rotary_sin", "seqlens_rotary", "q_descale", "k_descale", "v_descale",
              "scheduler_metadata", "pack_gqa", "s_aux", "cp_tot_seqused_k")
    return dict.fromkeys(unused) | dict(is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                        is_rotary_interleaved=True, sm_margin=0, cp_world_size=1, cp_rank=0)


def bind_fa3(op) -> FlashCall:
    """Our padded-rows call on vLLM's FA3 `fwd` op (q varlen by `cu_seq`, keys the padded batch)."""
    fixed = _fa3_fixed()

    def call(q, k, v, cu_seq, T, lens):
        B, (H, D) = lens.size(0), k.shape[1:]
        k, v = k.view(B, T, H, D), v.view(B, T, H, D)  # the padded batch; row b's keys [0, lens[b])
        skip = {"seqused_q": lens, "out": q.new_zeros(q.shape)} if FA3_SKIP_PADDING else {}
        return op(q=q, k=k, v=v, cu_seqlens_q=cu_seq, seqused_k=lens, max_seqlen_q=T, max_seqlen_k=T,
                  softmax_scale=D**-0.5, num_splits=FA3_SPLITS, **(fixed | skip))[0]

    return call


def _fa3_call(device: torch.device) -> FlashCall | None:
    """The FA3 call where `FA3` is on and it runs here, else None (resolved once, a failure logged once)."""
    global _fa3
    if not FA3 or _fa3 is False:
        return None
    if _fa3 is None:
        with _fa3_lock:
            if _fa3 is None:
                try:
                    _fa3 = _load_fa3(device)
                except Exception as e:  # noqa: BLE001 - FlashAttention-2 still works
                    log.info("flow attention: no FlashAttention-3 here (%s: %s); FlashAttention-2", type(e).__name__, e)
                    _fa3 = False
                    return None
    return _fa3  # type: ignore[return-value]


def kernel() -> str:
    """Which attention the flow's padded rows got so far: 'fa3', 'fa2', 'sdpa' (flash failed) or
    'unresolved' (no call yet): what a benchmark run records beside its figures."""
    if FA3 and callable(_fa3):
        return "fa3"
    if callable(_flash):
        return "fa2"
    return "sdpa" if _flash is False else "unresolved"


def padded_attention(qkv: torch.Tensor, rows: PaddedRows) -> torch.Tensor | None:
    """qkv (B, T', 3, H, D) -> (B, T', H, D), row b attending to keys [0, lens[b]); None where flash
    cannot run here (CPU, fp32, a failed call: use SDPA with the mask)."""
    global _flash, _fa3
    if qkv.device.type not in _DEVICES or qkv.dtype not in _DTYPES:
        return None
    B, T, _, H, D = qkv.shape
    if T != rows.frames:
        raise ValueError(f"padded_attention: {T} frames per row, rows made for {rows.frames}")
    flat = qkv.view(B * T, 3, H, D)  # rows of (3, H, D): views below keep D at unit stride
    fa3 = _fa3_call(qkv.device)
    if fa3 is not None:
        try:
            return fa3(flat[:, 0], flat[:, 1], flat[:, 2], rows.cu_seq, rows.frames, rows.lens).reshape(B, T, H, D)
        except Exception as e:  # noqa: BLE001 - FlashAttention-2 still works
            log.warning("FlashAttention-3 call failed (%s: %s); the flow uses FlashAttention-2", type(e).__name__, e)
            _fa3 = False
    if _flash is False:  # FlashAttention-2 failed here before (FA3 does not depend on it)
        return None
    try:
        if _flash is None:
            _flash = _resolve()
        out = _flash(flat[:, 0], flat[:, 1], flat[:, 2], rows.cu_seq, rows.frames, rows.lens)  # (B*T', H, D)
    except Exception as e:  # noqa: BLE001 - no flash here: the masked SDPA still works
        log.warning("flash varlen attention unavailable (%s: %s); the flow uses masked SDPA", type(e).__name__, e)
        _flash = False
        return None
    return out.reshape(B, T, H, D)


# -- one query per row over the KV cache (the LLM's decode step) ----------------------------------------
#
# The torch backend's decode step attends each row's one new query over cache positions [0, kv_len),
# kv_len the step graph's width for the longest row, with SDPA and a (B, 1, 1, kv_len) mask: cuDNN's
# kernel (an sm80 one on the H100) reads every row's keys up to that width, 28% of a 256-row step's
# device time (bench/results/gpu_h100_worker26_profile.txt, "decode_step_graphs"). FA3 takes the cache
# as it is laid out (a (B, KVH, S, D) tensor viewed as (B, S, KVH, D), unit stride in D), grouped-query
# heads as they are, and each row's key count on the device (`seqused_k`: its position + 1), so a row
# reads its own keys only and the call's shapes stay those of the graph. Bench switch `llm_fa3`; off:
# not yet measured on a GPU.

DECODE_FA3 = False
DecodeCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_fa3_decode: DecodeCall | None | bool = None  # bound on the FA3 op once it is loaded; False after a failure


def bind_fa3_decode(op) -> DecodeCall:
    """One query per row on vLLM's FA3 `fwd` op: (q (B, H, D), k and v (B, S, KVH, D), cu_q (B+1,) =
    0..B int32, used (B,) int32 keys per row) -> (B, H, D)."""
    fixed = _fa3_fixed()

    def call(q, k, v, cu_q, used):
        return op(q=q, k=k, v=v, cu_seqlens_q=cu_q, seqused_k=used, max_seqlen_q=1, max_seqlen_k=k.size(1),
                  softmax_scale=q.size(-1) ** -0.5, num_splits=0, **fixed)[0]

    return call


def decode_rows(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's rows for `decode_attention`, made once per step: (cu_q (B+1,) = 0..B, used (B,) =
    positions + 1), int32, on the positions' device."""
    B = positions.size(0)
    return torch.arange(B + 1, device=positions.device, dtype=torch.int32), (positions + 1).to(torch.int32)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """q (B, H, 1, D), the cache's k and v (B, KVH, S, D), rows (`decode_rows`): row b attends to its
    first used[b] keys -> (B, H, 1, D); None where FA3 cannot run here (the caller uses SDPA with its mask)."""
    global _fa3_decode
    if not DECODE_FA3 or _fa3_decode is False or q.device.type not in _DEVICES or q.dtype not in _DTYPES:
        return None
    if _fa3_decode is None:
        if _fa3_call(q.device) is None:  # loads the op library once, or knows it cannot
            return None
        _fa3_decode = bind_fa3_decode(torch.ops._vllm_fa3_C.fwd)
    B, H, _, D = q.shape
    try:
        out = _fa3_decode(q.reshape(B, H, D), k.transpose(1, 2), v.transpose(1, 2), *rows)  # type: ignore[operator]
    except Exception as e:  # noqa: BLE001 - SDPA still works
        log.warning("FlashAttention-3 decode call failed (%s: %s); the LLM's decode uses SDPA", type(e).__name__, e)
        _fa3_decode = False
        return None
    return out.view(B, H, 1, D)


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
