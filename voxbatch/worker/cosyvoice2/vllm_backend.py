"""The `vllm` language-model backend: continuous batching in vLLM, exact RAS in a logits processor.

Each request enters the engine as prompt embeddings `[sos, embed(prompt_text ++ text), task_id,
speech_embed(prompt_speech)]`, built here on CPU from `llm.pt`'s own tables (no tokenizer in the
engine). vLLM then decodes speech tokens with the model class of `vllm_model.py`, and
`ras.RasLogitsProcessor` draws each step's tokens for the whole batch with the torch backend's
sampler (the official two-step RAS, in distribution; the same tokens as the torch backend for the
same seed) and hands vLLM one-hot logits, which vLLM's greedy sampler takes as they are.

One scheduler: a single driver thread owns the engine and runs the `add_request` / `step()` loop.
`generate()` calls from any thread hand their requests to it and receive each result as its request
finishes, so concurrent callers share one continuously batched engine; `stream()`, the engine's path,
takes work from the intake whenever rows are free, across task boundaries. Freed rows are refilled in
groups (`admission_group`), so prompts are prefilled a few at a time in batched steps.

Several engines may share the GPU (`VllmOptions.engines`), each with its own core process, driver
thread, share of the rows and of the memory; each request goes to the engine holding the fewest. Why:
a vLLM step at 256 rows is ~10 ms of which ~3 ms is GPU work, the rest one Python thread's
scheduling and bookkeeping (bench/results/gpu_h100_s37_vllm_pyspy.txt); two cores run that host work
side by side while each other's kernels keep the GPU busy.

Where the engine core runs (`VllmOptions.engine_process`): on a GPU in a process of its own, as
vLLM runs it by default. There its scheduler, input preparation and the model's launches hold no
GIL that this process's flow/HiFT threads and upload threads want, and it steps on while this
process turns outputs into results. The child finds the model class through the
`vllm.general_plugins` entry point (pyproject.toml), so that needs voxbatch installed; where it is
not (a source checkout on PYTHONPATH), or on a CPU, the core runs in this process.
"""

from __future__ import annotations

import collections
import importlib.metadata
import itertools
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from voxbatch.worker.cosyvoice2.checkpoint import load_state_dict
from voxbatch.worker.cosyvoice2.llm import SOS, TASK_ID, LlmDims
from voxbatch.worker.cosyvoice2.llm_backend import Feed, LlmBackend, LlmRequest, LlmResult, out_of_range
from voxbatch.worker.cosyvoice2.vllm_export import export_for_vllm
from voxbatch.worker.engine import EngineLost

log = logging.getLogger(__name__)

# How long `stream` waits for a result while rows are free before it looks at the feed again.
STREAM_POLL_S = 0.005
# `stream` refills rows as they free (the continuous batching across tasks); False: the base
# class's batch after batch, each decoded whole. The worker on vLLM, tasks of 16, H100, A B A: 266.0x /
# 255.0x refilling vs 237.0x batch after batch (B/A 0.91, bench/results/gpu_h100_s38a_vllm_worker.json).
# Bench switch `vstream`.
CONTINUOUS_STREAM = True
# Ask vLLM for a request's output only when it finishes (RequestOutputKind.FINAL_ONLY) instead of a
# RequestOutput per running request per step, which the driver skips: building those was 10.5% of the
# in-process engine thread's samples (`RequestState.make_request_output`, H100,
# bench/results/gpu_h100_s37_vllm_pyspy.txt). On: the worker on vLLM, tasks of 16, H100, A B A pairs:
# 273.3x with vs 254.2x / 263.8x without, engine core in the worker's process (B/A 1.055,
# gpu_h100_s38b_vllm_worker.json); 287.8x vs 244.6x / 272.1x, core in its own process (B/A 1.114,
# gpu_h100_s38c_vllm_worker.json). Bench switch `vfinal` (`vfinal=0` for the per-step outputs).
FINAL_ONLY = True


