"""The interface the worker drives, and the registry that builds an engine from settings.

An engine turns batches of segment texts into audio. The worker's pipeline (worker/pipeline.py) owns
the threads: it feeds `Engine.serve` from an intake queue and takes finished audio from the
`emit` callback into the bounded output queue (the double buffer). Engines that batch continuously
(vLLM) override `serve`; the rest implement `synthesize` and get the batching loop for free.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from voxbatch.models import SynthesisParams
from voxbatch.outage import is_outage
from voxbatch.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthesisRequest:
    """One segment to synthesize. `tag` is opaque to the engine and comes back with the result."""

    segment_id: str
    text: str
    voice: str
    seed: int
    params: SynthesisParams = field(default_factory=SynthesisParams)
    tag: object = None
    solo: bool = False  # render in a batch of its own (a suspect: its last attempt died with its worker)
    # What `Engine.prepare` made of it before it entered the intake (engine-private; never from a
    # message). None: the engine makes it when it takes the request.
    prepared: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SynthesisResult:
    request: SynthesisRequest
    audio: np.ndarray | None  # float32 mono in [-1, 1], at engine.sample_rate; None when it failed
    error: str | None = None
    # The error was a service outage (voxbatch.outage.is_outage: e.g. a voice profile that could not be
    # fetched), not the segment's own: the pipeline retries it without counting an attempt.
    outage: bool = False
    # The engine can render nothing more in this process (`is_engine_lost`: its GPU faulted, or a process
    # it needs died), which is not the segment's fault either: the pipeline ends the process so it is
    # restarted, and the segment's attempt counts as lost with its worker.
    engine_lost: bool = False

    @classmethod
    def failed(cls, request: SynthesisRequest, e: BaseException) -> SynthesisResult:
        """The result of a request whose rendering raised `e`, marked an outage or a lost engine where it is one."""
        return cls(request, None, f"{type(e).__name__}: {e}", outage=is_outage(e), engine_lost=is_engine_lost(e))


class EngineLost(RuntimeError):
    """Raised by an engine, or a part of one, that can serve nothing more in this process (e.g. the vLLM
    engine core it drives has died): every later request would fail the same way."""


# What torch's CUDA errors say when a kernel fault has left the process's CUDA context unusable (the
# runtime's "sticky" errors: every later call fails the same way). Out of memory is not one of them.
_DEVICE_FAULTS = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address",
                  "illegal instruction", "hardware stack error", "invalid program counter", "uncorrectable ECC error")


def is_engine_lost(e: BaseException) -> bool:
    """Whether nothing more can be rendered in this process after `e`: an `EngineLost`, or a CUDA kernel
    fault. Rendered on, every later batch would fail the same way, each failure spending an attempt of a
    segment that did nothing wrong. Torch raises kernel faults as `torch.AcceleratorError` (a
    RuntimeError saying "CUDA error: ..."); torch is not imported here for it."""
    if isinstance(e, EngineLost):
        return True
    torch = sys.modules.get("torch")
    kinds = tuple(k for k in (getattr(torch, "AcceleratorError", None),) if k is not None) or (RuntimeError,)
    return isinstance(e, kinds) and "CUDA error" in str(e) and any(m in str(e) for m in _DEVICE_FAULTS)


# What an allocation failure on the device says where it does not come as torch.OutOfMemoryError (cuBLAS and
# cuDNN allocating their workspaces): the batch was too big for the memory free at that moment, not broken.
_OUT_OF_MEMORY = ("out of memory", "ALLOC_FAILED")


def exception_chain(e: BaseException | None) -> Iterator[BaseException]:
    """`e`, then what it was raised from or while handling, and so on, each once."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e`, or an exception it was raised while handling (a CUDA graph capture ended after an
    allocation failed in it), is the device running out of memory: the same rows fit in smaller batches."""
    oom = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    return any((oom is not None and isinstance(x, oom)) or (isinstance(x, RuntimeError) and any(m in str(x) for m in _OUT_OF_MEMORY))
               for x in exception_chain(e))


class Engine(ABC):
    name: str
    sample_rate: int
    # Most requests `synthesize` is given at once.
    max_batch: int = 64

    def fingerprint(self) -> str:
        """What, besides the request, determines this engine's audio (model files, numerics): part of
        every cached segment's content hash (voxbatch/reuse.py), so audio is never reused across models."""
        return self.name

    def prepare(self, request: SynthesisRequest) -> SynthesisRequest:
        """The request with whatever the engine can make of it ahead of time (`prepared`), called on
        the thread that queues it (a Celery task's), not the engine's.

        The engine's own thread is the one that keeps the GPU fed: host work it does for a request
        (tokenizing, composing the model input) is time the GPU waits at the start of a job, when
        hundreds of requests arrive at once. Whatever is made here must be made again by the engine
        if it no longer holds (a voice re-created meanwhile). It may raise: a failure here is no
        failure (the pipeline queues the request unprepared), the engine meets it again and reports
        it then. Nothing by default."""
        return request

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[SynthesisRequest]:
        """`prepare` of a task's requests, together (an engine may batch the work, e.g. tokenize them in
        one call that lets go of the GIL). One per request, in order; a request that cannot be prepared
        comes back as it was, never raises (see `prepare`)."""
        out = []
        for request in requests:
            try:
                out.append(self.prepare(request))
            except Exception:  # noqa: BLE001 - not a failure here: the engine meets it again and reports it
                out.append(request)
        return out

    def warmup(self) -> None:
        """Run a small batch so kernels, graphs and caches are ready before the first task."""
        list(self.synthesize([SynthesisRequest("warmup", "Warm up.", "default", 0)]))

    def warm_graphs(self) -> None:
        """Build what the engine would otherwise build as its batches first reach each size (the LLM
        backend's CUDA graphs per row count): part of `warmup`; `voxbatch render` may call it after
        its probe. Nothing by default."""

    def close(self) -> None:
        """Release what the engine holds beyond this process's own memory, once nothing more will be
        rendered: the vLLM backend's engine cores are processes of their own, and Python's exit waits
        for such a child that nobody stopped (a `voxbatch worker` on vLLM never exited on SIGTERM).
        Nothing by default."""

    @abstractmethod
    def synthesize(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        """Synthesize a batch; yield each result as soon as it is ready (any order)."""

    def serve(self, intake: "queue.Queue[SynthesisRequest | None]", emit: Callable[[SynthesisResult], None],
              stop: threading.Event, observe: Callable[[int, float, float], None] | None = None,
              admit: Callable[[list[SynthesisRequest]], list[SynthesisRequest]] | None = None) -> None:
        """Drain `intake` in batches of up to `max_batch` until `stop` is set or None arrives.

        A `solo` request gets a batch of its own. `admit(batch)` is called as a batch starts and
        returns what to render now (the pipeline counts attempts there: only a segment that reaches the
        engine spends one). A failing batch is retried one request at a time, so one bad segment fails
        alone. `observe(batch_size, audio_s, wall_s)` is told about every batch (metrics).
        """
        held: list[SynthesisRequest] = []  # solo requests met while filling a batch
        while not stop.is_set():
            if held:
                first = held.pop(0)
            else:
                try:
                    first = intake.get(timeout=0.1)
                except queue.Empty:
                    continue
            if first is None:
                return
            batch = [first]
            while not first.solo and len(batch) < self.max_batch:
                try:
                    nxt = intake.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    intake.put(None)
                    break
                if nxt.solo:
                    held.append(nxt)
                else:
                    batch.append(nxt)
            if admit is not None:
                batch = admit(batch)
                if not batch:
                    continue
            t0 = time.perf_counter()
            audio_s = 0.0

            def counted(result: SynthesisResult) -> None:
                nonlocal audio_s
                if result.audio is not None:
                    audio_s += len(result.audio) / self.sample_rate
                emit(result)

            self._run_batch(batch, counted)
            if observe is not None:
                observe(len(batch), audio_s, time.perf_counter() - t0)

    def _run_batch(self, batch: list[SynthesisRequest], emit: Callable[[SynthesisResult], None]) -> None:
        pending = {id(r): r for r in batch}
        try:
            for result in self.synthesize(batch):
                pending.pop(id(result.request), None)
                emit(result)
        except Exception as e:  # noqa: BLE001 - any engine failure becomes a per-segment error
            if len(batch) == 1 or is_engine_lost(e):  # a lost engine fails every row alike: no retry row by row
                for r in pending.values():
                    emit(SynthesisResult.failed(r, e))
                return
            for r in pending.values():
                self._run_batch([r], emit)


# The CUDA caching allocator's options the CosyVoice2 engine starts with where its process was given
# none (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF set by the user win). Expandable segments map
# device memory into one growing range per stream instead of cudaMalloc'ing fixed segments, so blocks
# freed between flow/HiFT batches of other sizes go back to use instead of sitting reserved: under a
# 24 GiB cap the batches that ran out of memory did so with 9.9-10.4 GiB allocated and 13.3-13.7 GiB
# reserved but unallocated (bench/results/gpu_h100_s47a_card24_worker.log). None: PyTorch's default,
# until the worker A/B `alloc=expandable_segments:True` is measured (BENCHMARKS.md, stop 48). It acts on
# processes whose allocator has not started: a worker's or `render`'s, not the bench's engine stage, which
# builds the engine in a process that has used the GPU already.
CUDA_ALLOC_CONF: str | None = None
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def default_allocator(env: dict | None = None) -> str | None:
    """Set CUDA_ALLOC_CONF in `env` (this process's environment) unless the user chose one; PyTorch reads
    it when its allocator first starts, so this runs before the engine touches the GPU. Returns what
    the allocator will run with (None: PyTorch's default)."""
    env = os.environ if env is None else env
    for var in ALLOC_CONF_VARS:
        if env.get(var):
            return env[var]
    if CUDA_ALLOC_CONF:
        env["PYTORCH_CUDA_ALLOC_CONF"] = CUDA_ALLOC_CONF
    return CUDA_ALLOC_CONF


def build_engine(settings: Settings) -> Engine:
    """The engine named by settings.engine, loaded and ready (not yet warmed)."""
    if settings.engine == "tone":
        from voxbatch.worker.tone import ToneEngine

        return ToneEngine(max_batch=settings.engine_max_batch, rtf=settings.tone_rtf)  # None: its own ROWS
    if settings.engine == "cosyvoice2":
        log.info("CUDA allocator options: %s", default_allocator() or "PyTorch's defaults")
        from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine

        return CosyVoice2Engine.from_settings(settings)
    raise ValueError(f"unknown engine {settings.engine!r}")
