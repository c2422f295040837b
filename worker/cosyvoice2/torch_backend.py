"""The `torch` LLM backend: our own batched decoding with the static KV cache of `CosyVoice2LM`.

A fixed number of rows (cache rows) decode together. Each step samples one token for every row on
the device (RAS or greedy, eos masked before min_tokens), appends it, and runs the decode step.
Tokens are collected on the device; the host looks only every `sync_every` steps, or at a step where
some row reaches its max_tokens. At each look it yields the rows that stopped and prefills waiting
requests into the freed rows (continuous batching). Rows that stop between looks keep decoding
into their own cache row: wasted work, but no host sync per step; their extra tokens are never read.

The KV cache belongs to the model, so one backend runs one `generate` at a time (the engine's
scheduler thread); a generator dropped half-way leaves nothing behind that the next call needs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path

import torch

from worker.cosyvoice2.llm import CosyVoice2LM
from worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest, LlmResult
from worker.cosyvoice2.sampling import BatchSampler, RasConfig, compile_sample_tokens, sample_tokens


def _bucket(n: int, cap: int) -> int:
    """Next power of two >= n (at most cap): compiled steps see a few batch shapes, not every B."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class _Rows:
    """Per-row decoding state on the model's device; a row is idle, decoding, or stopped-unread."""

    @torch.inference_mode()
    def __init__(self, model: CosyVoice2LM, rows: int, steps: int, window: int, sample_fn):
        self.model = model
        dev = model.llm_decoder.weight.device
        self.sampler = BatchSampler(rows, window, dev, model.dims.eos_id, fn=sample_fn)
        self.logp = torch.zeros((rows, model.dims.n_speech), device=dev)  # (B, S+3) next-token log-probs
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # prompt lengths: token j sits at lengths + j
        self.min_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.max_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.recent = torch.full((rows, window), -1, dtype=torch.long, device=dev)  # (B, W) last tokens
        self.tokens = torch.zeros((rows, steps), dtype=torch.long, device=dev)  # (B, steps) decoded ids
        self.n_out = torch.zeros(rows, dtype=torch.long, device=dev)
        self.alive = torch.zeros(rows, dtype=torch.bool, device=dev)

    @torch.inference_mode()
    def fill(self, slots: list[int], requests: list[LlmRequest]) -> None:
        """Prefill requests into free rows and reset those rows' state."""
        dev = self.logp.device
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
    def step(self, kv_len: int) -> None:
        """Choose the next token of every row from `self.logp`, append it, and run the decode step."""
        tok = self.sampler(self.logp, self.n_out, self.min_tokens, self.recent)  # (B,)
        appended = self.alive & (tok < self.model.dims.speech_token_size)  # any of the three stop ids ends a row
        col = self.n_out.clamp(max=self.tokens.shape[1] - 1)
        self.tokens.scatter_(1, col[:, None], tok[:, None])  # stopped rows write past their end: never read
        self.n_out += appended
        self.alive = appended & (self.n_out < self.max_tokens)
        shifted = torch.cat([self.recent[:, 1:], tok[:, None]], dim=1)
        self.recent = torch.where(appended[:, None], shifted, self.recent)
        # The token just appended is token n_out - 1, fed at position lengths + n_out - 1. Rows that did
        # not append rewrite a position of their own row, which no live sequence reads.
        positions = (self.lengths + self.n_out - 1).clamp(0, self.model.cache_shape[1] - 1)
        self.logp = self.model.decode_step(tok, positions, kv_len)

    @torch.inference_mode()
    def collect(self, slots: list[int]) -> dict[int, list[int]]:
        """One host sync: which of `slots` have stopped, with their tokens."""
        alive, n_out = self.alive.tolist(), self.n_out.tolist()
        stopped = [b for b in slots if not alive[b]]
        if not stopped:
            return {}
        tokens = self.tokens[stopped].tolist()
        return {b: toks[: n_out[b]] for b, toks in zip(stopped, tokens)}


