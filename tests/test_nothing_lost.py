"""Nothing lost (issue 12), on real services and real `voxbatch worker` processes: hostile broker
messages, crafted tasks, a Redis that forgets everything, a sweeper that finds what nothing holds,
and a short visibility timeout that running tasks keep extending."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests import corpora
from tests.test_distributed import Cluster, assert_complete, cluster, segments_rendered, succeeded  # noqa: F401
from voxbatch import keys
from voxbatch import testing_services as services
from voxbatch.celery_app import RENDER_TASK, app, configure_celery
from voxbatch.jobstate import RedisJobStore
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage

pytestmark = pytest.mark.integration


def child_pid(launcher: services.VoxbatchProcess) -> int:
    return int(subprocess.run(["pgrep", "-P", str(launcher.proc.pid)], capture_output=True, text=True).stdout.split()[0])


def send(c: Cluster, *args, name: str = RENDER_TASK, **kwargs) -> str:
    configure_celery(Settings(broker_url=c.env["VOXBATCH_BROKER_URL"]))
    return app.send_task(name, args=list(args), kwargs=kwargs, queue=c.env["VOXBATCH_RENDER_QUEUE"]).id


def envelope(c: Cluster) -> dict:
    """A well-formed kombu envelope of a render message, taken off a queue nobody consumes."""
    spare = f"spare-{uuid.uuid4().hex[:6]}"
    configure_celery(Settings(broker_url=c.env["VOXBATCH_BROKER_URL"]))
    app.send_task(RENDER_TASK, args=[{}], queue=spare)
    return json.loads(c.jobs.r.rpop(spare))


def test_garbage_in_the_render_list_is_dropped_and_the_same_worker_completes_a_job(cluster, tmp_path):
    launcher = cluster.start("worker")
    cluster.start("assembler")
    pid = child_pid(launcher)
    queue = cluster.env["VOXBATCH_RENDER_QUEUE"]
    good = envelope(cluster)
    bad_body = {**good, "body": base64.b64encode(b"\x00not json").decode()}
    bad_base64 = {**good, "body": "%%% not base64 %%%"}
    pickled = {**good, "content-type": "application/x-python-serialize"}
    no_tag = {**good, "properties": {**good["properties"], "delivery_tag": None}}
    garbage = [b"not json at all", b"\xff\xfe\x00\x01", b"123", b'"a string"', b"[1, 2]", b"{}", b"null",
               json.dumps(bad_body), json.dumps(bad_base64), json.dumps(pickled), json.dumps(no_tag)]
    cluster.jobs.r.lpush(queue, *garbage)
    sent = [send(cluster, "just a string"), send(cluster), send(cluster, {"job_id": "../../voices"}),
            send(cluster, {}, {}), send(cluster, name="voxbatch.no-such-task")]
    services.wait_until(lambda: cluster.jobs.r.llen(queue) == 0, 60, "the garbage to be consumed")
    job_id = cluster.submit(corpora.write_txt(tmp_path / "book.txt"))
    status = cluster.wait_finished(job_id)
    assert status.state == "completed"
    assert_complete(cluster, job_id)
    assert child_pid(launcher) == pid, launcher.tail(4000)  # the same worker process throughout
    log = launcher.tail(10**7)
    for word in ("restarting", "Unrecoverable", "Traceback"):
        assert word not in log, log[max(0, log.find(word) - 3000):log.find(word) + 1500]
    assert log.count("dropped an undecodable broker message") + log.count("dropped a malformed broker message") >= 8
    assert log.count("discarded render message") >= 4 and all(t in log for t in sent[:4])
    assert cluster.unacked() == 0


def test_crafted_render_tasks_store_nothing_outside_their_job(cluster, tmp_path):
    cluster.start("worker")
    cluster.start("assembler")
    job_a = cluster.submit(corpora.write_txt(tmp_path / "a.txt"))
    job_b = cluster.submit(corpora.write_md(tmp_path / "b.md"))
    cluster.wait_finished(job_a)
    cluster.wait_finished(job_b)
    services.wait_until(lambda: cluster.storage.exists(keys.manifest(job_b)), 30, "job b's manifest")
    victim = cluster.spec(job_a).segments[0]
    before = {**cluster.last_modified(job_a), **cluster.last_modified(job_b)}
    status_a, status_b = cluster.jobs.status(job_a), cluster.jobs.status(job_b)
    everything = set(cluster.storage.list(""))
    seg = {"id": victim.id, "chapter": victim.chapter, "text": "EVIL " * 100, "seed": 1}
    base = {"job_id": job_a, "voice": "tone", "format": "wav", "params": {}}
    crafted = [
        {**base, "segments": [{**seg, "key": "voices/evil.safetensors"}]},
        {**base, "segments": [{**seg, "key": f"jobs/{job_b}/chapters/0000.wav"}]},
        {**base, "job_id": "../voices", "segments": [seg]},
        {**base, "job_id": job_b, "segments": [{**seg, "id": "0042-00000", "chapter": 42}]},
        {**base, "job_id": "nosuchjob", "segments": [seg]},
        {**base, "format": "flac", "voice": "narrator", "segments": [seg]},  # real ids: A's stored segment, skipped
    ]
    time.sleep(1.1)  # S3 LastModified has one-second resolution: a rewrite now would show
    ids = [send(cluster, p) for p in crafted]
    worker = cluster.procs[0]
    services.wait_until(lambda: succeeded(worker, ids), 60, "the crafted tasks to be handled")
    assert set(cluster.storage.list("")) == everything  # no new object anywhere (no voices/, no .flac)
    assert {**cluster.last_modified(job_a), **cluster.last_modified(job_b)} == before  # nothing rewritten
    assert (cluster.jobs.status(job_a), cluster.jobs.status(job_b)) == (status_a, status_b)
    assert f"job {job_a}: 1 of 1 segments ({victim.id}..{victim.id}) already stored" in worker.tail(10**7)
    assert worker.tail(10**7).count("discarded render message") == 5


@pytest.fixture
def own_redis(tmp_path):
    folder = tmp_path / "redis-own"
    folder.mkdir()
    server = services.start_redis(folder)
    yield server
    server.stop()


def test_redis_restarted_without_persistence_then_retry_completes_the_job(s3_env, own_redis, tmp_path):
    """Redis forgets the job mid-run (restarted empty). Workers keep storing what they render (a job
    missing from Redis is not cancelled); `status` points at `retry`; `retry` rebuilds the job from
    job.json and storage and renders only what is not stored."""
    env_s3 = {**s3_env, "VOXBATCH_BROKER_URL": own_redis.url}
    tag = uuid.uuid4().hex[:8]
    env = {**os.environ, **env_s3, "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
           "VOXBATCH_BATCH_SIZE": "4", "VOXBATCH_VISIBILITY_TIMEOUT_S": "12", "VOXBATCH_TASK_HEARTBEAT_S": "2",
           "VOXBATCH_UNACKED_RESTORE_INTERVAL_S": "1", "VOXBATCH_ENGINE": "tone", "PYTHONUNBUFFERED": "1"}
    settings = Settings(broker_url=own_redis.url, storage_url=s3_env["VOXBATCH_STORAGE_URL"],
                        s3_endpoint=s3_env["VOXBATCH_S3_ENDPOINT"], aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"])
    c = Cluster(env, tmp_path, S3Storage(settings.storage_url, settings), RedisJobStore.from_url(own_redis.url), [])
    port = services.free_port()
    try:
        c.start("worker", extra_env={"VOXBATCH_TONE_RTF": "0.02", "VOXBATCH_METRICS_PORT": str(port)})
        c.start("assembler")
        job_id = c.submit(corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=60))
        total = c.jobs.status(job_id).total
        services.wait_until(lambda: c.jobs.status(job_id).done >= total // 4, 90, "some progress")
        own_redis.restart(services.NO_PERSISTENCE)
        assert c.jobs.status(job_id) is None and c.jobs.r.llen(env["VOXBATCH_RENDER_QUEUE"]) == 0  # all forgotten
        time.sleep(3)  # the worker finishes what it holds: stored, though Redis cannot record it
        stored = set(c.storage.list(keys.segments_prefix(job_id)))
        assert 0 < len(stored) < total
        proc = c.cli("status", job_id, check=False)
        assert proc.returncode == 2 and f"voxbatch retry {job_id}" in " ".join(proc.stderr.split())
        out = c.cli("retry", job_id).stdout
        assert f"re-enqueued {total} segment" in out  # nothing recorded: all enqueued, the stored ones only recorded
        status = c.wait_finished(job_id)
        assert status.state == "completed" and status.done == total and status.failed == 0
        assert_complete(c, job_id)
        spec = c.spec(job_id)
        stored_ids = {s.id for s in spec.segments if keys.segment(job_id, s.chapter, s.index, "wav") in stored}
        attempts = c.attempts(job_id)
        assert not stored_ids & set(attempts)  # recorded from storage, never rendered again
        assert segments_rendered(port) <= total + 8  # at most what was in the engine at the restart, twice
    finally:
        for p in c.procs:
            p.stop()


def test_sweeper_re_enqueues_segments_nothing_holds(cluster, tmp_path):
    """Render messages vanish from the queue (as a Redis that lost its last second would lose them):
    the assembler's sweeper finds those segments neither done, failed, queued nor in flight, enqueues
    them again, and `status` says so."""
    cluster.env["VOXBATCH_SWEEP_INTERVAL_S"] = "1"
    job_id = cluster.submit(corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=40))
    queue = cluster.env["VOXBATCH_RENDER_QUEUE"]
    n_tasks = cluster.jobs.r.llen(queue)
    assert n_tasks >= 4
    cluster.jobs.r.ltrim(queue, 0, n_tasks - 3)  # the two oldest messages (the first to be consumed) are lost
    cluster.start("worker")
    cluster.start("assembler")
    status = cluster.wait_finished(job_id, timeout_s=120)
    assert status.state == "completed" and status.swept == 8  # two tasks of four segments
    assert_complete(cluster, job_id)
    assert "re-enqueued by sweeper" in cluster.cli("status", job_id).stdout


def test_a_running_task_outlives_a_short_visibility_timeout(cluster, tmp_path):
    """Tasks that run longer than the visibility timeout are not handed to another worker while
    their worker is alive (its heartbeat keeps them fresh), so nothing is rendered twice."""
    book = tmp_path / "book.txt"
    book.write_text("Chapter 1\n\n" + " ".join(f"Sentence number {i} is here." for i in range(8)) + "\n")
    cluster.env.update(VOXBATCH_VISIBILITY_TIMEOUT_S="10", VOXBATCH_TASK_HEARTBEAT_S="2", VOXBATCH_BATCH_SIZE="8")
    slow = {"VOXBATCH_TONE_RTF": "1.5", "VOXBATCH_ENGINE_MAX_BATCH": "1", "VOXBATCH_TASK_CONCURRENCY": "1"}
    port = services.free_port()
    worker = cluster.start("worker", extra_env={**slow, "VOXBATCH_METRICS_PORT": str(port)})
    cluster.start("worker", extra_env=slow)  # a second worker, idle unless something is redelivered
    cluster.start("assembler")
    job_id = cluster.submit(book)
    t0 = time.monotonic()
    status = cluster.wait_finished(job_id, timeout_s=180)
    assert status.state == "completed"
    spec = cluster.spec(job_id)
    assert set(cluster.attempts(job_id).values()) == {1}
    logs = "".join(p.tail(10**7) for p in cluster.procs)
    assert "already stored" not in logs
    assert time.monotonic() - t0 > 12, "the task must outlast the visibility timeout: make it longer"
    assert len(spec.segments) >= 1
