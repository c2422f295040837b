"""The LLM's packed prefill replayed as CUDA graphs: a placement is one copy and one launch.

Why: the torch backend's placements (checks, prefill, row state) held the LLM thread for 1,254 ms of a
5.25 s LLM phase in the worker on an H100 (bench/results/gpu_h100_s38_torch_gil.json), 38 ms for a
single prompt and up to ~300 ms for 35. The eager packed prefill is ~1,000 op calls (24 decoder layers);
each releases and re-takes the GIL and queues one kernel launch, behind whatever the vocoder threads
keep in the launch queue. No decode step is queued meanwhile. As a graph the prefill is a handful of
calls whatever the layer count.

Shapes. A graph holds `tokens` token slots (the placement's N rounded up to a quarter octave) and the
cache's B_max prompt slots, for prompts of at most `longest` positions (a power of two, at most the
cache's T_max: flash's max_seqlen). Prompt slots past the placement's B are empty sequences (cu_seq
repeats N); token slots past N belong to no sequence: flash leaves their output undefined, so each
layer zeroes it (`PackedPrompts.covered`) and every value stays finite. Their K/V go to the last cache
column of the first row being filled: a freshly filled row's columns past its prompt are written by its
own decode steps before any step reads them (the decode attends to positions up to its own).

The graph's inputs are one int64 buffer, [ids | kinds | positions | rows | cu_seq | last], filled by one
pinned host-to-device copy (h2d.py); each entry's embedding table is chosen by its kind (sos/task_id,
text, speech) inside the graph instead of three scatters of data-dependent sizes.

A graph is made the first time its shape is met: that placement runs eagerly through the same body (its
result is used) and the graph is captured after it without a device-wide sync (cuda_graphs.capture),
into a pool of its own that all prefill graphs share (they run one at a time on the LLM's stream, and
each output is copied out before the next replay). Placements larger than MAX_TOKENS tokens, and all
of them once a capture has failed, run eagerly (`CosyVoice2LM.prefill_packed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from voxbatch.worker.cosyvoice2.cuda_graphs import capture
from voxbatch.worker.cosyvoice2.llm import TASK_ID, CosyVoice2LM, PackedPrompts, prompt_layout

log = logging.getLogger(__name__)

MAX_TOKENS = 1 << 17  # the largest placement with a graph (256 prompts of 512; activations ~5 GiB at Qwen2-0.5B sizes)
MIN_TOKENS = 256
MIN_LONGEST = 128
KIND_SPECIAL, KIND_TEXT, KIND_SPEECH = 0, 1, 2


def token_bucket(n: int) -> int:
    """n rounded up to a quarter octave (4, 5, 6 or 7 x a power of two), at least MIN_TOKENS: at most
    25% padded work, a few graphs per doubling."""
    n = max(n, MIN_TOKENS)
    top = 1 << (n - 1).bit_length()  # next power of two >= n
    quarter = top // 8
    return next(q * quarter for q in (4, 5, 6, 7, 8) if q * quarter >= n)


def longest_bucket(n: int, t_max: int) -> int:
    """The flash call's max_seqlen: the next power of two >= n (at least MIN_LONGEST), at most t_max."""
    return min(max(MIN_LONGEST, 1 << (n - 1).bit_length()), t_max)


