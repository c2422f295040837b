"""The `torch` LLM backend: our own batched decoding with the static KV cache of `CosyVoice2LM`.

Requests are decoded together in waves of up to `max_batch` rows. Each wave prefills its right-padded
prompts, then steps every row once per iteration: sample on device (RAS or greedy, eos masked before
min_tokens), append, advance. Tokens are collected on the device; the host looks only every
`sync_every` steps, or at a step where some row reaches its max_tokens, and then yields the rows that
stopped. Rows that stop between looks keep decoding into their own cache row (wasted work, but no
sync per step); their extra tokens are never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from worker.cosyvoice2.llm import CosyVoice2LM
from worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest, LlmResult
from worker.cosyvoice2.sampling import BatchSampler, RasConfig, mask_eos


class _Wave:
    """Decoding state of one batch of requests (all tensors on the model's device)."""

    @torch.inference_mode()
    def __init__(self, model: CosyVoice2LM, requests: list[LlmRequest]):
        self.model = model
        dev = model.llm_decoder.weight.device
        embeds, lengths = model.embed_batch([(r.text_tokens, r.prompt_speech_tokens) for r in requests])
        self.prompt_lens = [len(r.text_tokens) + len(r.prompt_speech_tokens) + 2 for r in requests]
        self.lengths = lengths  # (B,) prompt lengths: row b writes its s-th decoded token's K/V at lengths[b] + s
        self.logp = model.prefill(embeds, lengths)  # (B, S+3) next-token log-probs
        configs = [RasConfig(r.top_p, r.top_k, r.win_size, r.tau_r) for r in requests]
        self.sampler = BatchSampler([r.seed for r in requests], configs, [r.greedy for r in requests], dev)
        self.min_tokens = torch.tensor([r.min_tokens for r in requests], device=dev)
        self.max_tokens = torch.tensor([r.max_tokens for r in requests], device=dev)
        B, self.steps = len(requests), max(r.max_tokens for r in requests)
        self.recent = torch.full((B, self.sampler.window), -1, dtype=torch.long, device=dev)  # (B, W)
        self.tokens = torch.zeros((B, self.steps), dtype=torch.long, device=dev)  # (B, steps) decoded ids
        self.n_out = torch.zeros(B, dtype=torch.long, device=dev)
        self.alive = torch.ones(B, dtype=torch.bool, device=dev)
        self.step_t = torch.zeros((), dtype=torch.long, device=dev)  # the step counter the uniforms hash, kept on device

    @torch.inference_mode()
    def step(self, s: int) -> None:
        """Sample token s of every alive row from `self.logp`, then run the decode step for s + 1."""
        d = self.model.dims
        logp = mask_eos(self.logp, self.n_out, self.min_tokens, d.eos_id)
        tok = self.sampler(logp, self.recent, self.step_t)  # alive rows have decoded exactly s tokens
        self.step_t += 1
        appended = self.alive & (tok < d.speech_token_size)  # any of the three stop ids ends a row
        self.tokens[:, s] = tok
        self.n_out += appended
        self.alive = appended & (self.n_out < self.max_tokens)
        shifted = torch.cat([self.recent[:, 1:], tok[:, None]], dim=1)
        self.recent = torch.where(appended[:, None], shifted, self.recent)
        if s + 1 < self.steps:
            t_max = self.model.cache_shape[1]
            positions = (self.lengths + s).clamp(max=t_max - 1)  # finished rows only ever touch their own row
            kv_len = min(max(self.prompt_lens) + s + 1, t_max)
            self.logp = self.model.decode_step(tok, positions, kv_len)

    @torch.inference_mode()
    def collect(self, done: set[int]) -> dict[int, list[int]]:
        """One host sync: rows that have stopped and are not in `done`, with their tokens."""
        alive, n_out = self.alive.tolist(), self.n_out.tolist()
        rows = [b for b, a in enumerate(alive) if not a and b not in done]
        if not rows:
            return {}
        tokens = self.tokens[rows].tolist()
        return {b: toks[: n_out[b]] for b, toks in zip(rows, tokens)}


class TorchLlmBackend(LlmBackend):
    """Batched CosyVoice2 decoding in plain PyTorch; the decode step is compiled on GPU when asked."""

    name = "torch"

    def __init__(self, model: CosyVoice2LM, max_batch: int = 64, max_seq: int = 4096, compile_decode: bool = False, sync_every: int = 16):
        self.model = model
        self.max_batch, self.max_seq, self.sync_every = max_batch, max_seq, sync_every
        model.setup_cache(max_batch, max_seq, compile_decode=compile_decode)

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
        for base in range(0, len(requests), self.max_batch):
            yield from self._decode_wave(base, requests[base : base + self.max_batch])

    def _decode_wave(self, base: int, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        wave = _Wave(self.model, requests)
        # Steps after which some row is certainly done (it reached max_tokens): worth a look.
        cap_steps = {r.max_tokens for r in requests}
        done: set[int] = set()
        for s in range(wave.steps):
            wave.step(s)
            if (s + 1) % self.sync_every == 0 or (s + 1) in cap_steps:
                for b, tokens in wave.collect(done).items():
                    done.add(b)
                    yield LlmResult(index=base + b, tokens=tokens)
                if len(done) == len(requests):
                    return

