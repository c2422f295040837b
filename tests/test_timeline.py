"""The worker's timeline log (voxbatch/worker/timeline.py): off by default, one parseable line per event
when on, and read back per job window."""

from __future__ import annotations

import logging
import time

import pytest

from voxbatch.worker import timeline


def test_events_are_logged_only_when_configured_and_read_back_per_window(caplog):
    caplog.set_level(logging.INFO)  # what a worker's basicConfig(INFO) lets through for other loggers
    timeline.configure(False)
    timeline.event("admit", 3)
    assert not [r for r in caplog.records if r.name == "voxbatch.timeline"]
    timeline.configure(True)
    try:
        timeline.event("admit", 3)
        timeline.event("llm_session", 3)
        timeline.event("vocode_start", 2)
        timeline.event("vocode_end", 2)
    finally:
        timeline.configure(False)
    lines = [f"2026-12-02 00:00:00,000 INFO voxbatch.timeline: {r.getMessage()}" for r in caplog.records if r.name == "voxbatch.timeline"]
    assert len(lines) == 4
    t0 = float(lines[0].rsplit(" ", 1)[1])
    events = timeline.read(lines + ["unrelated line", "timeline admit x 1"], t0, t0 + 60)
    assert [(e, n) for _, e, n in events] == [("admit", 3), ("llm_session", 3), ("vocode_start", 2), ("vocode_end", 2)]
    s = timeline.summary(events)
    assert s["first_admit_s"] == 0.0 and s["admit_events"] == 1 and s["llm_refill_events"] == 0 and s["first_llm_refill_s"] is None
    assert s["first_vocode_end_s"] >= s["first_vocode_start_s"] >= s["first_llm_session_s"] >= 0
    assert timeline.read(lines, t0 + 3600, t0 + 7200) == []  # another job's window sees none of them


def test_full_collections_are_events_while_on(caplog):
    """With the timeline on, a full garbage collection logs `gc2 <ms>`; off, the hook is gone and logs
    nothing; the summary adds up the pauses."""
    import gc

    caplog.set_level(logging.INFO)
    timeline.configure(True)
    try:
        assert gc.callbacks.count(timeline._on_gc) == 1
        timeline.configure(True)  # idempotent
        assert gc.callbacks.count(timeline._on_gc) == 1
        gc.collect(2)
    finally:
        timeline.configure(False)
    assert timeline._on_gc not in gc.callbacks
    gc.collect(2)
    lines = [r.getMessage() for r in caplog.records if r.name == "voxbatch.timeline"]
    assert len([line for line in lines if line.startswith("timeline gc2 ")]) == 1, lines
    t0 = float(lines[0].rsplit(" ", 1)[1])
    events = timeline.read(lines, t0 - 1, t0 + 60)
    s = timeline.summary(events + [(0.5, "gc2", 120), (0.7, "gc1", 3)])
    (pause,) = [n for _, e, n in events if e == "gc2"]
    assert s["gc2_events"] == 2 and s["gc1_events"] >= 1
    assert s["gc_longest_ms"] == max(120, pause) and s["gc_pause_ms"] >= 123 + pause


