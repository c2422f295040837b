"""Where a job's time goes inside the worker, as log lines a benchmark reads back (off by default).

With `settings.timeline_log` the logger `voxbatch.timeline` writes one INFO line per engine event:
segments admitted to the engine, an LLM decode session started or refilled, a finished row reaching
an empty vocoder, the LLM out of work (its last row handed over, nothing waiting: `llm_done`), a
flow/HiFT batch started and finished. Each line ends in `timeline <event> <count>
<unix time>`. The GPU benchmark's worker stage reads them back from the worker's log and sets each
job's first admission, first decode and first audio beside its GPU utilisation samples: the GPU sat
idle for the first 0.4-1.0 s of every job (bench/results/gpu_h200_worker5.json), and these say which
step of the start that was. A few lines per batch, never one per decode step; when off, an event
costs one level check.

When on, Python's garbage collections that stop every thread long enough to matter are events too:
`gc2 <ms>` for each full collection and `gc1 <ms>` for a generation-1 one of at least GC1_MIN_MS
(a full collection took 120-130 ms in an earlier worker run; a pause that long leaves the GPU's
queues to run dry).

Two more say whether the host keeps the GPU fed. `gil <us>`, every GIL_WINDOW_S, is how late a probe
thread woke from its GIL_PROBE_S sleeps on average (microseconds): waking needs the GIL, so the delay
is the wait every thread launching GPU work meets at that moment (~100 microseconds when the GIL is
free, the sleep's own overshoot on the H200 hosts; up to the switch interval times the threads that
want it when it is not). `vocode_host_ms <ms>` is how
long a flow/HiFT batch took to queue all its GPU work (the host's part, GIL waits included) and
`vocode_ms <ms>` its whole wall time: a batch whose host part is most of its wall time kept its
stream short of work. `llm_admit_ms` and `llm_place_ms` are the LLM thread's host time to take
segments in and to place them in cache rows (LLM_HOST_EVENTS); `llm_place_cpu_ms` is the LLM thread's
CPU time over a placement (far below its wall time when it waits, for the GIL or the launch queue),
`llm_prefill_ms` the part spent filling the rows (the prefill's launches, the rows' state and sampler
reset), and `llm_launch_us` how long one tiny kernel's launch held the thread just before (`launch_probe`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("voxbatch.timeline")
log.setLevel(logging.WARNING)  # off until `configure(True)`
LINE = re.compile(r"timeline (\w+) (\d+) ([0-9.]+)$")
# `vocode_oom`: a flow/HiFT batch ran out of device memory (count = its rows; it renders again in halves).
# `vocode_budget`: the flow/HiFT token budget changed (count = the new budget, padded speech tokens).
# `llm_oom`: the LLM ran out of device memory (count = the requests it held; they are decoded again).
EVENTS = ("admit", "llm_session", "llm_refill", "vocoder_first_row", "llm_done", "vocode_start", "vocode_end", "vocode_oom",
          "vocode_budget", "llm_oom")
GC_EVENTS = ("gc1", "gc2")  # count = the pause in milliseconds
# The LLM thread's host time (count = milliseconds) to take segments in (the pipeline's attempt count
# and the engine's item for each) and to place them in cache rows (checks and prefill launches): no
# decode step is launched meanwhile, so at a job's start these are GPU time lost. `llm_place_cpu_ms` is
# the thread's CPU time over each placement and `llm_prefill_ms` the part of it spent filling the rows:
# both are parts of `llm_place_ms`, not to be added to it.
LLM_HOST_EVENTS = ("llm_admit_ms", "llm_place_ms", "llm_place_cpu_ms", "llm_prefill_ms")
# A flow/HiFT batch's host phases, ms (summed per job): `vocode_flow_host_ms`, from the batch's start
# until the flow's GPU work is all queued (HiFT's host work follows, to `vocode_host_ms`), and
# `flow_capture_ms`, the Euler step's graph capture in it; set beside the GPU's dips, they say which
# phase each vocoder thread was in. With streaming.VOCODER_PIPELINE, `vocode_begin_ms` is the begun
# part (encoder and capture, while the thread's previous batch runs) and `vocode_flow_host_ms` the rest.
VOCODER_HOST_EVENTS = ("vocode_flow_host_ms", "flow_capture_ms", "vocode_begin_ms")
# The CUDA caching allocator's calls into the driver since the previous reading, one event each per
# flow/HiFT batch (`allocator_probe`): `cuda_malloc` (cudaMalloc calls), `cuda_free` (cudaFree calls,
# each a wait for the whole device) and `cuda_alloc_retry` (an allocation that failed, freed the
# cache and tried again: a device-wide wait too). Why: in the vocoder-only tail the GPU dipped to
# 12-48% busy at each batch's turnover while the other thread's batch was mid-way
# (bench/results/gpu_h200_worker23.json, raw utilisation against the log), and a device-wide wait
# there would stall both threads; these say whether the allocator is one.
# The pinned (host) allocator's too, where torch reports them: `pinned_alloc` (cudaHostAlloc calls: a
# copy to the host of a size the cache has no block for) and `pinned_alloc_us` (their time).
ALLOCATOR_EVENTS = {"cuda_malloc": "num_device_alloc", "cuda_free": "num_device_free", "cuda_alloc_retry": "num_alloc_retries"}
PINNED_EVENTS = {"pinned_alloc": "num_host_alloc", "pinned_alloc_us": "host_alloc_time.total"}
SUMMED_EVENTS = LLM_HOST_EVENTS + VOCODER_HOST_EVENTS + tuple(ALLOCATOR_EVENTS) + tuple(PINNED_EVENTS)  # totalled per job
# How long the launch of one tiny kernel held the LLM thread at each placement (count = microseconds),
# beside `llm_place_cpu_ms`, the thread's CPU time over the placement. Why: placements took 60-210 ms
# while the GIL was mostly free (bench/results/gpu_h100_s38_torch_gil.json). These readings settled it
# (gpu_h100_s39a_pgraphs.json): launches took ~100 us (the queue had room) and the CPU time was most of
# the wall time, a big refill's all of it: the thread was spinning in a wait for its own stream, three
# Python numbers assigned through a tensor index (torch_backend._Rows.fill). Note that a CUDA wait spins,
# so CPU time near the wall time means "working or waiting for the GPU", far below it "waiting for the
# GIL or sleeping".
LAUNCH_EVENT = "llm_launch_us"
# A flow batch that replayed a step graph kept for its shape, or captured one (flow.STEP_GRAPH_CACHE;
# count = the batch's rows as run): how often the cache pays, since a capture costs the host an eager
# step and a capture while the GPU may sit idle.
FLOW_GRAPH_EVENTS = ("flow_graph_hit", "flow_graph_capture")
GC1_MIN_MS = 2.0
GIL_PROBE_S = 0.005  # the probe's sleep (200 wake-ups a second)
GIL_WINDOW_S = 0.1  # one `gil` event per this long
_gc_started = 0.0
_probe: threading.Thread | None = None
_allocator_seen: dict[str, int] = {}
_allocator_lock = threading.Lock()  # both vocoder threads probe: one reading and its deltas at a time


def _on_gc(phase: str, info: dict) -> None:
    """gc.callbacks hook: a collection of generation 1 or 2 as an event with its pause in ms."""
    global _gc_started
    generation = info.get("generation", 0)
    if generation < 1:
        return
    if phase == "start":
        _gc_started = time.perf_counter()
        return
    ms = (time.perf_counter() - _gc_started) * 1000.0
    if generation == 2 or ms >= GC1_MIN_MS:
        event(f"gc{generation}", round(ms))


def _gil_probe() -> None:
    """Sleep GIL_PROBE_S over and over; every GIL_WINDOW_S log the mean oversleep in microseconds.
    Runs while the timeline is on (a few hundred GIL acquisitions a second, each a few microseconds)."""
    while log.isEnabledFor(logging.INFO):
        late, n, window_end = 0.0, 0, time.perf_counter() + GIL_WINDOW_S
        while (now := time.perf_counter()) < window_end:
            time.sleep(GIL_PROBE_S)
            late += time.perf_counter() - now - GIL_PROBE_S
            n += 1
        event("gil", round(1e6 * late / max(n, 1)))


def configure(enabled: bool) -> None:
    global _probe
    log.setLevel(logging.INFO if enabled else logging.WARNING)
    if enabled and _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
    elif not enabled and _on_gc in gc.callbacks:
        gc.callbacks.remove(_on_gc)
    if enabled and (_probe is None or not _probe.is_alive()):
        _probe = threading.Thread(target=_gil_probe, name="timeline-gil-probe", daemon=True)
        _probe.start()


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """This process's timeline lines while the block runs, as `read` takes them (the engine stage of
    the benchmark, which runs the engine in its own process). Events only: no GIL probe, no gc hook."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = _Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def event(name: str, count: int = 0) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("timeline %s %d %.6f", name, count, time.time())


