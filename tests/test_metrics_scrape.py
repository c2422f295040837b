"""Metrics scraped from real processes during a real render: a `voxbatch worker` (tone engine,
metrics port set) and the load exporter, against the session's Redis and SeaweedFS S3.

What it pins down:
- the worker's `voxbatch_segments_rendered_total` equals the segment objects actually stored, and the
  other series agree with it (batch sizes, uploads, audio seconds vs the job state);
- the autoscaling signal (`segments_outstanding` from `vb:load`) is non-zero while the worker is busy
  even when the Celery list is empty -- the blind spot of a queue-length scaler -- and returns to
  its starting value when the job's last segment lands.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from voxbatch.producer.submit import plan_job
from tests import corpora
from voxbatch import testing_services as services
from voxbatch.jobstate import RedisJobStore
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage
from voxbatch.worker.tone import tone_duration_s

pytestmark = pytest.mark.integration


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def _worker_samples(port: int) -> dict[str, float]:
    """Sample name -> value summed over label sets (one worker process: one label set, plus buckets)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(_get(f"http://127.0.0.1:{port}/metrics")):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture
def env(s3_env) -> dict[str, str]:
    tag = uuid.uuid4().hex[:8]
    return {
        **os.environ, **s3_env,
        "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
        "VOXBATCH_ENGINE": "tone", "VOXBATCH_TONE_RTF": "0.03", "VOXBATCH_BATCH_SIZE": "4",
        "VOXBATCH_TASK_CONCURRENCY": "2", "VOXBATCH_METRICS_PORT": str(services.free_port()),
        "VOXBATCH_VISIBILITY_TIMEOUT_S": "60", "VOXBATCH_UNACKED_RESTORE_INTERVAL_S": "1",
        "PYTHONUNBUFFERED": "1",
    }


def test_rendered_counter_matches_stored_objects_and_load_tracks_work(env, s3_env, tmp_path):
    settings = Settings(broker_url=s3_env["VOXBATCH_BROKER_URL"], storage_url=s3_env["VOXBATCH_STORAGE_URL"],
                        s3_endpoint=s3_env["VOXBATCH_S3_ENDPOINT"], aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"])
    storage = S3Storage(settings.storage_url, settings)
    jobs = RedisJobStore.from_url(settings.broker_url)
    metrics_port = int(env["VOXBATCH_METRICS_PORT"])
    exporter_port = services.free_port()

    # The worker exactly as the images run it (`voxbatch worker --gpus 0`); GPU 0 -> port + 0.
    worker = services.VoxbatchProcess(["worker", "--gpus", "0"], env, tmp_path / "worker.log").start()
    exporter = subprocess.Popen([sys.executable, "-m", "voxbatch.worker.metrics", "--port", str(exporter_port),
                                 "--addr", "127.0.0.1"], cwd=services.REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "exporter.log").open("wb"))
    try:
        worker.wait_ready()
        # The metrics port opens after warm-up, which is what the readiness probes rely on.
        services.wait_until(lambda: _worker_samples(metrics_port), 60, "worker /metrics")
        load = lambda: json.loads(_get(f"http://127.0.0.1:{exporter_port}/load"))  # noqa: E731
        load_before = services.wait_until(load, 30, "load exporter")["segments_outstanding"]
        assert _worker_samples(metrics_port)["voxbatch_segments_rendered_total"] == 0

        book = corpora.long_book(tmp_path / "book.txt", chapters=2, sentences=20)
        submit = subprocess.run([sys.executable, "-m", "voxbatch.cli", "submit", str(book), "--voice", "tone"],
                                cwd=services.REPO, env=env, capture_output=True, text=True, timeout=120)
        assert submit.returncode == 0, submit.stderr
        job_id = submit.stdout.strip().splitlines()[-1]
        total = jobs.status(job_id).total
        assert total >= 8

        rendered_seen: list[float] = []
        load_seen: list[tuple[int, int]] = []  # (segments outstanding above baseline, render list length)
        deadline = time.monotonic() + 180
        while True:
            s = jobs.status(job_id)
            rendered_seen.append(_worker_samples(metrics_port)["voxbatch_segments_rendered_total"])
            ld = load()
            load_seen.append((ld["segments_outstanding"] - load_before, ld["render_queue_length"]))
            if s.done + s.failed >= total:
                break
            assert time.monotonic() < deadline, f"job stuck at {s}:\n{worker.tail()}"
            time.sleep(0.1)

        final = _worker_samples(metrics_port)
        stored = storage.list(f"jobs/{job_id}/segments/")
        status = jobs.status(job_id)
    finally:
        exporter.terminate()
        exporter.wait(10)
        worker.stop()

    # The counter is the number of segment objects written, no more, no less.
    assert status.done == total and status.failed == 0
    assert len(stored) == total
    assert final["voxbatch_segments_rendered_total"] == len(stored)
    assert rendered_seen == sorted(rendered_seen) and rendered_seen[-1] <= total
    # Every stored segment went through exactly one engine batch and one upload.
    assert final["voxbatch_batch_size_sum"] == total
    assert 1 <= final["voxbatch_batch_size_count"] <= total
    assert final["voxbatch_upload_seconds_count"] == total
    assert final["voxbatch_segment_failures_total"] == 0
    # Audio seconds agree with the job state (stored as whole milliseconds per segment) and the text.
    spec_audio_s = sum(tone_duration_s(seg.text) for seg in plan_job(book, "tone", Settings(engine="tone")).segments)
    assert final["voxbatch_audio_seconds_rendered_total"] == pytest.approx(status.audio_s, abs=total * 1e-3)
    assert final["voxbatch_audio_seconds_rendered_total"] == pytest.approx(spec_audio_s, abs=total * 1e-3)
    # RTF: the tone engine sleeps 0.03 s per audio second, so each batch's RTF is at least that.
    assert final["voxbatch_batch_real_time_factor_count"] == final["voxbatch_batch_size_count"]
    assert final["voxbatch_batch_real_time_factor_sum"] >= 0.03 * final["voxbatch_batch_real_time_factor_count"]

    # The scaler's signal: the job's whole size right after submit, back to the baseline at the end,
    # and non-zero while the Celery list is already empty (tasks reserved/running on the worker).
    outstanding = [o for o, _ in load_seen]
    assert all(0 <= o <= total for o in outstanding), outstanding
    assert outstanding == sorted(outstanding, reverse=True), "the load only falls while one job renders"
    assert outstanding[0] > 0 and outstanding[-1] == 0
    assert any(o > 0 and queued == 0 for o, queued in load_seen), load_seen
    print(f"{total} segments; (outstanding, render list length) over the render: {load_seen}")
