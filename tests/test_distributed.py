"""The distributed path end to end, on real services: voxbatch CLI → Redis → `voxbatch worker` processes
(tone engine) → SeaweedFS S3 → `voxbatch assembler`. No mocks: every process is a real subprocess.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests import corpora, fake_mps
from voxbatch import testing_services as services
from voxbatch import keys
from voxbatch.audio import decode
from voxbatch.jobstate import RedisJobStore
from voxbatch.models import JobSpec, Manifest
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage
from voxbatch.worker.tone import CRASH_MARKER, FAIL_MARKER, SAMPLE_RATE, tone_samples

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

    def attempts(self, job_id: str) -> dict[str, int]:
        return {k: int(v) for k, v in self.jobs.r.hgetall(f"vb:job:{{{job_id}}}:attempts").items()}

    def last_modified(self, job_id: str) -> dict[str, object]:
        """Every object of a job (segments, chapters, manifest, ...) -> its S3 LastModified."""
        s3 = self.storage
        return {k: s3.client.head_object(Bucket=s3.bucket, Key=s3._key(k))["LastModified"]
                for k in s3.list(f"jobs/{job_id}/")}

    def resend(self, tasks) -> list[str]:
        """Deliver render tasks again, as the broker would after a lost ack; returns the task ids."""
        from voxbatch.celery_app import configure_celery, send_render

        settings = Settings(broker_url=self.env["VOXBATCH_BROKER_URL"], render_queue=self.env["VOXBATCH_RENDER_QUEUE"])
        configure_celery(settings)
        return [send_render(task, settings.render_queue) for task in tasks]

    def unacked(self) -> int:
        """Render messages of this cluster's queue that a worker holds unacknowledged (kombu's hash)."""
        queue = self.env["VOXBATCH_RENDER_QUEUE"]
        return sum(json.loads(v)[2] == queue for v in self.jobs.r.hvals("unacked"))


def succeeded(worker: services.VoxbatchProcess, task_ids: list[str]) -> bool:
    """Every task id has Celery's "succeeded" line in the worker's log (it ran, returned and acked)."""
    log = worker.tail(10**7)
    return all(f"voxbatch.render[{t}] succeeded" in log for t in task_ids)


def segments_rendered(port: int) -> float:
    """The worker's Prometheus counter of segment objects written (one per render + store)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return float(re.search(r"^voxbatch_segments_rendered_total\{.*\} (\S+)$", text, re.M).group(1))


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
    """Every render task of a finished job delivered again: each is consumed, skips all its segments
    (the worker logs it), acks, and nothing is rendered, written or assembled a second time."""
    from voxbatch.producer.submit import render_tasks

    book = corpora.write_txt(tmp_path / "book.txt")
    port = services.free_port()
    worker = cluster.start("worker", extra_env={"VOXBATCH_METRICS_PORT": str(port)})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    cluster.wait_finished(job_id)
    spec = cluster.spec(job_id)
    services.wait_until(lambda: cluster.storage.exists(keys.manifest(job_id)), 30, "manifest")
    assert segments_rendered(port) == len(spec.segments)  # the counter sees renders
    objects_before, attempts_before = cluster.last_modified(job_id), cluster.attempts(job_id)
    tasks = list(render_tasks(spec, 4))
    time.sleep(1.1)  # S3 LastModified has one-second resolution: a rewrite now would show
    task_ids = cluster.resend(tasks)
    services.wait_until(lambda: succeeded(worker, task_ids), 60, "the redelivered tasks to run and ack")
    log = worker.tail(10**7)
    for task in tasks:
        n = len(task.segments)
        assert f"job {job_id}: {n} of {n} segments ({task.segments[0].id}..{task.segments[-1].id}) already" in log
    assert segments_rendered(port) == len(spec.segments)  # no second render
    assert cluster.attempts(job_id) == attempts_before  # no new attempt started
    assert cluster.last_modified(job_id) == objects_before  # nothing rewritten, no second assembly
    assert cluster.unacked() == 0 and cluster.jobs.r.llen(cluster.env["VOXBATCH_RENDER_QUEUE"]) == 0
    status = cluster.jobs.status(job_id)
    assert status.state == "completed" and status.done == len(spec.segments)