def launch_probe(launch: Callable[[], object]) -> None:
    """LAUNCH_EVENT: how long `launch()` (one tiny kernel on the caller's stream) holds the calling
    thread; with the timeline off `launch` is not called at all."""
    if not log.isEnabledFor(logging.INFO):
        return
    began = time.perf_counter()
    launch()
    event(LAUNCH_EVENT, round(1e6 * (time.perf_counter() - began)))


def allocator_probe(device) -> None:
    """ALLOCATOR_EVENTS on `device` (a CUDA device) and PINNED_EVENTS, process-wide counts since the
    previous call (by any thread); nothing when the timeline is off or the device is not CUDA (or None)."""
    if not log.isEnabledFor(logging.INFO) or getattr(device, "type", None) != "cuda":
        return
    import torch  # the timeline itself runs without torch (the tone engine, the bench's parser)

    with _allocator_lock:  # else a thread's older reading could follow another's newer one: a negative count
        readings = [(ALLOCATOR_EVENTS, torch.cuda.memory_stats(device))]
        if hasattr(torch.cuda, "host_memory_stats"):  # torch 2.6 and later
            readings.append((PINNED_EVENTS, torch.cuda.host_memory_stats()))
        for events, stats in readings:
            for name, key in events.items():
                now = int(stats.get(key, 0))
                event(name, now - _allocator_seen.get(name, now))
                _allocator_seen[name] = now


