"""The `torch` LLM backend: our own batched decoding with the static KV cache of `CosyVoice2LM`.

A fixed number of rows (cache rows) decode together. Each step samples one token for every row on
the device (RAS or greedy, eos masked before min_tokens), appends it, and runs the decode step; all
of it in place on static tensors. On GPU the whole step, sampler and bookkeeping included, is
captured as one CUDA graph per attention width (multiples of `kv_block` cache positions), so a
replay reads only the cache positions some live row can see; capture takes milliseconds, where
compiling the step (torch.compile, reduce-overhead) took over a minute and ran 8x slower on the
H200 (BENCHMARKS.md). The host knows which width the longest live row needs (prompt length + steps
since its prefill) and looks at the device only every `sync_every` steps or at a step where some row
reaches max_tokens. At each look it yields the rows that stopped and prefills waiting requests into
freed rows (continuous batching), in groups of at least `rows // refill_div` so prefill runs as a few
batched calls (prompts packed end to end where flash runs, `CosyVoice2LM.prefill_packed`). `stream`
takes that work from a feed (the engine's intake) instead of a fixed list, so rows refill across task
boundaries and the row count grows while more work waits. Rows that stop between looks keep decoding
into their own cache row: wasted work, but no host sync per step; their extra tokens are never read.

A look never drains the GPU: at a look's step the rows' `alive`/`n_out` are copied into pinned host
memory behind an event, and the host reads them `look_lag` steps later, while those steps are still
queued. The stopped rows' tokens (which no later step changes) come over on a side stream that does not
wait for the queued steps, and the refill's prefill is queued behind them. So the host's bookkeeping,
the intake's admission and the prefill's launches overlap decoding instead of leaving the LLM's stream
empty at every look, as a `.tolist()` of the live state did.

The KV cache belongs to the model, so one backend runs one `generate` at a time (the engine's
scheduler thread).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from voxbatch.worker import timeline
from voxbatch.worker.cosyvoice2 import cuda_graphs
from voxbatch.worker.cosyvoice2.h2d import to_device
from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM, FlashUnavailable
from voxbatch.worker.cosyvoice2.llm_backend import Feed, ListFeed, LlmBackend, LlmRequest, LlmResult, out_of_range
from voxbatch.worker.cosyvoice2.sampling import BatchSampler, RasConfig

MAX_SEQ = 4096  # positions of the KV cache: prompt + max_tokens of a request must fit
# Decode steps queued past a look before the host reads it (module docstring): at 256 rows on an H200,
# 8 steps are ~27 ms of GPU work for the host's bookkeeping, admission and prefill launches to hide in
# (engine 239.6x vs 231.1x with lag=0, bench/results/gpu_h200_ab1.json).
LOOK_LAG = 8


def _bucket(n: int, cap: int) -> int:
    """Next power of two >= n (at most cap): graphs are captured for a few row counts, not every B."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


def attention_widths(max_seq: int, kv_block: int) -> list[int]:
    """Attention widths with a captured graph: kv_block x {1, 2, 3, 4, 6, 8, 12, ...} up to max_seq.

    Each (row count, width) graph holds its own intermediates in the graph pool; one width every
    kv_block positions (32 widths at 4096) took 107 GiB of graph pools at 256 rows on an H200. Steps of
    at most 1.5x keep the graphs few (10 at 4096) and the attention read at most 1.5x what it needs."""
    widths, k = [], 1
    while k * kv_block < max_seq:
        widths.append(k * kv_block)
        k = k + 1 if k < 4 else k + k // 2 if k & (k - 1) == 0 else k * 4 // 3
    return widths + [max_seq]