class TorchLlmBackend(LlmBackend):
    """Batched CosyVoice2 decoding in plain PyTorch; the decode step and sampler are graphed on GPU."""

    name = "torch"

    def __init__(
        self,
        model: CosyVoice2LM,
        max_batch: int = 64,  # rows of the KV cache: at most this many requests decode at once
        max_seq: int = 4096,  # positions of the KV cache: prompt + max_tokens must fit
        compile_decode: bool = False,  # CUDA graphs for the decode step and the sampler (GPU only)
        sync_every: int = 16,  # steps between host looks for finished rows
        bucket_batches: bool | None = None,  # round the row count up to a power of two (default: when compiled)
    ):
        self.model = model
        self.max_batch, self.max_seq, self.sync_every = max_batch, max_seq, sync_every
        self.bucket = compile_decode if bucket_batches is None else bucket_batches
        model.setup_cache(max_batch, max_seq, compile_decode=compile_decode)
        self._sample_fn = compile_sample_tokens() if compile_decode else sample_tokens

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch: int = 64,
        max_seq: int = 4096,
        compile_decode: bool | None = None,  # default: on for CUDA, off on CPU
    ) -> TorchLlmBackend:
        model = CosyVoice2LM.from_model_dir(model_dir, device=device, dtype=dtype)
        if compile_decode is None:
            compile_decode = torch.device(device).type == "cuda"
        return cls(model, max_batch=max_batch, max_seq=max_seq, compile_decode=compile_decode)

    def _check(self, index: int, r: LlmRequest) -> None:
        prompt_len = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2
        if r.max_tokens < 1 or r.min_tokens < 0:
            raise ValueError(f"request {index}: max_tokens must be >= 1 and min_tokens >= 0")
        if prompt_len + r.max_tokens > self.max_seq:
            raise ValueError(f"request {index}: prompt ({prompt_len}) + max_tokens ({r.max_tokens}) exceeds max_seq {self.max_seq}")
        bad = [t for t in r.prompt_speech_tokens if not 0 <= t < self.model.dims.speech_token_size]
        if bad or any(not 0 <= t < self.model.dims.vocab_size for t in r.text_tokens):
            raise ValueError(f"request {index}: token id out of range")

    def generate(self, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        for i, r in enumerate(requests):
            self._check(i, r)
        if not requests:
            return
        n_rows = min(len(requests), self.max_batch)
        n_rows = _bucket(n_rows, self.max_batch) if self.bucket else n_rows
        window = max(r.win_size for r in requests)
        state = _Rows(self.model, n_rows, max(r.max_tokens for r in requests), window, self._sample_fn)
        pending = deque(range(len(requests)))
        owner: dict[int, int] = {}  # row -> index of the request decoding in it
        started: dict[int, int] = {}  # row -> step at which its request was prefilled
        ends: dict[int, int] = {}  # row -> step by which its request has certainly stopped (max_tokens)
        prompt_len: dict[int, int] = {}
        s = 0

        def refill() -> None:
            free = [b for b in range(n_rows) if b not in owner][: len(pending)]
            if not free:
                return
            taken = [pending.popleft() for _ in free]
            state.fill(free, [requests[i] for i in taken])
            for b, i in zip(free, taken):
                r = requests[i]
                owner[b], started[b], ends[b] = i, s, s + r.max_tokens
                prompt_len[b] = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2

        refill()
        while owner:
            # Attention width for the eager path: past every live row's newest position.
            kv_len = min(max(prompt_len[b] + s - started[b] + 1 for b in owner), self.max_seq)
            state.step(kv_len)
            s += 1
            if s % self.sync_every == 0 or s in ends.values():
                for b, tokens in state.collect(sorted(owner)).items():
                    yield LlmResult(index=owner.pop(b), tokens=tokens)
                    del started[b], ends[b], prompt_len[b]
                refill()