def read(lines, start: float, end: float) -> list[tuple[float, str, int]]:
    """(seconds since `start`, event, count) of the timeline lines stamped within [start, end]."""
    out = []
    for line in lines:
        m = LINE.search(line.rstrip())
        if m and start <= float(m.group(3)) <= end:
            out.append((float(m.group(3)) - start, m.group(1), int(m.group(2))))
    return sorted(out, key=lambda e: e[0])  # stable: events of the same instant stay in log order


# Two flow/HiFT batches whose starts are this close count as starting together (`vocode_paired_starts`).
# Why: in a job's vocoder-only tail the two vocoder threads' batches ran side by side, ended together
# and so started together again, and every GPU dip there but the last followed such a pair: both
# threads doing a batch's host work (eager encoder, first step, capture) with nothing of theirs queued
# (bench/results/gpu_h200_worker19_worker.log, tasks of 256: 4 pairs within 0.1 s after the LLM's last
# row, 5 of 6 dips). Neither streaming.LAUNCH_LOCK nor PRIMARY_VOCODER_PRIORITY pulled them apart
# (bench/results/gpu_h100_worker20.json: 0-3 pairs a job with or without); kept as a reading.
PAIRED_START_S = 0.15


def summary(events: list[tuple[float, str, int]]) -> dict[str, float | int | None]:
    """First time of each event kind (seconds since the job's start), the last time the LLM ran out of
    work (`last_llm_done_s`: the job's vocoder-only tail starts there), how many of each, the garbage
    collections' pauses (total and longest, ms), the GIL probe's delays (mean, 90th percentile and
    the worst window, microseconds) and the vocoder batches' host share (their queueing time over
    their wall time, summed over the job's batches), how often two batches started together, the
    sizes of the batches started after the LLM's last row (the vocoder-only tail), the LLM thread's
    host time in total per kind, and its placements' one-launch probe (median and worst, us), and the
    vocoder threads' host phases and the allocators' driver calls in total (VOCODER_HOST_EVENTS,
    ALLOCATOR_EVENTS, PINNED_EVENTS)."""
    first = {name: next((round(t, 3) for t, e, _ in events if e == name), None) for name in EVENTS}
    done = [t for t, e, _ in events if e == "llm_done"]
    starts = [(t, n) for t, e, n in events if e == "vocode_start"]
    pauses = [n for _, e, n in events if e in GC_EVENTS]
    gil = sorted(n for _, e, n in events if e == "gil")
    launches = sorted(n for _, e, n in events if e == LAUNCH_EVENT)
    host = sum(n for _, e, n in events if e == "vocode_host_ms")
    wall = sum(n for _, e, n in events if e == "vocode_ms")
    return {**{f"first_{name}_s": t for name, t in first.items()},
            "last_llm_done_s": round(done[-1], 3) if done else None,  # from here on only flow/HiFT run
            **{f"{name}_events": sum(1 for _, e, _ in events if e == name) for name in EVENTS + GC_EVENTS + FLOW_GRAPH_EVENTS},
            "gc_pause_ms": sum(pauses), "gc_longest_ms": max(pauses, default=0),
            "gil_wait_us_mean": round(sum(gil) / len(gil)) if gil else None,
            "gil_wait_us_p90": gil[int(0.9 * (len(gil) - 1))] if gil else None,
            "gil_wait_us_max": gil[-1] if gil else None,
            "vocode_host_share_pct": round(100 * host / wall, 1) if wall else None,
            "vocode_paired_starts": sum(1 for (a, _), (b, _) in zip(starts, starts[1:]) if b - a <= PAIRED_START_S),
            "vocode_tail_batches": [n for t, n in starts if done and t >= done[-1]],
            "vocode_budget_last": next((n for _, e, n in reversed(events) if e == "vocode_budget"), None),
            **{f"{name}_total": sum(n for _, e, n in events if e == name) for name in SUMMED_EVENTS},
            "llm_launch_us_median": launches[len(launches) // 2] if launches else None,
            "llm_launch_us_max": launches[-1] if launches else None}