class _Rows:
    """Decoding state of `rows` cache rows on the model's device, and its CUDA graphs (one per width)."""

    @torch.inference_mode()
    def __init__(self, model: CosyVoice2LM, rows: int, window: int, widths: list[int]):
        self.model, self.rows, self.widths = model, rows, widths
        dev = model.llm_decoder.weight.device
        d, (_, max_seq) = model.dims, model.cache_shape
        self.max_seq = max_seq
        self.sampler = BatchSampler(rows, window, dev, d.eos_id)
        self.logp = torch.zeros((rows, d.n_speech), device=dev)  # (B, S+3) next-token log-probs
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # prompt lengths: token j at lengths + j
        self.min_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.max_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.recent = torch.full((rows, window), -1, dtype=torch.long, device=dev)  # (B, W) last tokens
        self.tokens = torch.zeros((rows, max_seq), dtype=torch.long, device=dev)  # (B, steps) decoded ids
        self.n_out = torch.zeros(rows, dtype=torch.long, device=dev)
        self.alive = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.scratch = torch.zeros(1, device=dev)  # timeline.launch_probe's one-element kernel
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.side = torch.cuda.Stream(dev) if dev.type == "cuda" else None  # copies that skip the queued steps

    def step(self, kv_len: int) -> None:
        """One token for every row, in place (the body of each graph)."""
        tok = self.sampler(self.logp, self.n_out, self.min_tokens, self.recent)  # (B,)
        appended = self.alive & (tok < self.model.dims.speech_token_size)  # any of the three stop ids ends a row
        col = self.n_out.clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, col[:, None], tok[:, None])  # stopped rows write past their end: never read
        self.n_out.add_(appended.long())
        self.alive.copy_(appended & (self.n_out < self.max_tokens))
        shifted = torch.cat([self.recent[:, 1:], tok[:, None]], dim=1)
        self.recent.copy_(torch.where(appended[:, None], shifted, self.recent))
        # The token just appended is token n_out - 1, fed at position lengths + n_out - 1. Rows that did
        # not append rewrite a position of their own row, which no live sequence reads.
        positions = (self.lengths + self.n_out - 1).clamp(0, self.max_seq - 1)
        self.logp.copy_(self.model.decode_step(tokens=tok, positions=positions, kv_len=kv_len))

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """One graph per attention width, captured while every row is idle (prefill overwrites it all)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for w in self.widths:
                self.step(w)  # warm-up: cuBLAS handles, kernel selection
        torch.cuda.current_stream().wait_stream(side)
        for w in self.widths:
            graph = torch.cuda.CUDAGraph()
            # thread_local: a capture may happen while the vocoder thread runs flow/HiFT (render captures
            # a row count on first use); the default global mode fails that thread's CUDA calls. Under the
            # process's graph lock (cuda_graphs.registry): no vocoder thread captures or releases meanwhile.
            with cuda_graphs.registry(side.device):
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.step(w)
                self.graphs[w] = graph  # a graph it replaces is released under the lock too
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, need: int) -> None:
        """One step attending over at least `need` cache positions."""
        width = next(w for w in self.widths if w >= need)
        graph = self.graphs.get(width)
        if graph is not None:
            graph.replay()
        else:
            self.step(width)

    @torch.inference_mode()
    def touch(self) -> None:
        """One tiny kernel on the current stream (timeline.launch_probe)."""
        self.scratch.zero_()

    @torch.inference_mode()
    def fill(self, slots: list[int], requests: list[LlmRequest]) -> None:
        """Prefill requests into free rows and reset those rows' state."""
        dev = self.logp.device
        rows = to_device(slots, torch.long, dev)
        prompts = [(r.text_tokens, r.prompt_speech_tokens) for r in requests]
        logp = None
        if self.model.packed_ready():
            try:
                logp, lengths = self.model.prefill_packed(prompts, slots)
            except FlashUnavailable:
                pass  # logged once by flash_varlen; padded from now on
        if logp is None:
            embeds, lengths = self.model.embed_batch(prompts)
            logp = self.model.prefill(embeds, lengths, rows=rows)
        self.logp[rows] = logp
        self.lengths[rows] = lengths
        self.min_tokens[rows] = to_device([r.min_tokens for r in requests], torch.long, dev)
        self.max_tokens[rows] = to_device([r.max_tokens for r in requests], torch.long, dev)
        # index_fill_, not `self.recent[rows] = -1`: on CUDA a Python number assigned through a tensor index
        # is copied from pageable memory, a wait for everything queued on the stream (the prefill just
        # launched). Those waits held a job's placements 1,034 ms against 562 / 751 ms without them; the job
        # was no faster (bench/results/gpu_h100_s39c_nowait.json). A GPU test places rows in sync debug mode.
        self.recent.index_fill_(0, rows, -1)
        self.n_out.index_fill_(0, rows, 0)
        self.alive.index_fill_(0, rows, True)
        configs = [RasConfig(r.top_p, r.top_k, r.win_size, r.tau_r) for r in requests]
        self.sampler.assign(rows, [r.seed for r in requests], configs, [r.greedy for r in requests])

    @torch.inference_mode()
    def absorb(self, smaller: "_Rows") -> None:
        """Take over the rows of a smaller state (its rows keep their cache rows [0, smaller.rows))."""
        n = smaller.rows
        for name in ("logp", "lengths", "min_tokens", "max_tokens", "recent", "tokens", "n_out", "alive"):
            getattr(self, name)[:n].copy_(getattr(smaller, name))
        self.alive[n:] = False
        for name in ("keys", "top_p", "top_k", "win_size", "tau_r", "greedy"):
            getattr(self.sampler, name)[:n].copy_(getattr(smaller.sampler, name))

    @torch.inference_mode()
    def snapshot(self, step: int) -> "_Look":
        """Queue a copy of the rows' alive/n_out as of now (after every step queued so far)."""
        pinned = self.side is not None
        alive = torch.empty(self.rows, dtype=torch.bool, pin_memory=pinned)
        n_out = torch.empty(self.rows, dtype=torch.long, pin_memory=pinned)
        alive.copy_(self.alive, non_blocking=pinned)
        n_out.copy_(self.n_out, non_blocking=pinned)
        done = None
        if pinned:
            done = torch.cuda.Event()
            done.record()
        return _Look(self, step, alive, n_out, done)

    @torch.inference_mode()
    def collect(self, look: "_Look", slots: list[int]) -> dict[int, list[int]]:
        """Which of `slots` had stopped at `look` (taken of this state), with their tokens. Waits for the look's step only,
        not for the steps queued after it: a stopped row's first n_out tokens never change again."""
        if look.done is not None:
            look.done.synchronize()
        alive, n_out = look.alive.tolist(), look.n_out.tolist()
        stopped = [b for b in slots if not alive[b]]
        if not stopped:
            return {}
        longest = max(n_out[b] for b in stopped)
        if self.side is None:
            tokens = self.tokens[stopped, :longest].tolist()
        else:
            with torch.cuda.stream(self.side):  # not ordered after the queued steps (see the docstring)
                rows = torch.tensor(stopped, device=self.tokens.device)
                host = torch.empty((len(stopped), longest), dtype=torch.long, pin_memory=True)
                host.copy_(self.tokens[rows, :longest], non_blocking=True)
            self.side.synchronize()
            tokens = host.tolist()
        return {b: toks[: n_out[b]] for b, toks in zip(stopped, tokens)}


