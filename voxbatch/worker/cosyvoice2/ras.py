"""Repetition-aware sampling (RAS) inside vLLM: the torch backend's batched sampler as a logits processor.

The processor draws every row's token itself with `sampling.sample_tokens`, the batched tensor code
the torch backend runs inside its CUDA graph (eos masked before min_tokens, the official two-step RAS
or argmax, uniforms hashed from (seed, decoded count)), and hands vLLM a one-hot row: 0 at the drawn
token, -inf elsewhere. The backend sends every request greedy (temperature 0, no vLLM seed), so
vLLM's sampler only takes that argmax. Why not write log P and let vLLM draw: a seeded request gets
its own torch.Generator in vLLM, and its sampler draws for those one request at a time (256 small
kernels a step at 256 rows); and the same seed now gives the same tokens as the torch backend
wherever the logits agree. The draws follow the official two-step distribution (tests check them
against its closed form, `sampling.ras_log_probs`).

Per-request state lives in preallocated device tensors, one row per batch row (V1) or request slot
(V2): seed key, top_p/top_k/win_size/tau_r, greedy, min_tokens, and (V1) the decoded count and the
last `WINDOW` tokens. `apply` is tensor operations over all rows with no host sync and no Python
loop over requests, replayed on a GPU as one CUDA graph (`_StepGraphs`); the host touches the tensors only when requests join, leave or move, once per
such step (packed host-to-device copies from pinned memory, not waiting for the GPU).

vLLM has two logits-processor interfaces: the V1 model runner's (`vllm.v1.sample.logits_processor`,
persistent batch + `BatchUpdate`; what vLLM 0.26 runs) and Model Runner V2's
(`vllm.v1.worker.gpu.sample.logits_processor`, request slots + on-device token history, 0.3x).
`RasLogitsProcessor` implements the first: it keeps each row's window and decoded count itself,
advanced in `apply` by the token it draws, which is exact because every row it sees is sampled and
kept (the backend turns chunked prefill off, checked in `__init__`). `RasLogitsProcessorV2`
(defined when that interface exists) implements the second and reads the window from vLLM's
history instead.

Per-request settings travel in `SamplingParams.extra_args[EXTRA_ARGS_KEY]` (see `ras_extra_args`);
the eos id is the engine's, read from the exported model config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor

from voxbatch.models import RAS_TAU_R, RAS_TOP_K, RAS_TOP_P, RAS_WIN_SIZE
from voxbatch.worker.cosyvoice2 import cuda_graphs
from voxbatch.worker.cosyvoice2.sampling import sample_tokens, seed_keys
from voxbatch.worker.cosyvoice2.vllm_export import SPEECH_TOKEN_SIZE_KEY

EXTRA_ARGS_KEY = "cosyvoice2_ras"
WINDOW = 64  # largest win_size a request may use: columns of the per-row recent-token window


@dataclass(frozen=True)
class RasParams:
    seed: int  # the request's seed: same seed, same tokens (as in the torch backend)
    min_tokens: int  # eos masked while fewer tokens than this were decoded
    top_p: float = RAS_TOP_P
    top_k: int = RAS_TOP_K
    win_size: int = RAS_WIN_SIZE
    tau_r: float = RAS_TAU_R
    greedy: bool = False

    @classmethod
    def from_sampling_params(cls, sp: SamplingParams) -> RasParams | None:
        args = (sp.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return None
        p = cls(**args)
        if not (0.0 < p.top_p <= 1.0) or p.top_k < 1 or not 1 <= p.win_size <= WINDOW or p.tau_r < 0 or p.min_tokens < 0:
            raise ValueError(f"{EXTRA_ARGS_KEY}: invalid settings {args} (win_size at most {WINDOW})")
        return p


def ras_extra_args(params: RasParams) -> dict[str, Any]:
    """`SamplingParams(extra_args=...)` that turn RAS on for one request."""
    return {EXTRA_ARGS_KEY: asdict(params)}


def engine_eos_id(vllm_config: Any) -> int:
    """The eos id (speech_token_size) the exported model config carries."""
    return int(getattr(vllm_config.model_config.hf_config, SPEECH_TOKEN_SIZE_KEY))


# Columns of the int64 table: settings, then the V1 decoding state, then the window (oldest first).
_KEY, _TOP_K, _WIN, _GREEDY, _MIN_TOKENS, _ACTIVE, _N_DECODED, _RECENT = range(8)
# Columns of the float32 table.
_TOP_P, _TAU_R = range(2)


class RowTable:
    """Per-row RAS settings and decoding state in two preallocated device tensors.

    ints (N, 7 + W) int64: seed key, top_k, win_size, greedy, min_tokens, active, decoded count, the
    last W decoded tokens (oldest first, -1 where fewer); floats (N, 2) float32: top_p, tau_r. Rows
    are written in groups: `stage` collects on the host, `flush` writes them with one packed copy per
    table; vLLM's moves are one gather.
    """

    def __init__(self, rows: int, window: int, device: torch.device | str, pin_memory: bool = False):
        self.rows, self.window, self.device, self.pin_memory = rows, window, torch.device(device), pin_memory
        self.ints = torch.zeros((rows, _RECENT + window), dtype=torch.int64, device=device)  # (N, 7 + W)
        self.ints[:, _RECENT:] = -1
        self.floats = torch.ones((rows, 2), dtype=torch.float32, device=device)  # (N, 2)
        self.live: set[int] = set()  # rows holding a RAS request (host mirror of the active column)
        self._staged: dict[int, tuple[RasParams, list[int]] | None] = {}

    def stage(self, row: int, params: RasParams | None, decoded: list[int] = ()) -> None:
        """Row `row` now holds a request with `params` that has decoded `decoded` (None: no RAS request)."""
        self._staged[row] = None if params is None else (params, list(decoded))
        if params is None:
            self.live.discard(row)
        else:
            self.live.add(row)

    def flush(self) -> None:
        """Write the staged rows: one packed host-to-device copy per table (and one of the row index)."""
        if not self._staged:
            return
        rows = list(self._staged)
        W = self.window
        ints = torch.zeros((len(rows), _RECENT + W), dtype=torch.int64)  # (n, 7 + W)
        ints[:, _RECENT:] = -1
        floats = torch.ones((len(rows), 2), dtype=torch.float32)
        entries = [(i, e) for i, e in enumerate(self._staged.values()) if e is not None]
        if entries:
            at = torch.tensor([i for i, _ in entries])
            ints[at, _KEY] = seed_keys([p.seed for _, (p, _) in entries], "cpu")
            ints[at, _TOP_K:_ACTIVE + 1] = torch.tensor([[p.top_k, p.win_size, int(p.greedy), p.min_tokens, 1] for _, (p, _) in entries])
            ints[at, _N_DECODED] = torch.tensor([len(d) for _, (_, d) in entries])
            floats[at] = torch.tensor([[p.top_p, p.tau_r] for _, (p, _) in entries], dtype=torch.float32)
            for i, (_, decoded) in entries:  # resumed requests only (new ones have decoded nothing)
                recent = [t for t in decoded[-W:] if t >= 0]  # async placeholders (-1) never count
                if recent:
                    ints[i, _RECENT + W - len(recent) :] = torch.tensor(recent)
        self._staged.clear()
        index = self._to_device(torch.tensor(rows))
        self.ints.index_copy_(0, index, self._to_device(ints))
        self.floats.index_copy_(0, index, self._to_device(floats))

    def move(self, moves: list[tuple[int, int, bool]]) -> None:
        """Apply vLLM's moves in order, (src, dst, swap), as one gather: row dst takes row src's state
        (and with swap, src takes dst's); a one-way move leaves src empty."""
        source: dict[int, int | None] = {}  # destination row -> the row its state comes from (None: empty)
        for a, b, swap in moves:
            sa, sb = source.get(a, a), source.get(b, b)
            source[b] = sa
            source[a] = sb if swap else None
            live_a, live_b = a in self.live, b in self.live
            self.live -= {a, b}
            if live_a:
                self.live.add(b)
            if swap and live_b:
                self.live.add(a)
        moved = {d: s for d, s in source.items() if s is not None and s != d}
        if moved:
            dst = self._to_device(torch.tensor(list(moved)))
            src = self._to_device(torch.tensor(list(moved.values())))
            self.ints.index_copy_(0, dst, self.ints.index_select(0, src))
            self.floats.index_copy_(0, dst, self.floats.index_select(0, src))
        emptied = [d for d, s in source.items() if s is None]
        if emptied:
            # index_fill_ on the column: a Python 0 assigned through a tensor index would be copied to the
            # device from pageable memory, a wait for everything queued (torch_backend._Rows.fill).
            self.ints[:, _ACTIVE].index_fill_(0, self._to_device(torch.tensor(emptied)), 0)

    def _to_device(self, t: Tensor) -> Tensor:
        if self.device.type == "cpu":
            return t
        # Pinned staging, copied without blocking the host (no sync with the queued GPU work).
        return (t.pin_memory() if self.pin_memory else t).to(self.device, non_blocking=self.pin_memory)

    # -- views ---------------------------------------------------------------------------------------

    def settings(self, ints: Tensor, floats: Tensor) -> dict[str, Tensor]:
        """`sample_tokens` keyword arguments from gathered table rows ints (R, 7 + W), floats (R, 2)."""
        return dict(
            keys=ints[:, _KEY],
            top_p=floats[:, _TOP_P],
            top_k=ints[:, _TOP_K],
            win_size=ints[:, _WIN],
            tau_r=floats[:, _TAU_R],
            greedy=ints[:, _GREEDY].bool(),
            min_tokens=ints[:, _MIN_TOKENS],
        )


# The V1 processor's step runs as CUDA graphs on GPU (`_StepGraphs`); False: eagerly, as on CPU.
STEP_GRAPHS = True


def _one_hot(logits: Tensor, tok: Tensor, active: Tensor) -> Tensor:
    """logits (R, V) with each active row replaced by 0 at tok (R,) and -inf elsewhere, in place."""
    pick = torch.full_like(logits, float("-inf")).scatter_(1, tok[:, None], 0.0)  # (R, V)
    return logits.copy_(torch.where(active[:, None], pick, logits))


class RasLogitsProcessor(V1LogitsProcessor):
    """RAS for vLLM's V1 model runner (persistent batch; table rows = batch rows)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RasParams.from_sampling_params(sampling_params)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        if vllm_config.scheduler_config.enable_chunked_prefill:
            # A row in the middle of a chunked prompt is sampled and its token thrown away; the
            # processor would count it as decoded.
            raise ValueError(f"{type(self).__name__} needs chunked prefill off")
        self.eos_id = engine_eos_id(vllm_config)
        self.table = RowTable(vllm_config.scheduler_config.max_num_seqs, WINDOW, device, is_pin_memory)
        self.graphs = _StepGraphs(self) if torch.device(device).type == "cuda" and STEP_GRAPHS else None

    def is_argmax_invariant(self) -> bool:
        return False  # it picks the token

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.table.stage(index, None)
        for added in batch_update.added:
            index, params, output_ids = added[0], added[1], added[-1]  # the tuple grew a field in 0.11
            ras = RasParams.from_sampling_params(params) if isinstance(params, SamplingParams) else None
            self.table.stage(index, ras, output_ids)
        self.table.flush()  # added rows are in place before they move
        if batch_update.moved:
            self.table.move([(a, b, d == MoveDirectionality.SWAP) for a, b, d in batch_update.moved])

    def apply(self, logits: Tensor) -> Tensor:
        if not self.table.live:
            return logits
        B = min(logits.shape[0], self.table.rows)
        if self.graphs is not None:
            self.graphs.replay(logits, B)
        else:
            self.step(logits[:B], B)
        return logits

    def step(self, logits: Tensor, limit: Tensor | int) -> None:
        """Draw the first R = logits.shape[0] rows' tokens and write them as one-hot logits, in place;
        rows at or past `limit` (a count, or a 0-dim tensor in a graph) are left as they are."""
        R = logits.shape[0]
        ints, floats = self.table.ints[:R], self.table.floats[:R]  # (R, 7 + W), (R, 2) views
        n_decoded, recent = ints[:, _N_DECODED], ints[:, _RECENT:]
        tok = sample_tokens(logits, n_decoded=n_decoded, recent=recent, eos_id=self.eos_id, **self.table.settings(ints, floats))
        active = ints[:, _ACTIVE].bool() & (torch.arange(R, device=logits.device) < limit)
        # Every row's token is kept (no chunked prefill), so each active row has decoded one more.
        n_decoded.add_(active.long())
        recent.copy_(torch.where(active[:, None], torch.cat([recent[:, 1:], tok[:, None]], dim=1), recent))
        _one_hot(logits, tok, active)


class _StepGraphs:
    """The V1 processor's step as one CUDA graph per power-of-two row count.

    vLLM runs logits processors eagerly, outside its own graphs: `sample_tokens` and the bookkeeping
    are ~100 small kernels with Python between them, which on the H200 put vLLM at half the torch
    backend's tokens/s (whose step, sampler included, is one graph). Here the step is captured once
    per size over a static logits buffer: a step copies the batch's logits in, replays, copies the
    one-hot rows out (vLLM at 256 rows on the H200: 14.8k -> 20.4k tokens/s fixed-length, 9.0k ->
    14.6k on the mixed corpus; bench/results/gpu_h200_vllm1.json, gpu_h200_vllm2.json). Rows past the
    batch's count (padding up to the graph's size) are masked by a count tensor written before each
    replay, so their table state never moves. Warm-up and capture run with that count at 0:
    capturing changes no row."""

    def __init__(self, proc: RasLogitsProcessor):
        self.proc = proc
        self.count = torch.zeros((), dtype=torch.int64, device=proc.table.device)
        self.graphs: dict[tuple[int, torch.dtype], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def replay(self, logits: Tensor, B: int) -> None:
        size = min(1 << (B - 1).bit_length(), self.proc.table.rows)
        graph, buf = self.graphs.get((size, logits.dtype)) or self._capture(size, logits)
        buf[:B].copy_(logits[:B])
        self.count.fill_(B)
        graph.replay()
        logits[:B].copy_(buf[:B])

    def _capture(self, size: int, logits: Tensor) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        buf = torch.zeros((size, logits.shape[1]), dtype=logits.dtype, device=logits.device)
        self.count.fill_(0)
        side = torch.cuda.Stream(logits.device)
        side.wait_stream(torch.cuda.current_stream(logits.device))
        with torch.cuda.stream(side):
            self.proc.step(buf, self.count)  # warm-up: kernel selection, allocator
        torch.cuda.current_stream(logits.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Without a device-wide sync: with the engine core in the worker's process, a vocoder thread
        # may be capturing its flow graphs right now (cuda_graphs).
        cuda_graphs.capture(graph, side, self.pool, lambda: self.proc.step(buf, self.count))
        self.graphs[(size, logits.dtype)] = (graph, buf)
        return graph, buf


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
        """RAS for Model Runner V2 (table rows = request slots; token history on device)."""

        def __init__(self, vllm_config: Any, req_states: LogitsProcRequestState) -> None:
            self.req_states = req_states
            self.eos_id = engine_eos_id(vllm_config)
            self.table = RowTable(req_states.max_num_reqs, WINDOW, req_states.device, pin_memory=req_states.device.type == "cuda")

        @classmethod
        def validate_params(cls, sampling_params: SamplingParams) -> None:
            RasParams.from_sampling_params(sampling_params)

        def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
            ras = RasParams.from_sampling_params(sampling_params)
            self.table.stage(req_idx, ras)
            return ras is not None

        def apply_staged_writes(self) -> None:
            self.table.flush()

        def apply(self, logits: Tensor, ctx: LogitsContext) -> Tensor:
            self.table.flush()  # no-op when the runner already called apply_staged_writes
            if not self.table.live:
                return logits
            W = self.table.window
            slots = ctx.expanded_idx_mapping.long()  # (R,) row -> request slot
            pos = ctx.pos.long()  # (R,) position of the token fed this step
            prompt_len = self.req_states.prompt_len.gpu.index_select(0, slots).long()  # (R,)
            # Decoded so far: positions prompt_len .. pos (the token at `pos` is this step's input;
            # it comes from input_ids, older ones from the committed history).
            n_decoded = (pos + 1 - prompt_len).clamp(min=0)  # (R,)
            where = pos[:, None] - torch.arange(W - 1, -1, -1, device=pos.device)[None, :]  # (R, W) oldest first
            history = self.req_states.all_token_ids.gpu  # (max_reqs, max_model_len)
            tokens = history[slots[:, None], where.clamp(min=0)].long()  # (R, W)
            tokens[:, -1] = ctx.input_ids.long()
            recent = torch.where(where >= prompt_len[:, None], tokens, -1)
            ints, floats = self.table.ints.index_select(0, slots), self.table.floats.index_select(0, slots)
            tok = sample_tokens(logits, n_decoded=n_decoded, recent=recent, eos_id=self.eos_id, **self.table.settings(ints, floats))
            return _one_hot(logits, tok, ints[:, _ACTIVE].bool())