class PromptEmbedder:
    """The three embedding tables of `llm.pt` the prompt needs, kept on CPU."""

    def __init__(self, model_dir: str | Path, dims: LlmDims):
        sd = load_state_dict(model_dir, "llm.pt")
        self.special = sd["llm_embedding.weight"].float().clone()  # (2, D): sos, task_id
        self.text = sd["llm.model.model.embed_tokens.weight"].float().clone()  # (V_text, D)
        self.speech = sd["speech_embedding.weight"].float().clone()  # (S+3, D)
        self.dims = dims

    def __call__(self, r: LlmRequest) -> torch.Tensor:
        """(1 + T_text + 1 + T_tok, D) float32."""
        text = torch.tensor(r.text_tokens, dtype=torch.long)
        speech = torch.tensor(r.prompt_speech_tokens, dtype=torch.long)
        return torch.cat([self.special[SOS : SOS + 1], self.text[text], self.special[TASK_ID : TASK_ID + 1], self.speech[speech]])

    def check(self, index: int, r: LlmRequest) -> None:
        if r.max_tokens < 1 or r.min_tokens < 0:
            raise ValueError(f"request {index}: max_tokens must be >= 1 and min_tokens >= 0")
        if out_of_range(r.text_tokens, self.text.shape[0]):
            raise ValueError(f"request {index}: text token id out of range [0, {self.text.shape[0]})")
        if out_of_range(r.prompt_speech_tokens, self.dims.speech_token_size):
            raise ValueError(f"request {index}: prompt speech token out of range [0, {self.dims.speech_token_size})")


@dataclass(frozen=True)
class VllmOptions:
    gpu_memory_utilization: float = 0.45  # settings.vllm_gpu_memory_utilization (GPU only)
    max_model_len: int = 4096  # prompt + generated tokens per request
    max_num_seqs: int = 64  # sequences decoded together
    kv_cache_bytes_cpu: int = 256 * 2**20  # KV cache size on CPU (vLLM's CPU default is GiBs)
    export_cache_dir: str | None = None  # where the vLLM folder goes (default: see vllm_export)
    dtype: str | None = None  # "float32" / "bfloat16"; None: float32 on CPU, bfloat16 on GPU (parity checks ask float32)
    max_prefill_tokens: int | None = None  # prompt positions one engine step takes (at least max_model_len); None: 2048 on CPU, 8192 on GPU
    engine_process: bool | None = None  # engine core in its own process; None: yes on a GPU where the plugin is installed
    async_scheduling: bool | None = None  # schedule step N+1 while step N runs; None: vLLM's choice (on where supported)
    # Largest engine step (tokens: decode rows + prompt positions) replayed from CUDA graphs. A step
    # that admits a new prompt beside 256 decoding rows holds ~520 tokens, past vLLM's default
    # (2 x max_num_seqs, at most 512), so without this every refill step runs without graphs. None: vLLM's.
    cudagraph_max_tokens: int | None = None
    cudagraph_mode: str | None = None  # vLLM's CUDAGraphMode name (settings.vllm_cudagraph_mode); None: vLLM's
    admit_group: int | None = None  # requests handed to vLLM once this many rows are free; None: max_num_seqs // 8 (settings.vllm_admit_group)
    stream_priority: int | None = None  # CUDA priority of the model's stream (vllm_model.StreamPriority); None: vLLM's stream
    engines: int = 1  # engines sharing the GPU, each with its own core process, max_num_seqs // engines rows and memory share


class _Job:
    """One `generate()` or `stream()` call: where the driver thread puts its results (or its failure)."""

    def __init__(self):
        self.results: queue.Queue[LlmResult | BaseException] = queue.Queue()


@dataclass(frozen=True)
class _Pending:
    """A request the driver holds until the engine takes it."""

    job: _Job
    index: int  # the result's index for its call
    rid: str
    prompt: dict
    params: Any