def test_task_delivered_twice_while_the_job_runs_is_not_rendered_twice(cluster, tmp_path):
    """Duplicates of the first finished tasks arrive while the rest of the job is still rendering."""
    from voxbatch.producer.submit import render_tasks

    book = corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=60)
    port = services.free_port()
    # The rest of the job must still be rendering when the duplicates (skipped, not rendered) have run.
    # The worker takes every task at once (a budget of 256 segments) and its engine renders 4 segments
    # at a time, slowly: the duplicates are received and skipped at once, with most of the job's
    # batches still to render. (With the tone engine's 64-segment batches the job sometimes ended first
    # on a busy CI machine, at a tone RTF of 0.03 and again at 0.08.)
    worker = cluster.start("worker", extra_env={"VOXBATCH_METRICS_PORT": str(port), "VOXBATCH_TONE_RTF": "0.08",
                                                "VOXBATCH_ENGINE_MAX_BATCH": "4", "VOXBATCH_WORKER_INFLIGHT_SEGMENTS": "256"})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    spec = cluster.spec(job_id)
    tasks = list(render_tasks(spec, 4))
    assert len(tasks) >= 8, "the job must outlast the duplicates: make it longer"
    first = tasks[:2]
    ids = {seg.id for t in first for seg in t.segments}
    services.wait_until(lambda: ids <= cluster.jobs.done_ids(job_id), 60, "the first two tasks stored")
    task_ids = cluster.resend(first)
    services.wait_until(lambda: succeeded(worker, task_ids), 60, "the duplicates to run and ack")
    status = cluster.jobs.status(job_id)
    assert status.state == "running" and status.done < status.total, "the job ended first: make it longer"
    status = cluster.wait_finished(job_id)
    assert status.state == "completed"
    log = worker.tail(10**7)
    for task in first:
        assert f"job {job_id}: 4 of 4 segments ({task.segments[0].id}..{task.segments[-1].id}) already" in log
    assert segments_rendered(port) == len(spec.segments)  # every segment rendered exactly once
    assert set(cluster.attempts(job_id).values()) == {1}
    assert_complete(cluster, job_id)


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
    launcher = cluster.start("worker", extra_env={"VOXBATCH_MAX_ATTEMPTS": "3"})
    cluster.start("assembler")
    job_id = cluster.submit(book)
    status = cluster.wait_finished(job_id)
    assert status.state == "completed_with_errors" and status.failed == 1 and status.done == status.total - 1, (status.errors, launcher.tail(4000))
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


