"""The interface both language-model backends (`torch`, `vllm`) implement.

The engine hands a backend whole requests (text tokens, prompt speech tokens, sampling settings) and
gets speech tokens back per request as each sequence finishes, so flow/HiFT can start on finished
sequences while others still decode. Both backends build the same input sequence
`[sos, embed(prompt_text ++ text), task_id, speech_embed(prompt_speech)]` and sample the same way
(repetition-aware sampling with a per-request seed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from voxbatch.models import RAS_TAU_R, RAS_TOP_K, RAS_TOP_P, RAS_WIN_SIZE


@dataclass(frozen=True)
class LlmRequest:
    text_tokens: list[int]  # prompt_text ++ text, Qwen token ids
    prompt_speech_tokens: list[int]  # speech tokens of the voice prompt (may be empty)
    min_tokens: int  # eos is masked before this many tokens (official: 2 * len(target text tokens))
    max_tokens: int  # hard cap (official: 20 * len(target text tokens))
    seed: int
    top_p: float = RAS_TOP_P  # repetition-aware sampling, the official values by default
    top_k: int = RAS_TOP_K
    win_size: int = RAS_WIN_SIZE
    tau_r: float = RAS_TAU_R
    greedy: bool = False  # argmax instead of RAS (parity tests, debugging)


@dataclass(frozen=True)
class LlmResult:
    index: int  # position of the request in the list given to `generate`
    tokens: list[int]  # speech tokens, stop token excluded


def out_of_range(ids: list[int], n: int) -> bool:
    """Whether any id falls outside [0, n). The builtins' C loops: a request's ~200 prompt speech
    tokens checked id by id in a Python generator took 10-12% of the LLM thread at a job's start on
    the H200 (bench/results/diagnostics/gpu_h200_pyspy_start1_*), where every request is checked."""
    return bool(ids) and (min(ids) < 0 or max(ids) >= n)


class Feed(Protocol):
    """Where a streaming backend takes work from (the engine's intake, already tokenized).

    `take(n, wait)` returns up to n (key, request) pairs; with `wait` (the backend has nothing
    decoding) it may block a little for work. None means no more work will come: the backend finishes
    what it decodes and returns. `waiting()` is how many requests could be taken now (a hint)."""

    def take(self, n: int, wait: bool) -> list[tuple[object, LlmRequest]] | None: ...

    def waiting(self) -> int: ...


class ListFeed:
    """A fixed list of requests as a feed, keyed by their index (what `generate` decodes)."""

    def __init__(self, requests: list[LlmRequest]):
        self._items = list(enumerate(requests))
        self._next = 0

    def take(self, n: int, wait: bool) -> list[tuple[object, LlmRequest]] | None:
        if self._next >= len(self._items):
            return None
        out = self._items[self._next : self._next + n]
        self._next += len(out)
        return out

    def waiting(self) -> int:
        return len(self._items) - self._next


class LlmBackend(ABC):
    """What the engine calls, and all it calls: nothing is looked up with getattr."""

    name: str
    max_batch: int = 64  # requests decoded at once (the torch backend's rows, vLLM's max_num_seqs)
    max_seq: int  # positions one request may use (prompt + generated tokens); the engine caps max_tokens to fit

    def warmup(self) -> None:
        """Once, before the first task (the torch backend captures its CUDA graphs); nothing by default."""

    def close(self) -> None:
        """Free what the backend holds (engine processes, caches, GPU memory); nothing by default."""

    @abstractmethod
    def generate(self, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        """Decode all requests together; yield each as soon as it stops (any order)."""

    def stream(self, feed: Feed) -> Iterator[tuple[object, list[int]]]:
        """Decode what `feed` gives until it says no more; yield (key, speech tokens) as each stops.

        This default takes a batch, decodes it whole, then takes the next; the torch backend refills
        rows as they free (continuous batching across whatever the feed brings)."""
        while (batch := feed.take(self.max_batch, True)) is not None:
            if batch:
                for res in self.generate([r for _, r in batch]):
                    yield batch[res.index][0], res.tokens
