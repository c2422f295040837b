"""worker/metrics.py: the worker's metrics over real HTTP, and the load exporter against a real Redis.

The exporter is checked against the job-state module that maintains `vb:load` (RedisJobStore), so a
renamed key or a changed meaning fails here rather than silently flat-lining the autoscaler.
"""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from voxbatch.worker.metrics import LOAD_KEY, LoadCollector, Metrics, load_app, serve


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
        return resp.read().decode()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def redis_url(redis_server) -> str:
    """The session's real redis-server (tests/conftest.py), emptied for this test."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url


def test_worker_metrics_over_http():
    m = Metrics(worker="w1", gpu="0")
    server = m.serve(0, addr="127.0.0.1")
    try:
        m.batch_done(size=8, audio_s=20.0, wall_s=2.0)
        m.batch_done(size=3, audio_s=0.0, wall_s=0.5)  # no audio: no RTF sample, but the size counts
        for audio_s in (1.5, 2.5, 3.0):
            m.segment_stored(audio_s=audio_s, upload_s=0.02)
        m.segment_failed()
        got = _samples(_scrape(server.server_port))
    finally:
        server.shutdown()
    lab = (("gpu", "0"), ("worker", "w1"))
    assert got[("voxbatch_segments_rendered_total", lab)] == 3
    assert got[("voxbatch_audio_seconds_rendered_total", lab)] == pytest.approx(7.0)
    assert got[("voxbatch_segment_failures_total", lab)] == 1
    assert got[("voxbatch_synthesis_seconds_total", lab)] == pytest.approx(2.5)
    assert got[("voxbatch_batch_size_count", lab)] == 2
    assert got[("voxbatch_batch_size_sum", lab)] == 11
    assert got[("voxbatch_batch_real_time_factor_count", lab)] == 1
    assert got[("voxbatch_batch_real_time_factor_sum", lab)] == pytest.approx(0.1)
    # 0.1 falls in the 0.1 bucket and not in the 0.05 one.
    assert got[("voxbatch_batch_real_time_factor_bucket", (*lab[:1], ("le", "0.1"), lab[1]))] == 1
    assert got[("voxbatch_batch_real_time_factor_bucket", (*lab[:1], ("le", "0.05"), lab[1]))] == 0
    assert got[("voxbatch_upload_seconds_count", lab)] == 3


def test_instances_do_not_share_state():
    a, b = Metrics(), Metrics()
    a.segment_stored(1.0, 0.01)
    text_b = _samples(generate_latest(b.registry).decode())
    assert text_b[("voxbatch_segments_rendered_total", (("gpu", ""), ("worker", "")))] == 0
    shared = CollectorRegistry()
    Metrics(registry=shared, worker="x")
    with pytest.raises(ValueError, match="Duplicated"):
        Metrics(registry=shared, worker="y")  # one registry holds one process's metrics


def test_track_queues_reads_depth_at_scrape_time():
    m = Metrics(worker="w", gpu="1")
    intake, output = queue.Queue(), queue.Queue(maxsize=4)
    m.track_queues(intake, output)
    for i in range(7):
        intake.put(i)
    output.put("a")
    got = _samples(generate_latest(m.registry).decode())
    lab = (("gpu", "1"), ("worker", "w"))
    assert got[("voxbatch_intake_queue_depth", lab)] == 7
    assert got[("voxbatch_output_queue_depth", lab)] == 1


def test_gpu_memory_gauge_absent_without_cuda():
    """On a CPU box (torch imported, CUDA unavailable) the family exists with no samples, and
    collecting never initializes CUDA."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only behaviour")
    text = generate_latest(Metrics().registry).decode()
    assert "voxbatch_gpu_memory_allocated_bytes" in text
    assert not [k for k in _samples(text) if k[0] == "voxbatch_gpu_memory_allocated_bytes"]


def test_metrics_module_does_not_import_torch():
    code = "import sys, voxbatch.worker.metrics; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_load_exporter_reads_job_state_counter(redis_url):
    import redis

    from voxbatch.jobstate import RedisJobStore

    client = redis.Redis.from_url(redis_url)
    store = RedisJobStore.from_url(redis_url)
    store.create("job-a", "a", "default", "wav", total=10, created_at=time.time())
    store.create("job-b", "b", "default", "wav", total=5, created_at=time.time())
    store.finish("job-a", "s1", audio_s=1.0)
    store.finish("job-a", "s1", audio_s=1.0)  # a duplicate delivery must not count twice
    store.finish("job-b", "s9", error="boom")
    client.rpush("render", b"t1", b"t2")  # what LLEN sees: only tasks not yet taken by a worker

    assert client.get(LOAD_KEY) is not None, "the job-state module no longer maintains " + LOAD_KEY
    assert store.load() == 13
    server = serve(load_app(LoadCollector(client, render_queue="render")), 0, "127.0.0.1")
    try:
        port = server.server_port
        assert json.loads(_scrape(port, "/load")) == {"segments_outstanding": 13, "render_queue_length": 2}
        got = _samples(_scrape(port, "/metrics"))
        assert got[("voxbatch_segments_outstanding", ())] == 13
        assert got[("voxbatch_render_queue_length", ())] == 2
        assert got[("voxbatch_load_up", ())] == 1
        store.cancel("job-b")  # 4 left in job-b leave the load
        assert json.loads(_scrape(port, "/load"))["segments_outstanding"] == 9
        client.set(LOAD_KEY, -3)  # a drifted counter never reads as negative demand
        assert json.loads(_scrape(port, "/load"))["segments_outstanding"] == 0
    finally:
        server.shutdown()


def test_load_exporter_reports_redis_down_as_503():
    import redis

    dead = redis.Redis(port=_free_port(), socket_connect_timeout=0.5)
    server = serve(load_app(LoadCollector(dead)), 0, "127.0.0.1")
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            _scrape(server.server_port, "/load")
        assert err.value.code == 503
        # /metrics still answers, saying Redis is down, and /healthz (the liveness probe) stays up.
        got = _samples(_scrape(server.server_port, "/metrics"))
        assert got[("voxbatch_load_up", ())] == 0
        assert ("voxbatch_segments_outstanding", ()) not in got
        assert _scrape(server.server_port, "/healthz") == "ok\n"
    finally:
        server.shutdown()
