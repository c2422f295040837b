"""The distributed path end to end, on real services: voxbatch CLI → Redis → `voxbatch worker` processes
(tone engine) → SeaweedFS S3 → `voxbatch assembler`. No mocks: every process is a real subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests import corpora, services
from voxbatch import keys
from voxbatch.audio import decode
from voxbatch.jobstate import RedisJobStore
from voxbatch.models import JobSpec, Manifest
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage
from worker.tone import FAIL_MARKER, SAMPLE_RATE, tone_samples

pytestmark = pytest.mark.integration


@dataclass
class Cluster:
    env: dict[str, str]
    workdir: Path
    storage: S3Storage
    jobs: RedisJobStore
    procs: list[services.VoxbatchProcess]

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", *args], env=self.env, cwd=services.REPO,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"voxbatch {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def start(self, *args: str, extra_env: dict[str, str] | None = None, wait: bool = True):
        log = self.workdir / f"{args[0]}-{len(self.procs)}.log"
        p = services.VoxbatchProcess(list(args), {**self.env, **(extra_env or {})}, log).start()
        self.procs.append(p)
        if wait:
            p.wait_ready()
        return p

    def submit(self, path: Path, *extra: str) -> str:
        return self.cli("submit", str(path), "--voice", "tone", *extra).stdout.strip().splitlines()[-1]

    def wait_finished(self, job_id: str, timeout_s: float = 180):
        def finished():
            s = self.jobs.status(job_id)
            return s if s is not None and s.finished else None

        try:
            return services.wait_until(finished, timeout_s, f"job {job_id}", interval_s=0.3)
        except TimeoutError:
            logs = "\n".join(f"--- {p.log.name}\n{p.tail(2500)}" for p in self.procs)
            raise AssertionError(f"job {job_id} did not finish: {self.jobs.status(job_id)}\n{logs}") from None

    def manifest(self, job_id: str) -> Manifest:
        return Manifest.model_validate_json(self.storage.get(keys.manifest(job_id)))

    def spec(self, job_id: str) -> JobSpec:
        return JobSpec.model_validate_json(self.storage.get(keys.job_spec(job_id)))


@pytest.fixture
def cluster(s3_env, tmp_path):
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ, **s3_env,
        "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
        "VOXBATCH_BATCH_SIZE": "4", "VOXBATCH_VISIBILITY_TIMEOUT_S": "12",
        "VOXBATCH_UNACKED_RESTORE_INTERVAL_S": "1", "VOXBATCH_RETRY_BACKOFF_MS": "50",
        "VOXBATCH_ENGINE": "tone", "PYTHONUNBUFFERED": "1",
    }
    settings = Settings(**{k[len("VOXBATCH_"):].lower(): v for k, v in s3_env.items() if k.startswith("VOXBATCH_")},
                        aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"])
    c = Cluster(env, tmp_path, S3Storage(settings.storage_url, settings), RedisJobStore.from_url(settings.broker_url),
                [])
    yield c
    for p in c.procs:
        p.stop()


def assert_complete(c: Cluster, job_id: str) -> Manifest:
    """Every segment stored once under its key, with the tone engine's length; manifest consistent."""
    spec = c.spec(job_id)
    manifest = c.manifest(job_id)
    assert manifest.state == "completed", manifest.failed
    stored = [k for k in c.storage.list(f"jobs/{job_id}/segments/")]
    assert len(stored) == len(spec.segments) == len(set(stored))
    texts = {s.id: s.text for s in spec.segments}
    assert [m.id for m in manifest.segments] == [s.id for s in spec.segments]
    for m in manifest.segments:
        assert m.duration_s == pytest.approx(tone_samples(texts[m.id]) / SAMPLE_RATE, abs=1 / SAMPLE_RATE)
    for ch in manifest.chapters:
        audio, sr = decode(c.storage.get(ch.key), ch.key)
        assert sr == SAMPLE_RATE
        assert len(audio) / sr == pytest.approx(ch.duration_s, abs=1 / sr)
    return manifest