class VllmLlmBackend(LlmBackend):
    name = "vllm"

    def __init__(self, model_dir: str | Path, options: VllmOptions | None = None):
        from voxbatch.worker.cosyvoice2 import vllm_model

        self.options = options or VllmOptions()
        self.dims = LlmDims.from_model_dir(model_dir)
        self.embedder = PromptEmbedder(model_dir, self.dims)
        folder = export_for_vllm(model_dir, self.options.export_cache_dir)
        vllm_model.register()
        self._threads = torch.get_num_threads()  # the process's intra-op threads, for the driver threads
        self._ids = itertools.count()
        n = self.options.engines
        if n < 1 or self.options.max_num_seqs < n:
            raise ValueError(f"vllm: {n} engines for {self.options.max_num_seqs} rows (at least one row each)")
        self.drivers: list[_Driver] = []
        try:
            for i in range(n):
                engine, self.dtype = _build_engine(folder, self.engine_options(), require_own_process=n > 1)
                self.drivers.append(_Driver(self, engine, i))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_settings(cls, settings: Any) -> VllmLlmBackend:
        if not settings.model_dir:
            raise ValueError("the vllm backend needs settings.model_dir")
        device = getattr(settings, "llm_device", None)
        if device and device.startswith("cuda:") and device != "cuda:0":
            # vLLM places its worker on the first visible GPU; the launcher picks the GPU through
            # CUDA_VISIBLE_DEVICES before anything touches CUDA.
            log.warning("llm_device=%s: the vllm backend uses the first visible GPU (set CUDA_VISIBLE_DEVICES)", device)
        options = VllmOptions(
            gpu_memory_utilization=settings.vllm_gpu_memory_utilization,
            max_model_len=settings.vllm_max_model_len,
            max_num_seqs=settings.engine_max_batch,
            dtype=None if settings.llm_dtype == "auto" else settings.llm_dtype,
            engine_process=settings.vllm_engine_process,
            async_scheduling=settings.vllm_async_scheduling,
            cudagraph_max_tokens=settings.vllm_cudagraph_max_tokens,
            cudagraph_mode=settings.vllm_cudagraph_mode,
            admit_group=settings.vllm_admit_group,
            stream_priority=settings.vllm_stream_priority,
            engines=settings.vllm_engines,
        )
        return cls(settings.model_dir, options)

    @property
    def max_batch(self) -> int:  # type: ignore[override]
        """Requests `stream` hands vLLM at once: every engine's rows (max_num_seqs, less what does not
        divide among several engines)."""
        return self.engine_options().max_num_seqs * self.options.engines

    @property
    def max_seq(self) -> int:
        """Positions one request may use (prompt + generated); the engine caps max_tokens to fit."""
        return self.options.max_model_len

    @property
    def engine(self) -> Any:
        """The (first) vLLM engine."""
        return self.drivers[0].engine

    @property
    def stream_rpc(self) -> list | None:
        """What StreamPriority answered in each engine, once every driver has asked (None before)."""
        answers = [d.stream_rpc for d in self.drivers]
        return None if any(a is None for a in answers) else [x for a in answers for x in a]

    def engine_options(self) -> VllmOptions:
        """One engine's options: its share of the rows and of the GPU memory."""
        n = self.options.engines
        if n == 1:
            return self.options
        return replace(self.options, max_num_seqs=self.options.max_num_seqs // n,
                       gpu_memory_utilization=self.options.gpu_memory_utilization / n)

    # -- the caller side ---------------------------------------------------------------------------

    def generate(self, requests: list[LlmRequest]) -> Iterator[LlmResult]:
        for i, r in enumerate(requests):
            self._check(i, r)
        if not requests:
            return
        job = _Job()
        ids = self._submit(job, requests, list(range(len(requests))))
        done = 0
        try:
            while done < len(requests):
                item = self._next_result(job, 1.0)
                if item is not None:
                    done += 1
                    yield item
        finally:
            if done < len(requests):  # caller stopped early: free the engine slots
                self._abort(ids)

    def stream(self, feed: Feed) -> Iterator[tuple[object, list[int]]]:
        """Continuous batching across the feed's task boundaries, as the torch backend does it: work is
        taken whenever rows are free (a group of them while others decode, `admission_group`), so a
        finished request's row is refilled without waiting for the rest of its batch; each result is
        yielded as its request finishes. (The base class took a batch and decoded it whole.)"""
        if not CONTINUOUS_STREAM:
            yield from super().stream(feed)
            return
        job = _Job()
        inflight: dict[int, tuple[object, str]] = {}  # index -> (the feed's key, engine request id)
        indices = itertools.count()
        group = admission_group(self.options)
        closed = False
        try:
            while True:
                if not closed:
                    batch = self._take(feed, len(inflight), group)
                    if batch is None:
                        closed = True
                    elif batch:
                        for i, (_, r) in enumerate(batch):
                            self._check(i, r)
                        at = [next(indices) for _ in batch]
                        ids = self._submit(job, [r for _, r in batch], at)
                        inflight.update(zip(at, ((key, rid) for (key, _), rid in zip(batch, ids))))
                if not inflight:
                    if closed:
                        return
                    continue
                room = not closed and len(inflight) < self.max_batch  # new work may come for free rows
                item = self._next_result(job, STREAM_POLL_S if room else 1.0)
                if item is not None:
                    key, _ = inflight.pop(item.index)
                    yield key, item.tokens
        finally:
            if inflight:  # the caller stopped early or a request failed: free the engine slots
                self._abort([rid for _, rid in inflight.values()])

    def _take(self, feed: Feed, decoding: int, group: int) -> list[tuple[object, LlmRequest]] | None:
        """What the feed gives for the free rows: with nothing decoding, whatever comes (waiting a
        little); else only once `group` rows are free, or all that wait fit."""
        if not decoding:
            return feed.take(self.max_batch, True)
        free = self.max_batch - decoding
        return feed.take(free, False) if group_fits(free, feed.waiting(), group) else []

    def _check(self, i: int, r: LlmRequest) -> None:
        """A request this engine can take, else ValueError naming it (`i`: its place in the call)."""
        from voxbatch.worker.cosyvoice2.ras import WINDOW

        self.embedder.check(i, r)
        if r.win_size > WINDOW:
            raise ValueError(f"request {i}: win_size {r.win_size} above the backend's window {WINDOW}")
        prompt_len = len(r.text_tokens) + len(r.prompt_speech_tokens) + 2
        if prompt_len + r.max_tokens > self.options.max_model_len:
            raise ValueError(
                f"request {i}: prompt ({prompt_len}) + max_tokens ({r.max_tokens}) exceeds max_model_len {self.options.max_model_len}"
            )

    def _submit(self, job: _Job, requests: list[LlmRequest], indices: list[int]) -> list[str]:
        """Hand checked requests to the driver threads, each to the engine holding the fewest requests
        (held, or on their way to it); their results reach `job` under `indices`."""
        for d in self.drivers:
            if d.failed is not None:
                raise EngineLost("the vLLM engine failed earlier") from d.failed
        ids = [f"r{next(self._ids)}" for _ in requests]
        items = [(rid, {"prompt_embeds": self.embedder(r).to(self.dtype)}, self._sampling_params(r)) for rid, r in zip(ids, requests)]
        index_of = dict(zip(ids, indices))
        load = [d.load() for d in self.drivers]
        dealt: list[list] = [[] for _ in self.drivers]
        for item in items:
            k = min(range(len(load)), key=load.__getitem__)
            dealt[k].append(item)
            load[k] += 1
        for d, mine in zip(self.drivers, dealt):
            if mine:
                d.send(job, index_of, mine)
        return ids

    def _abort(self, ids: list[str]) -> None:
        """Take these requests out of whichever engine or queue holds them."""
        for d in self.drivers:
            d.inbox.put(("abort", ids))

    def _next_result(self, job: _Job, timeout: float) -> LlmResult | None:
        """The next finished request of `job`, or None after `timeout`; raises if an engine failed."""
        try:
            item = job.results.get(timeout=timeout)
        except queue.Empty:
            for d in self.drivers:
                if d.failed is not None:  # its engine failed: nothing more can be decoded here
                    raise EngineLost("the vLLM engine failed earlier") from d.failed
                if not d.thread.is_alive():  # stopped (closed) before taking this call
                    raise RuntimeError("the vLLM driver thread is not running")
            return None
        if isinstance(item, EngineLost):
            raise item
        if isinstance(item, BaseException):  # this batch's request was refused
            raise RuntimeError(f"vLLM failed on this batch: {item}") from item
        return item

    def _sampling_params(self, r: LlmRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from voxbatch.worker.cosyvoice2.ras import RasParams, ras_extra_args

        ras = RasParams(
            seed=r.seed,
            min_tokens=r.min_tokens,
            top_p=r.top_p,
            top_k=r.top_k,
            win_size=r.win_size,
            tau_r=r.tau_r,
            greedy=r.greedy,
        )
        # The processor picks the token (RAS or argmax) and leaves one finite logit: vLLM samples
        # greedily, with no per-request generator of its own. min_tokens stays 0 in vLLM: its own
        # would mask all stop ids, the official only eos (the processor does that).
        return SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=r.max_tokens,
            stop_token_ids=list(self.dims.stop_ids),
            detokenize=False,
            extra_args=ras_extra_args(ras),
            output_kind=RequestOutputKind.FINAL_ONLY if FINAL_ONLY else RequestOutputKind.CUMULATIVE,
        )

    def close(self) -> None:
        """Stop the driver threads and the engine cores (frees the KV caches); once, however often called."""
        drivers, self.drivers = getattr(self, "drivers", []), []
        for d in drivers:
            d.close()


