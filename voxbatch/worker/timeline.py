"""Where a job's time goes inside the worker, as log lines a benchmark reads back (off by default).

With `settings.timeline_log` the logger `voxbatch.timeline` writes one INFO line per engine event:
segments admitted to the engine, an LLM decode session started or refilled, a flow/HiFT batch started
and finished. Each line ends in `timeline <event> <count> <unix time>`. The GPU benchmark's worker
stage reads them back from the worker's log and sets each job's first admission, first decode and
first audio beside its GPU utilisation samples: the GPU sat idle for the first 0.4-1.0 s of every
job (bench/results/gpu_h200_worker5.json), and these say which step of the start that was. A few lines
per batch, never one per decode step; when off, an event costs one level check.
"""

from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("voxbatch.timeline")
log.setLevel(logging.WARNING)  # off until `configure(True)`
LINE = re.compile(r"timeline (\w+) (\d+) ([0-9.]+)$")
EVENTS = ("admit", "llm_session", "llm_refill", "vocode_start", "vocode_end")


def configure(enabled: bool) -> None:
    log.setLevel(logging.INFO if enabled else logging.WARNING)


def event(name: str, count: int = 0) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("timeline %s %d %.6f", name, count, time.time())


def read(lines, start: float, end: float) -> list[tuple[float, str, int]]:
    """(seconds since `start`, event, count) of the timeline lines stamped within [start, end]."""
    out = []
    for line in lines:
        m = LINE.search(line.rstrip())
        if m and start <= float(m.group(3)) <= end:
            out.append((float(m.group(3)) - start, m.group(1), int(m.group(2))))
    return sorted(out, key=lambda e: e[0])  # stable: events of the same instant stay in log order


def summary(events: list[tuple[float, str, int]]) -> dict[str, float | int | None]:
    """First time of each event kind (seconds since the job's start), and how many of each."""
    first = {name: next((round(t, 3) for t, e, _ in events if e == name), None) for name in EVENTS}
    return {**{f"first_{name}_s": t for name, t in first.items()},
            **{f"{name}_events": sum(1 for _, e, _ in events if e == name) for name in EVENTS}}
