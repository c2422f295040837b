"""The whole decoding step as CUDA graphs: sample, append, forward, for a fixed number of cache rows.

`TorchLlmBackend` compiles the decode step with torch.compile (reduce-overhead) over the whole
cache width. This variant captures the step as it runs eagerly, sampler and bookkeeping included,
into one CUDA graph per attention width (`kv_block` steps of 128 positions): capture takes
milliseconds instead of a compile, and attention reads only the cache positions some live row can
see. Everything the graph touches is a static tensor updated in place; the host replays the graph
for the width the longest live row needs (known on the host: prompt length + steps since its
prefill) and looks at the device only every `sync_every` steps or when a row reaches max_tokens.

Freed rows are refilled in groups (at least `rows // refill_div` at once, or whatever is left)
so prefill runs as a few batched calls instead of one per finished row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from worker.cosyvoice2.llm import CosyVoice2LM
from worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest, LlmResult
from worker.cosyvoice2.sampling import BatchSampler, RasConfig, sample_tokens


class GraphedLlmBackend(LlmBackend):
    name = "torch-graphs"

    @torch.inference_mode()
    def __init__(
        self,
        model: CosyVoice2LM,
        rows: int,  # cache rows decoding together
        max_seq: int,  # cache positions: prompt + max_tokens must fit
        window: int = 10,  # RAS win_size the buffers hold
        kv_block: int = 128,  # attention width granularity (one graph per multiple)
        sync_every: int = 16,
        refill_div: int = 8,
        graphs: bool | None = None,  # default: on CUDA
    ):
        self.model, self.rows, self.max_seq, self.sync_every = model, rows, max_seq, sync_every
        self.min_refill = max(1, rows // refill_div)
        dev = model.llm_decoder.weight.device
        self.device = dev
        d = model.dims
        model.setup_cache(rows, max_seq, compile_decode=False)
        self.sampler = BatchSampler(rows, window, dev, d.eos_id, fn=sample_tokens)
        self.logp = torch.zeros((rows, d.n_speech), device=dev)  # (B, S+3) next-token log-probs
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # prompt lengths
        self.min_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.max_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.recent = torch.full((rows, window), -1, dtype=torch.long, device=dev)  # (B, W)
        self.tokens = torch.zeros((rows, max_seq), dtype=torch.long, device=dev)  # (B, steps)
        self.n_out = torch.zeros(rows, dtype=torch.long, device=dev)
        self.alive = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.widths = sorted({min(max_seq, w) for w in range(kv_block, max_seq + kv_block, kv_block)})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        use_graphs = dev.type == "cuda" if graphs is None else graphs
        if use_graphs:
            self._capture()

    # -- the step ------------------------------------------------------------------------------------

    def _step(self, kv_len: int) -> None:
        """One token for every row, in place (the body of each graph)."""
        S = self.model.dims.speech_token_size
        tok = self.sampler(self.logp, self.n_out, self.min_tokens, self.recent)  # (B,)
        appended = self.alive & (tok < S)
        col = self.n_out.clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, col[:, None], tok[:, None])
        self.n_out.add_(appended.long())
        self.alive.copy_(appended & (self.n_out < self.max_tokens))
        shifted = torch.cat([self.recent[:, 1:], tok[:, None]], dim=1)
        self.recent.copy_(torch.where(appended[:, None], shifted, self.recent))
        positions = (self.lengths + self.n_out - 1).clamp(0, self.max_seq - 1)
        self.logp.copy_(self.model._decode_impl(tok, positions, kv_len))

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per attention width, captured on idle rows (their writes are overwritten by prefill)."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for w in self.widths:
                self._step(w)  # warm-up: cuBLAS handles, kernel selection
        torch.cuda.current_stream().wait_stream(side)
        for w in self.widths:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._step(w)
            self.graphs[w] = g
        torch.cuda.synchronize()

    @torch.inference_mode()
    def _run(self, need: int) -> None:
        w = next(x for x in self.widths if x >= need)
        g = self.graphs.get(w)
        if g is not None:
            g.replay()
        else:
            self._step(w)

    # -- rows ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def _fill(self, slots: list[int], requests: list[LlmRequest]) -> None:
        dev = self.device
        rows = torch.tensor(slots, device=dev)
        embeds, lengths = self.model.embed_batch([(r.text_tokens, r.prompt_speech_tokens) for r in requests])
        self.logp[rows] = self.model.prefill(embeds, lengths, rows=rows)
        self.lengths[rows] = lengths
        self.min_tokens[rows] = torch.tensor([r.min_tokens for r in requests], device=dev)
        self.max_tokens[rows] = torch.tensor([r.max_tokens for r in requests], device=dev)
        self.recent[rows] = -1
        self.n_out[rows] = 0
        self.alive[rows] = True
        configs = [RasConfig(r.top_p, r.top_k, r.win_size, r.tau_r) for r in requests]
        self.sampler.assign(rows, [r.seed for r in requests], configs, [r.greedy for r in requests])

    @torch.inference_mode()
    def _collect(self, slots: list[int]) -> dict[int, list[int]]:
        alive, n_out = self.alive.tolist(), self.n_out.tolist()
        stopped = [b for b in slots if not alive[b]]
        if not stopped:
            return {}
        longest = max(n_out[b] for b in stopped)
        tokens = self.tokens[stopped, :longest].tolist()
        return {b: toks[: n_out[b]] for b, toks in zip(stopped, tokens)}

    # -- LlmBackend ------------------------------------------------------------------------------------

    def _check(self, index: int, r: LlmRequest) -> None:
        prompt_len = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2
        if r.max_tokens < 1 or r.min_tokens < 0:
            raise ValueError(f"request {index}: max_tokens must be >= 1 and min_tokens >= 0")
        if prompt_len + r.max_tokens > self.max_seq:
            raise ValueError(f"request {index}: prompt ({prompt_len}) + max_tokens ({r.max_tokens}) exceeds max_seq {self.max_seq}")
        if r.win_size > self.recent.shape[1]:
            raise ValueError(f"request {index}: win_size {r.win_size} above the window {self.recent.shape[1]}")

    def generate(self, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        for i, r in enumerate(requests):
            self._check(i, r)
        pending = deque(range(len(requests)))
        owner: dict[int, int] = {}  # row -> request index
        offset: dict[int, int] = {}  # row -> prompt_len - step at prefill: the row writes position offset + s
        ends: set[int] = set()  # steps at which some row reaches max_tokens
        s = 0

        def refill() -> None:
            free = [b for b in range(self.rows) if b not in owner]
            if not pending or not free:
                return
            if owner and len(free) < min(self.min_refill, len(pending)):
                return  # wait for a bigger group: one batched prefill instead of many small ones
            taken = [pending.popleft() for _ in free[: len(pending)]]
            slots = free[: len(taken)]
            self._fill(slots, [requests[i] for i in taken])
            for b, i in zip(slots, taken):
                r = requests[i]
                owner[b] = i
                offset[b] = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2 - s
                ends.add(s + r.max_tokens)

        refill()
        while owner:
            self._run(max(offset.values()) + s + 1)
            s += 1
            if s % self.sync_every == 0 or s in ends:
                ends.discard(s)
                for b, tokens in self._collect(sorted(owner)).items():
                    yield LlmResult(index=owner.pop(b), tokens=tokens)
                    del offset[b]
                refill()

    def close(self) -> None:
        self.graphs.clear()
        self.model.cache_k = self.model.cache_v = None
