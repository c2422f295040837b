"""The worker's GPU trace summary (voxbatch/worker/gpu_trace.py): idle gaps found from the device's
events and charged to the thread that launched the work ending them, or to queued work."""

from voxbatch.worker.gpu_trace import Row, summarise

MS = 1000.0  # microseconds


def test_gaps_are_charged_to_the_late_launcher_or_to_queued_work():
    rows = [
        # kernels on two streams: busy 0-10 ms (overlapping), idle 10-14, busy 14-20, idle 20-21, busy 21-30
        Row("gpu", "flow_gemm", 0 * MS, 8 * MS, 7, 1),
        Row("gpu", "decode_attn", 5 * MS, 10 * MS, 9, 2),
        Row("gpu", "hift_conv", 14 * MS, 20 * MS, 7, 3),
        Row("gpu", "decode_mlp", 21 * MS, 30 * MS, 9, 4),
        # launches: 3 came 2 ms after the GPU ran dry (the vocoder thread was late), 4 was queued at 1 ms
        Row("api", "cudaLaunchKernel", 0.1 * MS, 0.2 * MS, 101, 1),
        Row("api", "cudaLaunchKernel", 0.3 * MS, 0.4 * MS, 102, 2),
        Row("api", "cudaGraphLaunch", 12 * MS, 12.1 * MS, 101, 3),
        Row("api", "cudaLaunchKernel", 1 * MS, 1.1 * MS, 102, 4),
        # what the threads were doing: the vocoder in an outer op with an inner one, the LLM in another
        Row("op", "aten::index_select", 9 * MS, 12.5 * MS, 101, 0),
        Row("op", "aten::empty", 9.5 * MS, 9.6 * MS, 101, 0),
        Row("op", "aten::copy_", 9.9 * MS, 10.5 * MS, 102, 0),
    ]
    s = summarise(rows, {101: "flow-hift-0", 102: "engine"}, (0.0, 30 * MS))
    assert s["gpu_busy_pct"] == round(100 * 25 / 30, 2)
    assert s["idle_ms"] == 5.0
    assert s["idle_ms_by_cause"] == {"host_late: flow-hift-0": 4.0, "queued": 1.0}
    assert s["idle_ms_by_gap_size"] == {"1-10 ms": 5.0}
    first, second = s["largest_gaps"]
    assert (first["at_s"], first["ms"], first["ended_by"], first["launch_late_ms"]) == (0.01, 4.0, "hift_conv", 2.0)
    assert first["launcher_op"] == "aten::index_select"  # the outermost op, not the one nested in it
    assert first["threads_at_start"] == {"flow-hift-0": "aten::index_select", "engine": "aten::copy_"}
    assert (second["ms"], second["cause"], second["ended_by"]) == (1.0, "queued", "decode_mlp")
    assert s["host_late_ms_by_op"] == {"flow-hift-0: aten::index_select": 4.0}


def test_the_window_clips_the_trace_and_an_idle_end_is_its_own_cause():
    rows = [Row("gpu", "k", -5 * MS, 2 * MS, 7, 1), Row("gpu", "k2", 50 * MS, 60 * MS, 7, 2)]
    s = summarise(rows, {}, (0.0, 10 * MS))
    assert s["gpu_busy_pct"] == 20.0
    assert s["idle_ms_by_cause"] == {"nothing after it in the window": 8.0}
    assert s["gpu_events"] == 1  # k2 starts after the window


def test_an_empty_trace_is_all_idle():
    s = summarise([], {}, (0.0, 3 * MS))
    assert s["gpu_busy_pct"] == 0.0 and s["largest_gaps"][0]["ms"] == 3.0


def test_runtime_events_under_another_thread_id_are_charged_to_the_thread_whose_ops_hold_them():
    rows = [Row("gpu", "k1", 0, 1 * MS, 7, 1), Row("gpu", "k2", 3 * MS, 4 * MS, 7, 2),
            Row("api", "cudaLaunchKernel", 2 * MS, 2.1 * MS, 555, 2),  # CUPTI's id for thread 101
            Row("op", "aten::mm", 1.9 * MS, 2.2 * MS, 101, 0)]
    s = summarise(rows, {101: "engine"}, (0.0, 4 * MS))
    assert s["idle_ms_by_cause"] == {"host_late: engine": 2.0}


def test_runtime_calls_are_totalled_by_name_and_the_slowest_listed():
    rows = [Row("gpu", "k", 0, 1 * MS, 7, 1),
            Row("api", "cudaLaunchKernel", 0.1 * MS, 0.105 * MS, 101, 1),
            Row("api", "cudaMalloc", 2 * MS, 42 * MS, 101, 2),
            Row("api", "cudaMalloc", 50 * MS, 51 * MS, 101, 3)]
    s = summarise(rows, {101: "flow-hift-1"}, (0.0, 60 * MS))
    assert s["api_ms_by_name"]["cudaMalloc"] == {"calls": 2, "ms": 41.0}
    assert list(s["api_ms_by_name"]) == ["cudaMalloc", "cudaLaunchKernel"]
    assert s["slowest_api_calls"][0] == {"at_s": 0.002, "ms": 40.0, "name": "cudaMalloc", "thread": "flow-hift-1"}