class _Driver:
    """One vLLM engine and the thread that owns it: the only caller of its add_request / step loop.
    Requests come through `inbox` ("add", "abort", "stop"); results go to each call's `_Job`."""

    def __init__(self, backend: VllmLlmBackend, engine: Any, number: int):
        self.backend, self.engine = backend, engine
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.failed: BaseException | None = None
        self.stream_rpc: list | None = None  # what StreamPriority answered, once this driver asked it
        self.held = 0  # requests in the engine or in the driver's queue (the driver thread's count)
        self.unseen = 0  # requests sent and not yet taken from the inbox
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._drive, name=f"vllm-driver-{number}", daemon=True)
        self.thread.start()

    def send(self, job: _Job, index_of: dict[str, int], items: list) -> None:
        with self._lock:
            self.unseen += len(items)
        self.inbox.put(("add", (job, index_of, items)))

    def load(self) -> int:
        """Requests this engine holds or will: where a multi-engine backend sends the next one."""
        return self.held + self.unseen

    def close(self) -> None:
        if self.thread.is_alive():
            self.inbox.put(("stop", None))
            self.thread.join(timeout=60)
        core = getattr(self.engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def _use_stream_priority(self, priority: int) -> None:
        """Put the model's steps on a CUDA stream of `priority` (vllm_model.StreamPriority), from the driver
        thread: an in-process engine steps in this thread, an own-process core in its loop's. A failure
        leaves vLLM's own stream, with a warning: the engine works either way."""
        try:
            got = self.engine.collective_rpc("voxbatch_stream_priority", args=(priority,))
        except Exception as e:  # noqa: BLE001
            log.warning("vllm: the model's stream stays vLLM's (%s: %s)", type(e).__name__, e)
            return
        self.stream_rpc = got
        log.info("vllm: the model's CUDA stream priority is now %s (asked %d; None: no CUDA streams)", got, priority)

    def _drive(self) -> None:
        # A new thread starts with OpenMP's default thread count, not the one torch.set_num_threads gave
        # the process; vLLM's CPU attention plans its work split with the former and checks it against
        # the latter ("thread_num == thread_num (2 vs. 1)" on a long prompt). torch._C's own setter:
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op.
        torch._C.set_num_threads(self.backend._threads)
        if self.backend.options.stream_priority is not None:
            self._use_stream_priority(self.backend.options.stream_priority)
        owners: dict[str, tuple[_Job, int]] = {}  # requests in the engine -> their call and index
        pending: collections.deque[_Pending] = collections.deque()  # held back until a group's rows are free
        stop_ids = set(self.backend.dims.stop_ids)
        while True:
            idle = not self.engine.has_unfinished_requests() and not pending
            try:
                msg = self.inbox.get(block=idle)
            except queue.Empty:
                msg = None
            while msg is not None:
                kind, payload = msg
                if kind == "stop":
                    return
                if kind == "add":
                    job, index_of, items = payload
                    pending.extend(_Pending(job, index_of[rid], rid, prompt, params) for rid, prompt, params in items)
                    with self._lock:
                        self.unseen -= len(items)
                        self.held = len(owners) + len(pending)
                elif kind == "abort":
                    ids = set(payload)
                    if any(p.rid in ids for p in pending):
                        pending = collections.deque(p for p in pending if p.rid not in ids)
                    live = [rid for rid in payload if rid in owners]
                    for rid in live:
                        owners.pop(rid)
                    if live:
                        self.engine.abort_request(live)
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    msg = None
            pending = self._admit(pending, owners)
            self.held = len(owners) + len(pending)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - handed to every waiting caller, then the loop ends
                log.exception("vLLM engine step failed")
                self.failed = e
                lost = EngineLost(f"the vLLM engine step failed: {type(e).__name__}: {e}")
                lost.__cause__ = e
                for job, _ in owners.values():
                    job.results.put(lost)
                return
            for out in outputs:
                if not out.finished or out.request_id not in owners:
                    continue
                job, index = owners.pop(out.request_id)
                tokens = list(out.outputs[0].token_ids)
                if tokens and tokens[-1] in stop_ids:  # the stop token is never a speech token
                    tokens.pop()
                job.results.put(LlmResult(index=index, tokens=tokens))
            self.held = len(owners) + len(pending)

    def _admit(self, pending: collections.deque[_Pending], owners: dict[str, tuple[_Job, int]]) -> collections.deque[_Pending]:
        """Hand waiting requests to the engine: all of them at once with a group of 1 (vLLM fills a
        freed row at its next step); else once `admit_group` rows are free, or as many as wait when
        fewer do and fit, so their prompts are prefilled together. A request the engine rejects fails
        its own call: that call's other requests leave the engine and the queue. Returns what still waits."""
        options = self.backend.engine_options()
        group = admission_group(options)
        free = len(pending) if group <= 1 else options.max_num_seqs - len(owners)
        if not group_fits(free, len(pending), group):
            return pending
        failed: set[int] = set()
        for _ in range(min(free, len(pending))):
            p = pending.popleft()
            if id(p.job) in failed:
                continue
            try:
                self.engine.add_request(p.rid, p.prompt, p.params)
                owners[p.rid] = (p.job, p.index)
            except Exception as e:  # noqa: BLE001 - a rejected request fails its own call only
                failed.add(id(p.job))
                mine = [rid for rid, (job, _) in owners.items() if job is p.job]
                for rid in mine:
                    owners.pop(rid)
                if mine:
                    self.engine.abort_request(mine)
                p.job.results.put(e)
        if failed:
            pending = collections.deque(p for p in pending if id(p.job) not in failed)
        return pending


PLUGIN = "voxbatch.worker.cosyvoice2.vllm_model:register"
STREAM_EXTENSION = "voxbatch.worker.cosyvoice2.vllm_model.StreamPriority"  # VllmOptions.stream_priority


def admission_group(options: VllmOptions) -> int:
    """Rows that must be free before waiting requests join (at most the engine's rows): the option,
    else max_num_seqs // 8 as the torch backend refills."""
    return min(options.admit_group or max(1, options.max_num_seqs // 8), options.max_num_seqs)


def group_fits(free: int, waiting: int, group: int) -> bool:
    """The one refill rule (the driver's queue and `stream`'s intake): requests wait, and `group` rows
    are free, or all that wait fit."""
    return waiting > 0 and free >= min(group, waiting)


def plugin_installed() -> bool:
    """Whether an installed distribution declares our `vllm.general_plugins` entry point, through
    which a vLLM process started on its own (the engine core) registers the model class."""
    return any(ep.value == PLUGIN for ep in importlib.metadata.entry_points(group="vllm.general_plugins"))


def cudagraph_sizes(max_tokens: int, max_num_seqs: int) -> list[int]:
    """Step sizes (tokens) to capture up to `max_tokens`: vLLM's own steps up to the decode batch
    (1, 2, 4, then every 8), then every 32 tokens (a step is padded to the next size; prompts of
    ~260 positions make the steps past the batch coarse anyway)."""
    decode = min(max_num_seqs, max_tokens)
    sizes = [s for s in (1, 2, 4) if s <= decode] + list(range(8, decode + 1, 8))
    sizes += list(range((sizes[-1] // 32 + 1) * 32, max_tokens + 1, 32))
    return sorted(set(sizes))


def engine_in_own_process(options: VllmOptions, on_cpu: bool) -> bool:
    wanted = (not on_cpu) if options.engine_process is None else options.engine_process
    if wanted and not plugin_installed():
        log.warning("vllm: the engine core runs in this process: no installed distribution declares the "
                    "vllm.general_plugins entry point %s (pip install voxbatch)", PLUGIN)
        return False
    return wanted


def start_core_by_spawning() -> None:
    """An engine core in its own process starts from a fresh interpreter (multiprocessing "spawn"),
    unless the user chose otherwise (VLLM_WORKER_MULTIPROC_METHOD).

    vLLM forks by default and switches to spawn only when it sees CUDA initialized in this process.
    A `voxbatch worker` had touched the GPU in a way that check missed, so the forked core failed
    ("Cannot re-initialize CUDA in forked subprocess") and the worker restarted in a loop without
    ever serving (H100, bench/results/gpu_h100_s38_vllm_worker_log.txt). A spawned core imports what it
    needs itself and finds the model class through the plugin entry point."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _build_engine(folder: Path, options: VllmOptions, require_own_process: bool = False) -> tuple[Any, torch.dtype]:
    """A vLLM engine for the exported folder, with the RAS logits processor; its core in this process
    or in its own (`engine_in_own_process`; `require_own_process`: or not at all, for one of several
    engines, which would share this process's vLLM state)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    try:  # moved in vLLM 0.11
        from vllm.v1.executor import Executor
    except ImportError:
        from vllm.v1.executor.abstract import Executor

    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessor, RasLogitsProcessorV2

    on_cpu = current_platform.is_cpu()
    dtype_name = options.dtype or ("float32" if on_cpu else "bfloat16")
    dtype = getattr(torch, dtype_name)
    kwargs: dict[str, Any] = dict(
        model=str(folder),
        skip_tokenizer_init=True,
        enable_prompt_embeds=True,
        dtype=dtype_name,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        enforce_eager=on_cpu,
        enable_prefix_caching=False,  # prompts share only sos + prompt text; not worth hashing embeddings
        logits_processors=[RasLogitsProcessor],
        disable_log_stats=True,
        seed=0,
    )
    # Whole prompts only: the RAS processor advances each row's window and decoded count by the token
    # it draws, so every row it sees must be a sampled step that vLLM keeps; a row in the middle of a
    # chunked prompt is not. A step then takes whole prompts up to max_num_batched_tokens.
    kwargs["enable_chunked_prefill"] = False
    kwargs["max_num_batched_tokens"] = max(options.max_model_len, options.max_prefill_tokens or (2048 if on_cpu else 8192))
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = options.kv_cache_bytes_cpu
    else:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    if options.async_scheduling is not None:
        kwargs["async_scheduling"] = options.async_scheduling
    compilation: dict[str, Any] = {}
    if options.cudagraph_max_tokens and not on_cpu:
        compilation["cudagraph_capture_sizes"] = cudagraph_sizes(options.cudagraph_max_tokens, options.max_num_seqs)
    if options.cudagraph_mode and not on_cpu:
        compilation["cudagraph_mode"] = options.cudagraph_mode
    if compilation:
        kwargs["compilation_config"] = compilation
    if options.stream_priority is not None:
        kwargs["worker_extension_cls"] = STREAM_EXTENSION
    own_process = engine_in_own_process(options, on_cpu)
    if require_own_process and not own_process:
        raise ValueError(f"vllm: {options.engines} engines need each core in its own process "
                         "(vllm_engine_process true, and voxbatch installed for its plugin entry point)")
    if own_process:
        start_core_by_spawning()
    vllm_config = EngineArgs(**kwargs).create_engine_config()
    if not own_process and vllm_config.parallel_config.world_size == 1:
        # An in-process core keeps its worker in this process too, so the worker sees our
        # registrations: vLLM's CPU platform would otherwise start a worker subprocess (unless
        # VLLM_ENABLE_V1_MULTIPROCESSING=0); on a GPU "uni" is already vLLM's choice for one device.
        vllm_config.parallel_config.distributed_executor_backend = "uni"
    if getattr(vllm_config, "use_v2_model_runner", False):
        if RasLogitsProcessorV2 is None:
            raise RuntimeError("this vLLM runs Model Runner V2 without its logits-processor API: set VLLM_USE_V2_MODEL_RUNNER=0")
        vllm_config.model_config.logits_processors = [RasLogitsProcessorV2]
    engine = LLMEngine(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_stats=False,
        multiprocess_mode=own_process,
    )
    log.info("vllm engine: core %s, async scheduling %s, CUDA graphs %s up to %s tokens",
             "in its own process" if own_process else "in this process", vllm_config.scheduler_config.async_scheduling,
             vllm_config.compilation_config.cudagraph_mode, vllm_config.compilation_config.max_cudagraph_capture_size)
    return engine, dtype