def test_gil_probe_reports_how_late_a_waking_thread_gets_the_gil(caplog, monkeypatch):
    """While on, a probe thread logs `gil <us>` every window; a thread holding the GIL in pure Python
    for whole windows makes the probe wake late by about a switch interval, an idle process by far less.
    Off, the probe ends."""
    import sys
    import threading
    import time

    caplog.set_level(logging.INFO)
    monkeypatch.setattr(timeline, "GIL_WINDOW_S", 0.05)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    timeline.configure(True)
    try:
        time.sleep(0.3)  # idle: the probe wakes on time
        quiet_until = time.time()
        stop = threading.Event()

        def spin() -> None:  # pure Python: holds the GIL until a switch interval asks it to let go
            while not stop.is_set():
                sum(range(1000))

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.5)
        stop.set()
        spinner.join()
    finally:
        timeline.configure(False)
        sys.setswitchinterval(interval)
    time.sleep(0.15)
    assert timeline._probe is not None and not timeline._probe.is_alive()
    lines = [r.getMessage() for r in caplog.records if r.name == "voxbatch.timeline"]
    events = timeline.read(lines, 0, 2e9)
    idle = [n for t, e, n in events if e == "gil" and t < quiet_until]
    busy = [n for t, e, n in events if e == "gil" and t > quiet_until + 0.1]
    assert idle and busy, lines
    # the spinner keeps the GIL for up to a 5 ms interval each time the probe asks for it
    assert min(idle) < 2000 and sorted(busy)[len(busy) // 2] > 2000, (idle, busy)
    s = timeline.summary(events)
    assert s["gil_wait_us_max"] >= s["gil_wait_us_p90"] >= min(idle) and s["gil_wait_us_mean"] > 0


def test_vocoder_host_share_sums_queueing_over_wall_time():
    events = [(0.1, "vocode_host_ms", 30), (0.4, "vocode_ms", 300), (0.5, "vocode_host_ms", 90), (0.6, "vocode_ms", 100)]
    assert timeline.summary(events)["vocode_host_share_pct"] == 30.0
    assert timeline.summary([])["vocode_host_share_pct"] is None and timeline.summary([])["gil_wait_us_mean"] is None


def test_batches_starting_together_and_the_tail_batches_are_counted():
    """Two starts within PAIRED_START_S are a pair (one further apart is not); the tail's
    batches are those started at or after the LLM's last `llm_done`, earlier ones are not."""
    gap = timeline.PAIRED_START_S
    events = [(0.8, "vocode_start", 46), (1.5, "vocode_start", 1), (2.0, "llm_done", 0), (3.0, "llm_done", 0),
              (3.2, "vocode_start", 15), (4.0, "vocode_start", 40), (4.0 + gap / 2, "vocode_start", 19),
              (5.0, "vocode_start", 23), (5.0 + 0.9 * gap, "vocode_start", 11), (6.0 + 2 * gap, "vocode_start", 47)]
    s = timeline.summary(events)
    assert s["vocode_paired_starts"] == 2
    assert s["vocode_tail_batches"] == [15, 40, 19, 23, 11, 47]
    assert timeline.summary(events[:2])["vocode_tail_batches"] == []  # no llm_done: no tail known
    assert timeline.summary([])["vocode_paired_starts"] == 0


def test_llm_thread_host_time_is_summed_and_recorded_in_process():
    """`recording` hands back the lines of the events sent while it runs (no probe thread, off after),
    and the summary sums the LLM thread's admit and place times over the window."""
    timeline.configure(False)
    with timeline.recording() as lines:
        timeline.event("llm_admit_ms", 12)
        timeline.launch_probe(lambda: time.sleep(0.002))  # a launch that held the thread >= 2 ms
        timeline.event("llm_place_ms", 5)
        timeline.event("llm_place_cpu_ms", 3)
        timeline.event("llm_prefill_ms", 4)
        timeline.launch_probe(lambda: None)
        timeline.launch_probe(lambda: None)
        timeline.event("llm_admit_ms", 30)
    timeline.event("llm_admit_ms", 999)  # after the block: not recorded, not logged
    timeline.launch_probe(lambda: pytest.fail("the probe runs only while the timeline is on"))
    assert len(lines) == 8 and not timeline.log.isEnabledFor(logging.INFO)
    t0 = float(lines[0].rsplit(" ", 1)[1])
    s = timeline.summary(timeline.read(lines, t0, t0 + 60))
    assert s["llm_admit_ms_total"] == 42 and s["llm_place_ms_total"] == 5 and s["llm_prefill_ms_total"] == 4
    assert s["llm_place_cpu_ms_total"] == 3
    assert s["llm_launch_us_max"] >= 2000 > s["llm_launch_us_median"]  # the held launch is the worst of three
    assert timeline.summary([])["llm_admit_ms_total"] == 0 and timeline.summary([])["llm_launch_us_max"] is None


def test_vocoder_phases_and_allocator_calls_are_summed_and_the_probe_is_silent_off_cuda():
    """The summary totals the vocoder's host phases and each allocator event over the window; on a CPU
    device `allocator_probe` writes nothing, so a CPU worker's log holds no allocator lines."""
    events = [(0.1, "flow_capture_ms", 40), (0.1, "vocode_begin_ms", 70), (0.2, "vocode_flow_host_ms", 120), (0.2, "cuda_malloc", 3),
              (0.2, "cuda_free", 0), (0.8, "flow_capture_ms", 55), (0.9, "cuda_malloc", 2), (0.9, "cuda_alloc_retry", 1)]
    s = timeline.summary(events)
    assert (s["flow_capture_ms_total"], s["vocode_flow_host_ms_total"], s["vocode_begin_ms_total"]) == (95, 120, 70)
    assert (s["cuda_malloc_total"], s["cuda_free_total"], s["cuda_alloc_retry_total"]) == (5, 0, 1)
    assert s["pinned_alloc_total"] == 0
    assert timeline.summary([])["cuda_malloc_total"] == 0
    import torch

    with timeline.recording() as lines:
        timeline.allocator_probe(torch.device("cpu"))
    assert lines == []