def test_segment_that_crashes_its_worker_is_given_up_after_max_attempts(cluster, tmp_path):
    """A poison segment SIGKILLs every worker that renders it. The launcher restarts the worker, the
    broker redelivers the task (visibility timeout), and the Redis attempt counter ends the loop:
    after max_attempts crashes the segment is recorded failed and the rest of the job completes.

    Segments travel four to a task and render four to an engine batch, so the first crash takes the
    poison segment's three batch-mates down too. Their next attempt, like the poison one's, renders alone (an attempt
    that left no error died with its worker), and an attempt counts only once the engine takes the
    segment: later crashes cost the batch-mates nothing, and none of them is given up."""
    max_attempts = 2
    book = tmp_path / "book.md"
    book.write_text(f"# One\n\nA fine sentence here.\n\n# Two\n\nThis one crashes {CRASH_MARKER} the worker.\n\n"
                    "# Three\n\nAnd this one is fine again.\n\n# Four\n\nThe last one is fine too.\n",
                    encoding="utf-8")
    cluster.env.update(VOXBATCH_BATCH_SIZE="4", VOXBATCH_TASK_CONCURRENCY="1", VOXBATCH_VISIBILITY_TIMEOUT_S="10",
                       VOXBATCH_MAX_ATTEMPTS=str(max_attempts))
    launcher = cluster.start("worker")
    cluster.start("assembler")
    job_id = cluster.submit(book)
    spec = cluster.spec(job_id)
    bad = next(s for s in spec.segments if CRASH_MARKER in s.text)
    status = cluster.wait_finished(job_id, timeout_s=120)
    assert status.state == "completed_with_errors" and status.failed == 1 and status.done == status.total - 1, (status.errors, launcher.tail(4000))
    assert list(status.errors) == [bad.id]
    assert f"gave up after {max_attempts} attempts: worker lost while rendering" in status.errors[bad.id]
    attempts = cluster.attempts(job_id)
    assert attempts[bad.id] == max_attempts
    assert all(attempts[s.id] <= max_attempts for s in spec.segments)
    task_of_bad = [s for s in spec.segments][spec.segments.index(bad) // 4 * 4:][:4]
    assert len(task_of_bad) == 4 and bad in task_of_bad  # three innocents shared the crashing batch
    manifest = cluster.manifest(job_id)
    assert manifest.state == "completed_with_errors" and bad.id in manifest.failed
    stored = set(cluster.storage.list(f"jobs/{job_id}/segments/"))
    assert stored == {keys.segment(job_id, s.chapter, s.index, spec.format) for s in spec.segments if s is not bad}
    # Bounded: one crash and one restart per attempt, then the worker stays up and the queue is empty.
    time.sleep(3)
    log = launcher.tail(10**7)
    assert log.count(f"segment {bad.id} asks for a crash") == max_attempts
    assert log.count("restarting in") == max_attempts
    # Each crashing worker left a helper process (as vLLM's engine core outlives its worker): the launcher
    # killed it before starting the next worker, so none of them still runs.
    helpers = [int(pid) for pid in re.findall(r"asks for a crash; helper pid (\d+);", log)]
    assert len(helpers) == max_attempts
    assert not [pid for pid in helpers if services.process_running(pid)], log[-4000:]
    assert launcher.proc.poll() is None and subprocess.run(["pgrep", "-P", str(launcher.proc.pid)]).returncode == 0
    assert cluster.unacked() == 0 and cluster.jobs.r.llen(cluster.env["VOXBATCH_RENDER_QUEUE"]) == 0


def test_sigterm_finishes_in_flight_work_within_the_window_then_hands_back_the_rest(cluster, tmp_path):
    """SIGTERM to `voxbatch worker` mid-job, with more work in flight than the shutdown window
    (min(60 s, visibility timeout) = 12 s here) can finish: the worker keeps storing segments during
    the window, then hands its unfinished tasks back to the queue at once (nothing left unacked to
    wait out a visibility timeout), and exits. A new worker completes the job; segments that were
    only queued in the old worker did not use up an attempt."""
    from voxbatch.celery_app import shutdown_window_s

    window_s = shutdown_window_s(Settings(visibility_timeout_s=int(cluster.env["VOXBATCH_VISIBILITY_TIMEOUT_S"])))
    book = corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=60)
    # ~1.8 s per segment, engine batches of 2: 4 tasks x 4 segments in flight is ~30 s of work.
    slow = {"VOXBATCH_TONE_RTF": "0.1", "VOXBATCH_ENGINE_MAX_BATCH": "2",
            "VOXBATCH_TASK_CONCURRENCY": "4", "VOXBATCH_WORKER_INFLIGHT_SEGMENTS": "16"}  # 4 tasks x 4 segments
    old = cluster.start("worker", "--gpus", "0", extra_env=slow)
    cluster.start("assembler")
    job_id = cluster.submit(book)
    total = cluster.jobs.status(job_id).total
    services.wait_until(lambda: cluster.jobs.status(job_id).done >= 2, 60, "some progress")
    t0 = time.monotonic()
    os.kill(old.proc.pid, signal.SIGTERM)
    done_at_term = cluster.jobs.status(job_id).done
    old.proc.wait(window_s + 15)
    exited_s = time.monotonic() - t0
    assert window_s - 1 <= exited_s <= window_s + 12, exited_s
    log = old.tail(10**7)
    handed_back = int(re.search(r"shutdown window over: (\d+) unfinished render task", log).group(1))
    assert handed_back >= 1
    done_at_exit = cluster.jobs.status(job_id).done
    assert done_at_term < done_at_exit < total  # kept storing during the window, then stopped
    assert cluster.unacked() == 0  # handed back, not left for the visibility timeout
    assert cluster.jobs.r.llen(cluster.env["VOXBATCH_RENDER_QUEUE"]) >= handed_back
    new = cluster.start("worker")
    status = cluster.wait_finished(job_id, timeout_s=120)
    assert status.state == "completed" and status.done == total and status.failed == 0
    assert_complete(cluster, job_id)
    attempts = cluster.attempts(job_id)
    assert set(attempts) == {s.id for s in cluster.spec(job_id).segments} and max(attempts.values()) <= 2
    assert sum(attempts.values()) <= total + int(slow["VOXBATCH_ENGINE_MAX_BATCH"])  # only the engine's batch twice
    # An idle worker exits at once on SIGTERM: the window bounds in-flight work, it is not a delay.
    t0 = time.monotonic()
    os.kill(new.proc.pid, signal.SIGTERM)
    assert new.proc.wait(10) == 0 and time.monotonic() - t0 < 5


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
    # A closed terminal (SIGHUP to the launcher): each worker leads a session of its own, so the launcher
    # stops them itself, and nothing of theirs keeps running.
    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(launcher.proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
    assert len(children) == 2
    os.kill(launcher.proc.pid, signal.SIGHUP)
    assert launcher.proc.wait(30) == 0
    assert not [pid for pid in children if services.process_running(pid)]


def test_workers_stop_when_their_launcher_is_killed(cluster):
    """A launcher killed outright (SIGKILL: an OOM kill, a supervisor's timeout) cannot pass anything on,
    and its workers lead sessions of their own: each is told by the kernel and shuts down as on SIGTERM
    instead of rendering on, holding its GPU, beside the next launcher's workers."""
    launcher = cluster.start("worker", "--gpus", "0,1")
    services.wait_until(lambda: launcher.tail(20000).count(" ready.") >= 2, 120, "both GPU workers")
    children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(launcher.proc.pid)], capture_output=True,
                                                   text=True).stdout.split()]
    assert len(children) == 2
    launcher.proc.kill()  # the launcher only, not its workers' process groups
    launcher.proc.wait(10)
    services.wait_until(lambda: not [pid for pid in children if services.process_running(pid)], 60, "the workers to exit")
    assert launcher.tail(20000).count("Warm shutdown") == 2  # each stopped as on SIGTERM, not killed