class _PrefillGraph:
    """One captured prefill of `tokens` token slots, prompts of at most `longest` positions."""

    def __init__(self, model: CosyVoice2LM, tokens: int, longest: int):
        self.model, self.tokens, self.longest = model, tokens, longest
        b_max, _ = model.cache_shape
        self.b_max = b_max
        dev = model.llm_decoder.weight.device
        self.inputs = torch.zeros(4 * tokens + 2 * b_max + 1, dtype=torch.long, device=dev)
        self.slots = torch.arange(tokens, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[Tensor, Tensor] | None = None  # the graph's: log-probs (B_max, S+3), lengths (B_max,)

    def run(self) -> tuple[Tensor, Tensor]:
        """The prefill body over `inputs` as they are now -> log-probs of the token after each prompt
        slot (B_max, S+3) and the slots' prompt lengths (B_max,) (eager or captured)."""
        m, n, b = self.model, self.tokens, self.b_max
        ids, kinds, positions, rows = self.inputs[: 4 * n].view(4, n)
        cu_seq = self.inputs[4 * n : 4 * n + b + 1].to(torch.int32)
        last = self.inputs[4 * n + b + 1 :]
        covered = (self.slots < cu_seq[-1])[:, None, None]  # (N, 1, 1) token slots inside some prompt
        kind = kinds[:, None]
        x = torch.where(kind == KIND_TEXT, m.body.embed_tokens(ids.clamp(max=m.dims.vocab_size - 1)),
                        m.speech_embedding(ids.clamp(max=m.dims.n_speech - 1)))
        x = torch.where(kind == KIND_SPECIAL, m.llm_embedding(ids.clamp(max=TASK_ID)), x)  # (N, D)
        packed = PackedPrompts.for_graph(positions, rows, cu_seq, self.longest, covered)
        hidden = m.body.packed(x, packed, (m.cache_k, m.cache_v))  # (N, D)
        return m.logp(hidden[last]), (cu_seq[1:] - cu_seq[:-1]).long()  # (B_max, S+3), (B_max,)

    def fill(self, host: np.ndarray) -> None:
        """Queue one pinned copy of the inputs (no host wait; ordered after the last replay on this stream)."""
        host = torch.from_numpy(host)
        if self.inputs.is_cuda:
            host = host.pin_memory()
        self.inputs.copy_(host, non_blocking=self.inputs.is_cuda)

    @torch.inference_mode()
    def capture(self, pool) -> None:
        graph = torch.cuda.CUDAGraph()
        out: list[tuple[Tensor, Tensor]] = []
        capture(graph, torch.cuda.Stream(self.inputs.device), pool, lambda: out.append(self.run()))
        self.graph, self.outputs = graph, out[0]


class PrefillGraphs:
    """`CosyVoice2LM.prefill_packed` with a CUDA graph per (token bucket, longest bucket); see the module
    docstring. Same arguments and result."""

    def __init__(self, model: CosyVoice2LM):
        self.model = model
        self.graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self.pool = None  # made at the first capture
        self.failed = False
        self.cache_at: tuple[int, int] | None = None  # the KV cache the graphs write (a new cache drops them)

    def inputs(self, prompts: Sequence[tuple[list[int], list[int]]], rows: Sequence[int], tokens: int) -> np.ndarray:
        """The graph's input buffer for these prompts, padded to `tokens` token slots and B_max prompts."""
        b_max, t_max = self.model.cache_shape
        layout = prompt_layout(prompts, rows)
        n, B = layout["total"], len(prompts)
        ids = np.zeros(tokens, dtype=np.int64)
        kinds = np.full(tokens, KIND_SPEECH, dtype=np.int64)
        ids[layout["text_at"]], kinds[layout["text_at"]] = layout["text_ids"], KIND_TEXT
        ids[layout["speech_at"]] = layout["speech_ids"]
        ids[layout["special_at"]], kinds[layout["special_at"]] = layout["special_ids"], KIND_SPECIAL
        positions = np.full(tokens, t_max - 1, dtype=np.int64)  # past N: a column no one reads (docstring)
        positions[:n] = layout["positions"]
        at = np.full(tokens, rows[0], dtype=np.int64)
        at[:n] = layout["rows"]
        cu_seq = np.full(b_max + 1, n, dtype=np.int64)
        cu_seq[: B + 1] = layout["cu_seq"]
        last = np.zeros(b_max, dtype=np.int64)
        last[:B] = layout["last"]
        return np.concatenate([ids, kinds, positions, at, cu_seq, last])

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[tuple[list[int], list[int]]], rows: Sequence[int]) -> tuple[Tensor, Tensor]:
        m = self.model
        b_max, t_max = m.cache_shape
        lengths = np.array([len(t) + len(s) + 2 for t, s in prompts], dtype=np.int64)
        n = int(lengths.sum())
        if self.failed or not prompts or n > MAX_TOKENS or int(lengths.max()) > t_max or max(rows) >= b_max:
            return m.prefill_packed(prompts, rows)  # its own checks and errors
        cache_at = (m.cache_k.data_ptr(), m.cache_v.data_ptr())
        if cache_at != self.cache_at:  # captured writes go to the cache they saw
            self.graphs.clear()
            self.cache_at = cache_at
        key = (token_bucket(n), longest_bucket(int(lengths.max()), t_max))
        graph = self.graphs.get(key)
        fresh = graph is None
        if fresh:
            graph = _PrefillGraph(m, *key)
        graph.fill(self.inputs(prompts, rows, key[0]))
        B = len(prompts)
        if not fresh:
            graph.graph.replay()
            logp, lengths = graph.outputs
            return logp[:B], lengths[:B]
        logp, lengths = graph.run()  # this placement, eagerly; then the graph for the next ones
        try:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph.capture(self.pool)
            self.graphs[key] = graph
        except Exception as e:  # noqa: BLE001 - the eager prefill still works
            self.failed = True
            log.warning("prefill graphs off (%s: %s); the LLM prefill runs eagerly", type(e).__name__, e)
        return logp[:B], lengths[:B]