@dataclass
class _Look:
    """The rows' alive/n_out at host step `step`, on the host once `done` has passed (None: already).
    `state` is the one it was taken of: after a grow (`absorb`) its tokens still hold what it decoded."""

    state: _Rows
    step: int
    alive: torch.Tensor
    n_out: torch.Tensor
    done: torch.cuda.Event | None


class TorchLlmBackend(LlmBackend):
    """Batched CosyVoice2 decoding in plain PyTorch; the whole decode step is a CUDA graph on GPU."""

    name = "torch"

    def __init__(
        self,
        model: CosyVoice2LM,
        max_batch: int = 64,  # rows of the KV cache: at most this many requests decode at once
        max_seq: int = MAX_SEQ,  # positions of the KV cache: prompt + max_tokens must fit
        cuda_graphs: bool | None = None,  # capture the step as CUDA graphs (default: on CUDA)
        sync_every: int = 16,  # steps between host looks for finished rows
        look_lag: int | None = None,  # steps queued past a look before the host reads it (default: on CUDA, LOOK_LAG)
        bucket_batches: bool | None = None,  # round the row count up to a power of two (default: with graphs)
        window: int = 10,  # largest RAS win_size a request may use
        kv_block: int = 128,  # attention-width granularity (one graph per multiple)
        refill_div: int = 8,  # refill freed rows in groups of at least rows // refill_div
    ):
        self.model = model
        self.max_batch, self.max_seq, self.sync_every = max_batch, max_seq, sync_every
        self.window, self.refill_div = window, refill_div
        device = model.llm_decoder.weight.device
        self.look_lag = (LOOK_LAG if device.type == "cuda" else 0) if look_lag is None else look_lag
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.bucket = self.cuda_graphs if bucket_batches is None else bucket_batches
        self.widths = attention_widths(max_seq, kv_block)
        model.setup_cache(max_batch, max_seq)
        self._states: dict[int, _Rows] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 64,
        max_seq: int = MAX_SEQ,
        cuda_graphs: bool | None = None,
    ) -> TorchLlmBackend:
        model = CosyVoice2LM.from_model_dir(model_dir, device=device, dtype=dtype)
        return cls(model, max_batch=max_batch, max_seq=max_seq, cuda_graphs=cuda_graphs)

    @property
    def device(self) -> torch.device:
        return self.model.llm_decoder.weight.device

    def _state(self, rows: int) -> _Rows:
        """The decoding state for `rows` rows, made (and its graphs captured) on first use."""
        if rows not in self._states:
            state = _Rows(self.model, rows, self.window, self.widths)
            if self.cuda_graphs:
                state.capture(self._pool)
            self._states[rows] = state
        return self._states[rows]

    def warmup(self) -> None:
        """Capture the graphs of every row count `generate` can use, so no task waits for a capture."""
        sizes = {_bucket(n, self.max_batch) for n in range(1, self.max_batch + 1)} if self.bucket else {self.max_batch}
        for rows in sorted(sizes):
            self._state(rows)

    def close(self) -> None:
        """Free the graphs, their memory pool's hold and the KV cache (the model stays loaded)."""
        self._states.clear()
        self.model.cache_k = self.model.cache_v = None

    def _check(self, index: int, r: LlmRequest) -> None:
        prompt_len = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2
        if r.max_tokens < 1 or r.min_tokens < 0:
            raise ValueError(f"request {index}: max_tokens must be >= 1 and min_tokens >= 0")
        if prompt_len + r.max_tokens > self.max_seq:
            raise ValueError(f"request {index}: prompt ({prompt_len}) + max_tokens ({r.max_tokens}) exceeds max_seq {self.max_seq}")
        if r.win_size > self.window:
            raise ValueError(f"request {index}: win_size {r.win_size} above the backend's window {self.window}")
        d = self.model.dims
        if out_of_range(r.prompt_speech_tokens, d.speech_token_size) or out_of_range(r.text_tokens, d.vocab_size):
            raise ValueError(f"request {index}: token id out of range")

    def generate(self, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        for i, r in enumerate(requests):
            self._check(i, r)
        for key, tokens in self.stream(ListFeed(requests)):
            yield LlmResult(index=key, tokens=tokens)  # type: ignore[arg-type]

    def stream(self, feed: Feed) -> Iterator[tuple[object, list[int]]]:
        """Continuous batching over whatever `feed` brings: rows freed by finished sequences are
        refilled at the next host look, across the feed's task boundaries; the row count grows (to
        the next captured size, at most max_batch) when more work waits than rows are free, and
        starts small again once everything has drained."""
        while (first := feed.take(self.max_batch, True)) is not None:
            if first:
                yield from self._session(first, feed)

    def _rows_for(self, n: int) -> int:
        return _bucket(n, self.max_batch) if self.bucket else min(n, self.max_batch)

    def _session(self, first: list[tuple[object, LlmRequest]], feed: Feed) -> Iterator[tuple[object, list[int]]]:
        state = self._state(self._rows_for(len(first)))
        owner: dict[int, object] = {}  # row -> key of the request decoding in it
        offset: dict[int, int] = {}  # row -> prompt_len - step at prefill: its newest position is offset + s
        placed: dict[int, int] = {}  # row -> host step of its prefill (a look taken before it knows nothing of it)
        ends: set[int] = set()  # steps at which some row reaches max_tokens
        looks: deque[_Look] = deque()  # taken, not yet read (read look_lag steps later)
        s = 0

        def place(batch: list[tuple[object, LlmRequest]]) -> None:
            began, cpu = time.perf_counter(), time.thread_time()
            timeline.launch_probe(state.touch)  # is the launch queue full? (timeline.LAUNCH_EVENT)
            for i, (_, r) in enumerate(batch):
                self._check(i, r)
            slots = [b for b in range(state.rows) if b not in owner][: len(batch)]
            filling = time.perf_counter()
            state.fill(slots, [r for _, r in batch])
            timeline.event("llm_prefill_ms", round(1000 * (time.perf_counter() - filling)))
            for b, (key, r) in zip(slots, batch):
                owner[b] = key
                offset[b] = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2 - s
                placed[b] = s
                ends.add(s + r.max_tokens)
            timeline.event("llm_place_ms", round(1000 * (time.perf_counter() - began)))  # checks + prefill launches
            timeline.event("llm_place_cpu_ms", round(1000 * (time.thread_time() - cpu)))  # this thread's CPU time in it

        place(first)
        timeline.event("llm_session", len(first))
        closed = False
        while owner:
            state.run(min(max(offset.values()) + s + 1, self.max_seq))
            s += 1
            if s % self.sync_every == 0 or s in ends:
                ends.discard(s)
                looks.append(state.snapshot(s))
            # Read the oldest look once look_lag more steps are queued behind it (module docstring).
            if not looks or s < looks[0].step + self.look_lag:
                continue
            look = looks.popleft()
            for b, tokens in look.state.collect(look, sorted(b for b in owner if placed[b] < look.step)).items():
                del offset[b], placed[b]
                yield owner.pop(b), tokens
            if closed:
                continue
            waiting, free = feed.waiting(), state.rows - len(owner)
            grow = waiting > free and state.rows < self.max_batch
            if not waiting or (owner and not grow and free < min(max(1, state.rows // self.refill_div), waiting)):
                continue  # wait for a bigger group: one batched prefill instead of many small ones
            new = feed.take(self.max_batch - len(owner) if grow else free, False)
            if new is None:
                closed = True
                continue
            if len(owner) + len(new) > state.rows:
                bigger = self._state(_bucket(len(owner) + len(new), self.max_batch) if self.bucket else self.max_batch)
                bigger.absorb(state)
                state = bigger
            if new:
                place(new)
                timeline.event("llm_refill", len(new))
