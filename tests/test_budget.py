"""The worker's in-flight budget in segments (voxbatch/worker/budget.py): task size stops mattering."""

from __future__ import annotations

import threading
import time

from voxbatch.settings import Settings
from voxbatch.worker.budget import SegmentBudget, inflight_segments, task_threads


def test_threads_follow_the_engine_rows_and_the_task_size():
    s = Settings(batch_size=16)
    assert inflight_segments(s, 256) == 512 and task_threads(s, 256) == 32
    assert task_threads(Settings(batch_size=64), 256) == 8
    assert task_threads(Settings(batch_size=64, task_concurrency=3), 256) == 3
    assert inflight_segments(Settings(worker_inflight_segments=100), 8) == 100


def _peak(budget: SegmentBudget, sizes: list[int]) -> int:
    peak, lock = 0, threading.Lock()

    def task(n: int) -> None:
        nonlocal peak
        with budget.hold(n):
            with lock:
                peak = max(peak, budget.used)
            time.sleep(0.02)

    threads = [threading.Thread(target=task, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    return peak


def test_segments_in_flight_never_exceed_the_budget_whatever_the_task_size():
    assert _peak(SegmentBudget(128), [64] * 8) == 128
    assert _peak(SegmentBudget(128), [16] * 24) == 128
    # A task larger than the whole budget runs alone instead of waiting forever.
    assert _peak(SegmentBudget(32), [100, 100]) == 100