def test_worker_launcher_serves_its_workers_from_an_mps_daemon_of_its_own(cluster, tmp_path):
    bin_dir, record = fake_mps.install(tmp_path)
    env = {"VOXBATCH_CUDA_MPS": "true", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1"}
    launcher = cluster.start("worker", "--gpus", "0,1", extra_env=env)
    services.wait_until(lambda: launcher.tail(20000).count(" ready.") >= 2, 120, "both GPU workers")
    started = record.read_text().splitlines()
    assert len(started) == 1 and started[0].startswith("args=-d ")
    fields = dict(f.split("=", 1) for f in started[0].split(" ") if "=" in f)
    assert fields["visible"] == "unset"  # the daemon sees every GPU; each worker's pinning picks its own
    pipe = Path(fields["pipe"])
    assert pipe.is_dir() and Path(fields["log"]).is_dir() and pipe.parent == Path(fields["log"]).parent
    log = launcher.tail(20000)  # each worker (and so its vLLM core) is the daemon's client, pinned to its GPU
    for gpu in ("0", "1"):
        assert f"worker for GPU {gpu}: CUDA_VISIBLE_DEVICES={gpu}, CUDA MPS pipe {pipe}" in log
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(30) == 0
    calls = record.read_text().splitlines()
    assert len(calls) == 2 and calls[1].startswith("args= ") and calls[1].endswith("stdin=quit")
    assert not pipe.parent.exists()  # its folders go with it


def test_worker_with_mps_on_and_no_mps_daemon_binary_is_refused_in_one_line(cluster, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", "worker", "--gpus", "0"], cwd=services.REPO,
                          env={**cluster.env, "VOXBATCH_CUDA_MPS": "true", "PATH": str(empty)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nvidia-cuda-mps-control is not on PATH" in proc.stderr
    assert "Traceback" not in proc.stderr
