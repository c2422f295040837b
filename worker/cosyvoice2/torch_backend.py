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
from worker.cosyvoice2.sampling import BatchSampler, RasConfig, compile_sample_tokens, sample_tokens


def _bucket(n: int, cap: int) -> int:
    """Next power of two >= n (at most cap): compiled steps see a few batch shapes, not every B."""
    b = 1
    while b < n:
        b *= 2
    return min(b, cap)


class _Wave:
    """Decoding state of one batch of requests (all tensors on the model's device).

    With `rows > len(requests)` the extra rows are padding (never alive), so a compiled step sees one
    of a few batch shapes; they decode garbage into their own cache rows and are never read.
    """

    @torch.inference_mode()
    def __init__(self, model: CosyVoice2LM, requests: list[LlmRequest], rows: int, sample_fn):
        self.model, self.n_real = model, len(requests)
        dev = model.llm_decoder.weight.device
        padded = requests + [requests[0]] * (rows - len(requests))
        embeds, lengths = model.embed_batch([(r.text_tokens, r.prompt_speech_tokens) for r in requests])
        self.prompt_max = int(embeds.shape[1])
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)  # (B,) row b writes token s at lengths[b] + s
        self.lengths[: len(requests)] = lengths
        self.logp = torch.zeros((rows, model.dims.n_speech), device=dev)  # (B, S+3) next-token log-probs
        self.logp[: len(requests)] = model.prefill(embeds, lengths)
        configs = [RasConfig(r.top_p, r.top_k, r.win_size, r.tau_r) for r in padded]
        self.sampler = BatchSampler([r.seed for r in padded], configs, [r.greedy for r in padded], dev, model.dims.eos_id, fn=sample_fn)
        self.min_tokens = torch.tensor([r.min_tokens for r in padded], device=dev)
        self.max_tokens = torch.tensor([r.max_tokens for r in padded], device=dev)
        self.steps = max(r.max_tokens for r in requests)
        self.recent = torch.full((rows, self.sampler.window), -1, dtype=torch.long, device=dev)  # (B, W)
        self.tokens = torch.zeros((rows, self.steps), dtype=torch.long, device=dev)  # (B, steps) decoded ids
        self.n_out = torch.zeros(rows, dtype=torch.long, device=dev)
        self.alive = torch.arange(rows, device=dev) < len(requests)
        self.step_t = torch.zeros((), dtype=torch.long, device=dev)  # the step counter the uniforms hash, kept on device

    @torch.inference_mode()
    def step(self, s: int) -> None:
        """Choose token s of every alive row from `self.logp`, then run the decode step for s + 1."""
        tok = self.sampler(self.logp, self.n_out, self.min_tokens, self.recent, self.step_t)  # alive rows have decoded s tokens
        self.step_t += 1
        appended = self.alive & (tok < self.model.dims.speech_token_size)  # any of the three stop ids ends a row
        self.tokens[:, s] = tok
        self.n_out += appended
        self.alive = appended & (self.n_out < self.max_tokens)
        shifted = torch.cat([self.recent[:, 1:], tok[:, None]], dim=1)
        self.recent = torch.where(appended[:, None], shifted, self.recent)
        if s + 1 < self.steps:
            t_max = self.model.cache_shape[1]
            positions = (self.lengths + s).clamp(max=t_max - 1)  # finished rows only ever touch their own row
            self.logp = self.model.decode_step(tok, positions, kv_len=min(self.prompt_max + s + 1, t_max))

    @torch.inference_mode()
    def collect(self, done: set[int]) -> dict[int, list[int]]:
        """One host sync: real rows that have stopped and are not in `done`, with their tokens."""
        alive, n_out = self.alive.tolist(), self.n_out.tolist()
        rows = [b for b in range(self.n_real) if not alive[b] and b not in done]
        if not rows:
            return {}
        tokens = self.tokens[rows].tolist()
        return {b: toks[: n_out[b]] for b, toks in zip(rows, tokens)}


class TorchLlmBackend(LlmBackend):
    """Batched CosyVoice2 decoding in plain PyTorch; the decode step is compiled on GPU when asked."""

    name = "torch"

    def __init__(
        self,
        model: CosyVoice2LM,
        max_batch: int = 64,  # rows of the KV cache; larger request lists are decoded in waves
        max_seq: int = 4096,  # positions of the KV cache: prompt + max_tokens must fit
        compile_decode: bool = False,  # CUDA graphs for the decode step and the sampler (GPU only)
        sync_every: int = 16,  # steps between host looks for finished rows
        bucket_batches: bool | None = None,  # pad waves to a power of two (default: when compiled)
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
        for base in range(0, len(requests), self.max_batch):
            yield from self._decode_wave(base, requests[base : base + self.max_batch])

    def _decode_wave(self, base: int, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        rows = _bucket(len(requests), self.max_batch) if self.bucket else len(requests)
        wave = _Wave(self.model, requests, rows, self._sample_fn)
        # Steps after which some row is certainly done (it reached max_tokens): worth a look.
        cap_steps = {r.max_tokens for r in requests}
        done: set[int] = set()
        for s in range(wave.steps):
            wave.step(s)
            if (s + 1) % self.sync_every == 0 or (s + 1) in cap_steps:
                for b, tokens in wave.collect(done).items():
                    done.add(b)
                    yield LlmResult(index=base + b, tokens=tokens)
                if len(done) == wave.n_real:
                    return

