"""Repetition-aware sampling (RAS) computed exactly inside vLLM, as a logits processor.

The official sampler (CosyVoice `ras_sampling`) is two-step: draw t from the nucleus distribution
q (softmax, sorted descending with a stable sort, keep tokens while the running mass before them is
< top_p and fewer than top_k are kept, renormalize); if t occurs at least `win_size * tau_r` times in
the last `win_size` decoded tokens, throw it away and draw again from the full softmax p. So the
token comes from the closed-form mixture

    P(x) = q(x) * [x not in R] + q(R) * p(x),    R = tokens repeated >= win_size * tau_r times.

The processor writes log P as the logits, so vLLM's own sampler (temperature 1, no top-k/top-p,
per-request seed) draws exactly from P. Before `min_tokens` decoded tokens the eos logit is -inf, as
the official `sampling_ids` does (only eos, not the other two stop ids). Greedy requests get the
eos mask only, so argmax matches the official greedy path.

Per-request settings travel in `SamplingParams.extra_args[EXTRA_ARGS_KEY]` (see `ras_extra_args`).
vLLM has two logits-processor interfaces: the V1 model runner's (`vllm.v1.sample.logits_processor`,
persistent batch + `BatchUpdate`) and Model Runner V2's (`vllm.v1.worker.gpu.sample.logits_processor`,
request slots + on-device token history, 0.3x). `RasLogitsProcessor` implements the first and
`RasLogitsProcessorV2` (defined when that interface exists) the second; the backend picks the one
its engine uses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

from voxbatch.models import RAS_TAU_R, RAS_TOP_K, RAS_TOP_P, RAS_WIN_SIZE

EXTRA_ARGS_KEY = "cosyvoice2_ras"


@dataclass(frozen=True)
class RasParams:
    eos_id: int  # speech_token_size
    min_tokens: int  # eos masked while fewer tokens than this were decoded
    top_p: float = RAS_TOP_P
    top_k: int = RAS_TOP_K
    win_size: int = RAS_WIN_SIZE
    tau_r: float = RAS_TAU_R
    greedy: bool = False

    @property
    def rep_threshold(self) -> int:
        # count >= win_size * tau_r (a float, compared in double in the official code) is the same
        # as count >= ceil(win_size * tau_r) for integer counts.
        return max(0, math.ceil(self.win_size * self.tau_r))

    @classmethod
    def from_sampling_params(cls, sp: SamplingParams) -> RasParams | None:
        args = (sp.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        p = cls(**args)
        if not (0.0 < p.top_p <= 1.0) or p.top_k < 1 or p.win_size < 1 or p.tau_r < 0 or p.min_tokens < 0:
            raise ValueError(f"{EXTRA_ARGS_KEY}: invalid settings {args}")
        return p


def ras_extra_args(params: RasParams) -> dict[str, Any]:
    """`SamplingParams(extra_args=...)` that turn RAS on for one request."""
    return {EXTRA_ARGS_KEY: asdict(params)}


def ras_logits(
    logits: torch.Tensor,  # (R, V) float32 raw logits
    window: torch.Tensor,  # (R, W) int64, the last win_size decoded tokens, -1 where empty
    top_p: torch.Tensor,  # (R,) float32
    top_k: torch.Tensor,  # (R,) int64
    rep_threshold: torch.Tensor,  # (R,) float32, integer valued
    mask_eos: torch.Tensor,  # (R,) bool: fewer than min_tokens decoded
    greedy: torch.Tensor,  # (R,) bool
    eos_id: int,
) -> torch.Tensor:
    """log P of the RAS mixture per row (greedy rows: the eos-masked logits). (R, V) float32."""
    R, V = logits.shape
    col = torch.arange(V, device=logits.device)
    eos_col = (col == eos_id).unsqueeze(0)  # (1, V)
    scores = logits.masked_fill(mask_eos.unsqueeze(1) & eos_col, float("-inf"))

    p = scores.softmax(dim=-1)  # (R, V) the full distribution of the fallback draw
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)  # (R, V)
    # Running mass before each token: the official loop's sequential sum, shifted by one.
    mass_before = torch.nn.functional.pad(torch.cumsum(sorted_p, dim=-1)[:, :-1], (1, 0))
    rank = col.unsqueeze(0)  # (1, V)
    keep = (mass_before < top_p.unsqueeze(1)) & (rank < top_k.unsqueeze(1))
    q_sorted = sorted_p * keep
    q_sorted = q_sorted / q_sorted.sum(dim=-1, keepdim=True)
    q = torch.zeros_like(p).scatter_(1, order, q_sorted)  # (R, V) nucleus distribution

    counts = torch.zeros_like(p).scatter_add_(1, window.clamp(min=0), (window >= 0).to(p.dtype))  # (R, V)
    repeated = counts >= rep_threshold.unsqueeze(1)  # (R, V)
    rejected_mass = (q * repeated).sum(dim=-1, keepdim=True)  # (R, 1)
    mixture = q.masked_fill(repeated, 0.0) + rejected_mass * p
    return torch.where(greedy.unsqueeze(1), scores, mixture.log())


class _Batch:
    """Tensors for the rows of one step, built on the host and moved once."""

    def __init__(self, params: list[RasParams], windows: list[list[int]], decoded: list[int], device: torch.device):
        W = max(p.win_size for p in params)
        win = torch.full((len(params), W), -1, dtype=torch.int64)  # (R, W)
        for i, (p, toks) in enumerate(zip(params, windows)):
            recent = toks[-p.win_size :]
            recent = [t for t in recent if t >= 0]  # async placeholders (-1) never count
            if recent:
                win[i, : len(recent)] = torch.tensor(recent, dtype=torch.int64)
        self.window = win.to(device, non_blocking=True)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).to(device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64).to(device)
        self.rep_threshold = torch.tensor([float(p.rep_threshold) for p in params], dtype=torch.float32).to(device)
        self.mask_eos = torch.tensor([n < p.min_tokens for p, n in zip(params, decoded)]).to(device)
        self.greedy = torch.tensor([p.greedy for p in params]).to(device)


def _apply_rows(logits: torch.Tensor, rows: list[int], batch: _Batch, eos_ids: set[int]) -> torch.Tensor:
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    out = ras_logits(
        logits.index_select(0, idx).float(),
        batch.window,
        batch.top_p,
        batch.top_k,
        batch.rep_threshold,
        batch.mask_eos,
        batch.greedy,
        _one_eos(eos_ids),
    )
    logits.index_copy_(0, idx, out.to(logits.dtype))
    return logits


class RasLogitsProcessor(V1LogitsProcessor):
    """RAS for vLLM's V1 model runner (persistent batch; rows = batch indices)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RasParams.from_sampling_params(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # batch index -> (settings, live list of the request's decoded tokens)
        self.rows: dict[int, tuple[RasParams, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # the eos mask changes greedy picks

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]  # tuple grew a field in 0.11
            ras = RasParams.from_sampling_params(params) if isinstance(params, SamplingParams) else None
            if ras is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = (ras, output_ids)
        for a, b, direction in batch_update.moved:
            ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ra is not None:
                self.rows[b] = ra
            if direction == MoveDirectionality.SWAP and rb is not None:
                self.rows[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = sorted(i for i in self.rows if i < logits.shape[0])
        params = [self.rows[i][0] for i in rows]
        outputs = [self.rows[i][1] for i in rows]
        decoded = [len(o) for o in outputs]
        batch = _Batch(params, outputs, decoded, logits.device)
        return _apply_rows(logits, rows, batch, {p.eos_id for p in params})


try:  # Model Runner V2's interface (vLLM 0.3x); absent in older releases
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsProcessor as V2LogitsProcessor,
    )
except ImportError:
    RasLogitsProcessorV2 = None
else:

    class RasLogitsProcessorV2(V2LogitsProcessor):  # type: ignore[no-redef]
        """RAS for Model Runner V2 (request slots; token history on device)."""

        def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
            self.req_states = req_states
            self.slots: dict[int, RasParams] = {}

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            RasParams.from_sampling_params(sampling_params)

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            ras = RasParams.from_sampling_params(sampling_params)
            if ras is None:
                self.slots.pop(req_idx, None)
                return False
            self.slots[req_idx] = ras
            return True

        def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
            if not self.slots:
                return logits
            # Row -> slot on the host: idx_mapping_np when rows are requests (no speculative
            # decoding), else one device->host copy.
            if len(ctx.idx_mapping_np) == logits.shape[0]:
                slot_of_row = ctx.idx_mapping_np.tolist()
            else:
                slot_of_row = ctx.expanded_idx_mapping.tolist()
            rows = [r for r, s in enumerate(slot_of_row) if s in self.slots]
            if not rows:
                return logits
            params = [self.slots[slot_of_row[r]] for r in rows]
            dev = logits.device
            row_idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            slots = ctx.expanded_idx_mapping.index_select(0, row_idx).long()  # (R,)
            pos = ctx.pos.index_select(0, row_idx).long()  # (R,) position of the token fed this step
            prompt_len = self.req_states.prompt_len.gpu.index_select(0, slots).long()  # (R,)
            # Decoded tokens so far: positions prompt_len .. pos (the token at `pos` is this step's
            # input; it is read from input_ids, older ones from the committed history).
            decoded = (pos + 1 - prompt_len).clamp(min=0)  # (R,)
            W = max(p.win_size for p in params)
            back = torch.arange(W, device=dev).unsqueeze(0)  # (1, W): 0 = newest
            where = pos.unsqueeze(1) - back  # (R, W) positions of the window
            win_size = torch.tensor([p.win_size for p in params], device=dev).unsqueeze(1)
            valid = (where >= prompt_len.unsqueeze(1)) & (back < win_size)
            history = self.req_states.all_token_ids.gpu  # (max_reqs, max_model_len)
            tokens = history[slots.unsqueeze(1), where.clamp(min=0)]  # (R, W)
            newest = ctx.input_ids.index_select(0, row_idx).long()  # (R,)
            tokens[:, 0] = newest
            window = torch.where(valid, tokens.long(), torch.full_like(tokens.long(), -1))
            min_tokens = torch.tensor([p.min_tokens for p in params], device=dev)
            out = ras_logits(
                logits.index_select(0, row_idx).float(),
                window,
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
                torch.tensor([float(p.rep_threshold) for p in params], dtype=torch.float32, device=dev),
                decoded < min_tokens,
                torch.tensor([p.greedy for p in params], device=dev),
                _one_eos({p.eos_id for p in params}),
            )
            logits.index_copy_(0, row_idx, out.to(logits.dtype))
            return logits


def _one_eos(eos_ids: set[int]) -> int:
    if len(eos_ids) != 1:
        raise ValueError(f"{EXTRA_ARGS_KEY}: requests of one engine must share eos_id, got {sorted(eos_ids)}")
    return next(iter(eos_ids))
