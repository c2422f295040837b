"""A torch-profiler trace of the worker's GPU over one job, reduced to where and why it sat idle
(a benchmark's diagnostic; off unless `settings.gpu_trace_dir` names a folder).

Why: nvidia-smi's utilisation says the GPU sat idle for a few tenths of a second several times in a
job (three ~0.2 s dips to 39-64% in the tasks-of-16 job of bench/results/gpu_h100_worker26.json) but
not who kept it waiting: a thread late to launch (which one, doing what), or queued work waiting on
another stream. A CUDA trace answers it per gap. The trace is taken in the worker process, since the
threads that feed the GPU live there; the benchmark drives it through files in the folder:

    <dir>/start     written by the bench just before it submits the job: tracing begins (~POLL_S)
    <dir>/stop      written once the job is done: tracing ends, the summary is written; it may hold
                    {"window_unix": [start, end]} (the job's own times) to summarise that span only
    <dir>/gpu_trace.json   the summary (`summarise`), written whole under its final name

Only the summary leaves the process: a job's raw trace holds ~1M kernels. The profiler's own cost
(CUPTI records every kernel, also inside CUDA graphs) slows the traced job, so its figures are for
attribution only, never a headline.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

START, STOP, SUMMARY = "start", "stop", "gpu_trace.json"
POLL_S = 0.02
GAP_MIN_US = 100.0  # idle stretches shorter than this are counted, not described
LARGEST = 25  # gaps described one by one, the longest first
SLOWEST_API = 15  # CUDA runtime calls listed one by one (and names totalled), the slowest first
# How long the benchmark lets a trace run before it submits the job: in the first trace
# (bench/results/gpu_h100_worker35.json, traced_job) the device's events began 2.1 s after the
# profiler started although decode and flow ran from ~0.3 s; the job's start was lost.
WARMUP_S = 3.0
# A trace whose `stop` never comes (the benchmark died) ends here: the profiler's buffers grow with
# every kernel (~1M a job), so the worker must not record without bound.
MAX_TRACE_S = 600.0
GAP_SIZES_US = ((100.0, "0.1-1 ms"), (1000.0, "1-10 ms"), (10000.0, ">= 10 ms"))


class Row(NamedTuple):
    """One trace event, reduced: `gpu` for kernels/copies/memsets on the device, `api` for CUDA runtime
    calls (launches, syncs) and `op` for the host's torch ops. `where` is the stream (gpu) or the
    thread's native id (api, op); `link` the CUDA correlation id tying a launch to its kernel (0: none)."""

    kind: str
    name: str
    start_us: float
    end_us: float
    where: int
    link: int


def _size(gap_us: float) -> str:
    label = "< 0.1 ms"
    for bound, name in GAP_SIZES_US:
        if gap_us >= bound:
            label = name
    return label


def _busy(gpu: list[Row]) -> list[tuple[float, float]]:
    """The union of the device's busy intervals, any stream."""
    merged: list[tuple[float, float]] = []
    for r in sorted(gpu, key=lambda r: r.start_us):
        if merged and r.start_us <= merged[-1][1]:
            if r.end_us > merged[-1][1]:
                merged[-1] = (merged[-1][0], r.end_us)
        else:
            merged.append((r.start_us, r.end_us))
    return merged


class _Outer:
    """Per thread, its outermost torch ops (an op inside another is dropped), to say what a thread was
    doing at an instant."""

    def __init__(self, ops: list[Row]):
        by_thread: dict[int, list[Row]] = defaultdict(list)
        for r in sorted(ops, key=lambda r: (r.start_us, -r.end_us)):
            kept = by_thread[r.where]
            if not kept or r.start_us >= kept[-1].end_us:
                kept.append(r)
        self.by_thread = {t: (rows, [r.start_us for r in rows]) for t, rows in by_thread.items()}

    def at(self, thread: int, t_us: float) -> str | None:
        rows, starts = self.by_thread.get(thread, ([], []))
        i = bisect.bisect_right(starts, t_us) - 1
        return rows[i].name if i >= 0 and rows[i].end_us > t_us else None


