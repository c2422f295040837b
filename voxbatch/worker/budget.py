"""How much work one worker process holds, counted in segments rather than tasks.

The engine decodes its rows (`engine.max_batch`: `engine_max_batch`, or what the engine picked for
its device) and refills them as they finish, so it needs about that many segments waiting besides
the ones decoding: a worker holds `2 x rows` segments in flight unless `worker_inflight_segments`
says otherwise. Celery's thread pool counts tasks, so the worker runs enough threads for that many
segments in tasks of `batch_size`, and each render task takes its segments from a `SegmentBudget`
before handing them to the engine: tasks of 16 or of 64 segments keep the same number of segments in
flight, so the task size stops mattering to throughput.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from voxbatch.settings import Settings


def inflight_segments(settings: Settings, rows: int) -> int:
    """Segments one worker process holds at once (decoding + waiting in its intake); `rows` is the
    built engine's `max_batch`."""
    return settings.worker_inflight_segments or 2 * rows


def task_threads(settings: Settings, rows: int) -> int:
    """Celery threads: an explicit task_concurrency, else enough tasks of batch_size to fill the budget."""
    if settings.task_concurrency:
        return settings.task_concurrency
    return max(2, math.ceil(inflight_segments(settings, rows) / settings.batch_size))


class SegmentBudget:
    """A counting semaphore in segments. A task larger than the whole budget still runs, alone, so an
    odd task size cannot deadlock the worker."""

    def __init__(self, segments: int):
        self.capacity = segments
        self.used = 0
        self._cv = threading.Condition()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self._cv:
            self._cv.wait_for(lambda: self.used == 0 or self.used + n <= self.capacity)
            self.used += n
        try:
            yield
        finally:
            with self._cv:
                self.used -= n
                self._cv.notify_all()