@pytest.mark.parametrize("kind", ["txt", "md", "epub"])
def test_three_chapter_book_renders_completely(cluster, tmp_path, kind):
    book = getattr(corpora, f"write_{kind}")(tmp_path / f"book.{kind}")
    cluster.start("worker")
    cluster.start("assembler")
    job_id = cluster.submit(book)
    status = cluster.wait_finished(job_id)
    assert status.state == "completed"
    manifest = assert_complete(cluster, job_id)
    assert all(c.title.endswith(t) for c, (t, _) in zip(manifest.chapters, corpora.CHAPTERS, strict=True))
    for ch in range(3):
        srt = cluster.storage.get(keys.subtitles(job_id, ch, "srt")).decode()
        assert "-->" in srt
    # status and fetch through the CLI
    out = cluster.cli("status", job_id).stdout
    assert "completed" in out
    dest = tmp_path / "fetched"
    cluster.cli("fetch", job_id, "--out", str(dest))
    assert json.loads((dest / "manifest.json").read_text())["job_id"] == job_id


def test_worker_killed_mid_job_is_restarted_and_job_completes(cluster, tmp_path):
    book = corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=60)
    # Slow the tone engine so the job is still running when we kill the worker.
    launcher = cluster.start("worker", "--gpus", "0", extra_env={"VOXBATCH_TONE_RTF": "0.02"})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    total = cluster.jobs.status(job_id).total
    services.wait_until(lambda: cluster.jobs.status(job_id).done >= total // 5, 60, "some progress")
    child = int(subprocess.run(["pgrep", "-P", str(launcher.proc.pid)], capture_output=True, text=True)
                .stdout.split()[0])
    os.kill(child, signal.SIGKILL)
    before = cluster.jobs.status(job_id).done
    assert before < total, "job finished before the kill: make it longer"
    status = cluster.wait_finished(job_id, timeout_s=240)
    assert status.state == "completed" and status.done == total and status.failed == 0
    assert "restarting" in launcher.tail(20000)
    assert_complete(cluster, job_id)


def test_task_delivered_twice_is_not_rendered_twice(cluster, tmp_path):
    from voxbatch.celery_app import configure_celery, send_render
    from producer.submit import render_tasks

    book = corpora.write_txt(tmp_path / "book.txt")
    cluster.start("worker")
    cluster.start("assembler")
    job_id = cluster.submit(book)
    cluster.wait_finished(job_id)
    spec = cluster.spec(job_id)
    before = {k: cluster.storage.client.head_object(Bucket=cluster.storage.bucket, Key=cluster.storage._key(k))["ETag"]
              for k in cluster.storage.list(f"jobs/{job_id}/segments/")}
    attempts_before = cluster.jobs.r.hgetall(f"vb:job:{{{job_id}}}:attempts")
    # Deliver every render task of the job a second time.
    settings = Settings(broker_url=cluster.env["VOXBATCH_BROKER_URL"], render_queue=cluster.env["VOXBATCH_RENDER_QUEUE"])
    configure_celery(settings)
    for task in render_tasks(spec, 4):
        send_render(task, settings.render_queue)
    services.wait_until(lambda: cluster.jobs.r.llen(settings.render_queue) == 0, 30, "queue drained")
    time.sleep(2)
    assert cluster.jobs.r.hgetall(f"vb:job:{{{job_id}}}:attempts") == attempts_before  # no new attempt
    after = {k: cluster.storage.client.head_object(Bucket=cluster.storage.bucket, Key=cluster.storage._key(k))["ETag"]
             for k in cluster.storage.list(f"jobs/{job_id}/segments/")}
    assert after == before
    status = cluster.jobs.status(job_id)
    assert status.state == "completed" and status.done == len(spec.segments)


def test_cancel_then_retry(cluster, tmp_path):
    book = corpora.long_book(tmp_path / "long.txt", chapters=3, sentences=60)
    cluster.start("worker", extra_env={"VOXBATCH_TONE_RTF": "0.02"})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    total = cluster.jobs.status(job_id).total
    services.wait_until(lambda: cluster.jobs.status(job_id).done >= 3, 60, "some progress")
    cluster.cli("cancel", job_id)
    assert cluster.jobs.status(job_id).state == "cancelled"
    time.sleep(3)  # in-flight segments may still land; nothing new starts
    done_after_cancel = cluster.jobs.status(job_id).done
    services.wait_until(lambda: cluster.jobs.r.llen(cluster.env["VOXBATCH_RENDER_QUEUE"]) == 0, 60, "queue drained")
    time.sleep(1)
    assert cluster.jobs.status(job_id).state == "cancelled"
    assert cluster.jobs.status(job_id).done < total
    # A segment whose upload raced the cancel may be stored uncounted; a retry counts it without re-rendering.
    stored = len(cluster.storage.list(f"jobs/{job_id}/segments/"))
    assert cluster.jobs.status(job_id).done <= stored < total
    assert not cluster.storage.exists(keys.manifest(job_id))
    out = cluster.cli("retry", job_id).stdout
    reenqueued = int(out.split("re-enqueued ")[1].split()[0])
    assert 0 < reenqueued <= total - done_after_cancel  # only what is missing
    status = cluster.wait_finished(job_id)
    assert status.state == "completed" and status.done == total
    assert_complete(cluster, job_id)


def test_failing_segment_is_retried_then_recorded_and_retry_reenqueues_only_it(cluster, tmp_path):
    book = tmp_path / "book.md"
    book.write_text(f"# One\n\nA fine sentence here.\n\n# Two\n\nThis one breaks {FAIL_MARKER} on purpose.\n\n"
                    "# Three\n\nAnd this one is fine again.\n", encoding="utf-8")
    cluster.start("worker", extra_env={"VOXBATCH_MAX_ATTEMPTS": "3"})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    status = cluster.wait_finished(job_id)
    assert status.state == "completed_with_errors" and status.failed == 1 and status.done == status.total - 1
    (bad_id, error), = status.errors.items()
    assert "asks the tone engine to fail" in error
    assert cluster.jobs.r.hget(f"vb:job:{{{job_id}}}:attempts", bad_id) == "3"
    manifest = cluster.manifest(job_id)
    assert manifest.state == "completed_with_errors" and bad_id in manifest.failed
    assert manifest.chapters[1].key is None and manifest.chapters[0].key is not None
    out = cluster.cli("retry", job_id).stdout
    assert "re-enqueued 1 segment" in out
    status = cluster.wait_finished(job_id)
    assert status.state == "completed_with_errors" and status.failed == 1


@pytest.mark.parametrize("content,expect", [
    (b"\x00\x01\x02binary\xff\xfe" * 100, "offset"),
    (b"", "empty"),
    (b"Chapter 1\n\n" + b"word " * 60_000 + b"\n", "huge line"),
    (b"Chapter 1\n\nok text\n\xff\xfe broken utf8\n", "offset"),
])
def test_bad_input_is_refused_and_stores_nothing(cluster, tmp_path, content, expect):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    jobs_before = cluster.jobs.r.zcard("vb:jobs")
    proc = cluster.cli("submit", str(bad), "--voice", "tone", check=False)
    assert proc.returncode == 2
    message = proc.stderr + proc.stdout
    assert "bad.txt" in message and expect in message.lower(), message
    assert "Traceback" not in message
    assert cluster.storage.list("") == []
    assert cluster.jobs.r.zcard("vb:jobs") == jobs_before
    assert services.S3_SECRET not in message


def test_unknown_voice_is_refused(cluster, tmp_path):
    book = corpora.write_txt(tmp_path / "book.txt")
    proc = cluster.cli("submit", str(book), "--voice", "nobody", check=False)
    assert proc.returncode == 2 and "voice 'nobody' not found" in proc.stderr
    assert cluster.storage.list("") == []


def test_embedded_render_matches_tone_lengths(tmp_path):
    """`voxbatch render`: the same pipeline in one process, local folder, no Redis."""
    book = corpora.write_md(tmp_path / "book.md")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXBATCH_")}
    proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", "render", str(book), "--out", str(out)], env=env,
                          cwd=services.REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (job_dir,) = (out / "jobs").iterdir()
    manifest = Manifest.model_validate_json((job_dir / "manifest.json").read_text())
    assert manifest.state == "completed" and len(manifest.chapters) == 3
    for ch in manifest.chapters:
        audio, sr = decode((out / ch.key).read_bytes())
        segs = [s for s in manifest.segments if s.chapter == ch.index]
        assert len(audio) / sr == pytest.approx(ch.duration_s, abs=1 / sr)
        assert ch.duration_s > sum(s.duration_s for s in segs)  # pauses between segments
        assert np.abs(audio).max() > 0.1


def test_worker_launcher_pins_one_process_per_gpu(cluster):
    launcher = cluster.start("worker", "--gpus", "0,1")
    services.wait_until(lambda: launcher.tail(20000).count(" ready.") >= 2, 120, "both GPU workers")
    log = launcher.tail(20000)
    assert "voxbatch-gpu0@" in log and "voxbatch-gpu1@" in log
    assert "worker for GPU 0: CUDA_VISIBLE_DEVICES=0" in log
    assert "worker for GPU 1: CUDA_VISIBLE_DEVICES=1" in log