def _api_threads(api: list[Row], outer: _Outer, sample: int = 2000) -> dict[int, int]:
    """The thread id the CUDA runtime events carry -> the native id the torch ops carry, where they
    differ (CUPTI may report another id for the same thread): a launch happens inside one of its
    thread's torch ops, so each runtime id goes to the thread whose ops cover most of its launches."""
    by_id: dict[int, list[float]] = defaultdict(list)
    for r in api:
        if r.where not in outer.by_thread and len(by_id[r.where]) < sample:
            by_id[r.where].append(r.start_us)
    out = {}
    for rid, starts in by_id.items():
        votes = {t: sum(1 for t_us in starts if outer.at(t, t_us) is not None) for t in outer.by_thread}
        if votes and max(votes.values()) > 0:
            out[rid] = max(votes, key=votes.get)
    return out


def summarise(rows: list[Row], threads: dict[int, str], window_us: tuple[float, float]) -> dict:
    """Where the GPU sat idle within `window_us` (unix microseconds) and who kept it waiting.

    A gap is a stretch with nothing running on any stream. The work that ends it was launched by
    some thread: if that launch came after the gap began, the GPU waited on that thread (`host_late`,
    charged to the thread, with the torch op it was in and what every other thread was doing at the
    gap's start); otherwise the work was queued and waited on something else (another stream's event,
    a copy: `queued`)."""
    lo, hi = window_us
    gpu = [r for r in rows if r.kind == "gpu" and r.end_us > lo and r.start_us < hi]
    outer = _Outer([r for r in rows if r.kind == "op"])
    raw_api = [r for r in rows if r.kind == "api"]
    same = _api_threads(raw_api, outer)
    api_all = [r._replace(where=same[r.where]) if r.where in same else r for r in raw_api]  # the torch ops' thread ids
    launches = {r.link: r for r in api_all if r.link}
    name = lambda tid: threads.get(tid, f"thread {tid}")  # noqa: E731
    busy = _busy(gpu)
    clipped = [(max(a, lo), min(b, hi)) for a, b in busy]
    busy_us = sum(b - a for a, b in clipped if b > a)
    opening = {}  # busy interval start -> the gpu row that opens it
    for r in sorted(gpu, key=lambda r: r.start_us):
        opening.setdefault(r.start_us, r)
    gaps: list[tuple[float, float, Row | None]] = []  # (start, end, the work that ends it; None: the window's end)
    prev = lo
    for a, b in busy:
        if a > prev:
            gaps.append((prev, min(a, hi), opening[a] if a < hi else None))
        prev = max(prev, b)
    if prev < hi:
        gaps.append((prev, hi, None))
    by_size: dict[str, float] = defaultdict(float)
    by_cause: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    described = []
    for gap_start, gap_end, row in gaps:
        us = gap_end - gap_start
        by_size[_size(us)] += us
        launch = launches.get(row.link) if row is not None else None
        if row is None:
            cause = "nothing after it in the window"
        elif launch is None:
            cause = "unlinked"
        elif launch.start_us > gap_start:
            cause = f"host_late: {name(launch.where)}"
        else:
            cause = "queued"
        by_cause[cause] += us
        if launch is not None and cause.startswith("host_late"):
            # Which op each thread was late in, small gaps included: the eager work that is launch-bound.
            by_op[f"{name(launch.where)}: {outer.at(launch.where, launch.start_us) or launch.name}"] += us
        if us >= GAP_MIN_US:
            described.append({
                "at_s": round((gap_start - lo) / 1e6, 4), "unix": round(gap_start / 1e6, 4), "ms": round(us / 1e3, 3),
                "cause": cause, "ended_by": row.name[:120] if row else None, "stream": row.where if row else None,
                "launch": launch.name if launch else None,
                "launch_late_ms": round((launch.start_us - gap_start) / 1e3, 3) if launch else None,
                "launcher_op": outer.at(launch.where, launch.start_us) if launch else None,
                "threads_at_start": {name(t): op for t in sorted(outer.by_thread) if (op := outer.at(t, gap_start))},
            })
    described.sort(key=lambda g: -g["ms"])
    # The CUDA runtime calls of the window by name, and the slowest ones: a cudaMalloc/cudaFree or a
    # synchronize that holds a thread (and the allocator's lock) shows here, not as a launch.
    api = [r for r in api_all if r.end_us > lo and r.start_us < hi]
    by_api: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in api:
        by_api[r.name][0] += 1
        by_api[r.name][1] += r.end_us - r.start_us
    slowest = sorted(api, key=lambda r: r.start_us - r.end_us)[:SLOWEST_API]
    window = hi - lo
    return {
        "window_s": round(window / 1e6, 3),
        "gpu_busy_pct": round(100 * busy_us / window, 2) if window > 0 else None,
        "gpu_events": len(gpu), "launches": len(launches), "host_ops": sum(1 for r in rows if r.kind == "op"),
        "idle_ms": round((window - busy_us) / 1e3, 1),
        "idle_ms_by_gap_size": {k: round(v / 1e3, 1) for k, v in sorted(by_size.items())},
        "idle_ms_by_cause": {k: round(v / 1e3, 1) for k, v in sorted(by_cause.items(), key=lambda kv: -kv[1])},
        "host_late_ms_by_op": {k: round(v / 1e3, 1) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:SLOWEST_API]},
        "gaps_over_0.1ms": len(described),
        "largest_gaps": described[:LARGEST],
        "api_ms_by_name": {k: {"calls": int(n), "ms": round(us / 1e3, 1)}
                           for k, (n, us) in sorted(by_api.items(), key=lambda kv: -kv[1][1])[:SLOWEST_API]},
        "slowest_api_calls": [{"at_s": round((r.start_us - lo) / 1e6, 4), "ms": round((r.end_us - r.start_us) / 1e3, 3),
                               "name": r.name, "thread": name(r.where)} for r in slowest],
    }


def _rows(events) -> list[Row]:
    """The profiler's kineto events as Rows (no per-event Python objects kept beyond these)."""
    out = []
    for e in events:
        device = str(e.device_type())
        start, dur = e.start_ns() / 1e3, e.duration_ns() / 1e3
        if device.endswith("CUDA"):
            out.append(Row("gpu", e.name(), start, start + dur, e.device_resource_id(), e.correlation_id()))
        elif e.correlation_id() and e.name().startswith("cuda"):
            out.append(Row("api", e.name(), start, start + dur, e.device_resource_id(), e.correlation_id()))
        elif not e.is_user_annotation():
            out.append(Row("op", e.name(), start, start + dur, e.device_resource_id(), 0))
    return out


def _trace_once(folder: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        from torch._C._profiler import _ExperimentalConfig

        config = _ExperimentalConfig(profile_all_threads=True)  # the engine's threads, not only this one
    except TypeError:  # a torch without it: only this thread's ops, the GPU's events all the same
        config = None
    prof = profile(activities=activities, experimental_config=config)
    began = time.time()
    prof.start()
    deadline = time.monotonic() + MAX_TRACE_S
    while not (folder / STOP).exists() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    ended = time.time()
    prof.stop()
    try:
        window = json.loads((folder / STOP).read_text() or "{}").get("window_unix") or (began, ended)
    except (OSError, ValueError, AttributeError):  # no stop file (MAX_TRACE_S), or not the bench's JSON
        window = (began, ended)
    reduce_began = time.perf_counter()
    threads = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    rows = _rows(prof.profiler.kineto_results.events())
    summary = summarise(rows, threads, (float(window[0]) * 1e6, float(window[1]) * 1e6))
    gpu_starts = [r.start_us for r in rows if r.kind == "gpu"]
    # The device's clock as the trace gives it, beside the host's: a summary whose GPU events fall
    # outside the window would be misread as an idle GPU.
    summary.update(traced_unix=[round(began, 4), round(ended, 4)], window_unix=[float(window[0]), float(window[1])],
                   gpu_span_unix=[round(min(gpu_starts) / 1e6, 4), round(max(gpu_starts) / 1e6, 4)] if gpu_starts else None,
                   reduce_s=round(time.perf_counter() - reduce_began, 1))
    tmp = folder / (SUMMARY + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, folder / SUMMARY)


def _watch(folder: Path) -> None:
    while True:
        while not (folder / START).exists():
            time.sleep(POLL_S)
        (folder / START).unlink(missing_ok=True)
        try:
            _trace_once(folder)
        except Exception as e:  # noqa: BLE001 - a diagnostic: its failure is reported, the worker goes on
            log.exception("GPU trace failed")
            (folder / SUMMARY).write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        (folder / STOP).unlink(missing_ok=True)


def watch(folder: str | os.PathLike) -> threading.Thread:
    """Trace the GPU between each `start` and `stop` file the benchmark writes into `folder`."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    thread = threading.Thread(target=_watch, args=(path,), name="gpu-trace", daemon=True)
    thread.start()
    return thread
