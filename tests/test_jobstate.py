"""Job state's Lua scripts against a real redis-server: the finish race, cancel and re-open.

"Exactly one assemble per job" rests on `_FINISH` being one atomic step. These tests make many
clients finish a job's last segments at the same instant (a barrier), through the same calls the
workers make, and count what lands on a real `assemble` queue.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections import Counter

import numpy as np
import pytest

from voxbatch.audio import encode
from voxbatch.celery_app import ASSEMBLE_TASK, configure_celery, send_assemble
from voxbatch.jobstate import RedisJobStore
from voxbatch import keys
from voxbatch.models import RenderTask, SynthesisParams, TaskSegment, segment_id
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage
from voxbatch.worker.pipeline import Pipeline
from voxbatch.worker.tone import SAMPLE_RATE, ToneEngine

pytestmark = pytest.mark.integration

ROUNDS = 8  # jobs raced one after another; each round is a fresh chance for a lost or double assemble
RACERS = 24  # clients finishing the last segments of a job at once


@pytest.fixture
def jobs(redis_server) -> RedisJobStore:
    return RedisJobStore.from_url(redis_server.url)


def new_job(jobs: RedisJobStore, total: int) -> str:
    job_id = uuid.uuid4().hex
    jobs.create(job_id, "race", "tone", "wav", total, 0.0)
    return job_id


def race(n: int, fn) -> list:
    """Run fn(i) for i < n on n threads released together; returns the results in order."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(10)
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def assemble_messages(jobs: RedisJobStore, queue: str) -> list[str]:
    """Job ids of the `voxbatch.assemble` messages waiting in a Celery queue, oldest first (kombu
    LPUSHes and consumers pop from the right)."""
    out = []
    for raw in reversed(jobs.r.lrange(queue, 0, -1)):
        msg = json.loads(raw)
        assert msg["headers"]["task"] == ASSEMBLE_TASK
        args, _kwargs, _embed = json.loads(base64.b64decode(msg["body"]))
        out.append(args[0])
    return out


def test_concurrent_last_finishes_report_exactly_one_completion(jobs):
    """Every segment finished twice, all at once: one caller gets 1, the duplicates get -2."""
    load_before = jobs.load()
    for _ in range(ROUNDS):
        job_id = new_job(jobs, RACERS // 2)
        codes = race(RACERS, lambda i: jobs.finish(job_id, f"s{i % (RACERS // 2)}", audio_s=0.5))
        assert Counter(codes) == {1: 1, 0: RACERS // 2 - 1, -2: RACERS // 2}
        status = jobs.status(job_id)
        assert status.state == "assembling" and status.done == RACERS // 2 and status.failed == 0
        assert status.audio_s == pytest.approx(0.5 * RACERS // 2)
    assert jobs.load() == load_before  # each segment left the load counter once


def test_concurrent_last_finishes_through_worker_pipelines_enqueue_one_assemble(jobs, redis_server, tmp_path):
    """Four worker pipelines (own Redis clients) get redeliveries of a job's last segments at once.

    The segments are already in storage, as after a crash between upload and record, so each
    `submit` records its segment through the pipeline's one finishing path, which sends the
    assemble task to a real Celery queue in Redis exactly as `voxbatch worker` wires it.
    """
    settings = Settings(broker_url=redis_server.url, assemble_queue=f"assemble-{uuid.uuid4().hex[:8]}")
    configure_celery(settings)
    storage = LocalStorage(tmp_path)
    pipelines = [Pipeline(ToneEngine(), storage, RedisJobStore.from_url(redis_server.url), settings,
                          on_job_complete=lambda job_id: send_assemble(job_id, settings.assemble_queue))
                 for _ in range(4)]
    wav = encode(np.zeros(SAMPLE_RATE // 10, dtype=np.float32), SAMPLE_RATE, "wav")
    finished_jobs = []
    for _ in range(ROUNDS):
        job_id = new_job(jobs, RACERS + 2)
        jobs.finish(job_id, "early-0")
        jobs.finish(job_id, "early-1", error="failed for good")
        tasks = []
        for i in range(RACERS):
            seg = TaskSegment(id=segment_id(0, i), chapter=0, text="x", seed=i)
            storage.put(keys.segment(job_id, 0, i, "wav"), wav)
            tasks.append(RenderTask(job_id=job_id, voice="tone", format="wav", params=SynthesisParams(),
                                    segments=[seg]))
        handles = race(RACERS, lambda i: pipelines[i % 4].submit(tasks[i]))
        assert all(h.wait(10) and h.skipped == 1 for h in handles)
        status = jobs.status(job_id)
        assert (status.state, status.done, status.failed) == ("assembling", RACERS + 1, 1)
        assert status.audio_s == pytest.approx(0.1 * RACERS)
        finished_jobs.append(job_id)
    assert assemble_messages(jobs, settings.assemble_queue) == finished_jobs  # one each, in order


def test_cancel_stops_recording_and_releases_the_load(jobs):
    load_before = jobs.load()
    job_id = new_job(jobs, 10)
    assert [jobs.finish(job_id, f"s{i}") for i in range(3)] == [0, 0, 0]
    assert jobs.finish(job_id, "s3", error="boom") == 0
    assert jobs.load() == load_before + 6
    assert jobs.cancel(job_id) == 1
    assert jobs.load() == load_before  # the 6 outstanding segments left the load
    assert jobs.finish(job_id, "s4") == -1  # a segment landing after the cancel is not counted
    status = jobs.status(job_id)
    assert (status.state, status.done, status.failed) == ("cancelled", 3, 1)
    assert jobs.cancel(job_id) == 0  # idempotent
    assert jobs.load() == load_before


def test_reopen_after_cancel_counts_only_what_is_missing_and_assembles_once(jobs):
    load_before = jobs.load()
    job_id = new_job(jobs, 10)
    for i in range(3):
        jobs.finish(job_id, f"s{i}")
    jobs.begin_attempt(job_id, "s3")
    jobs.note_error(job_id, "s3", "boom")
    jobs.finish(job_id, "s3", error="boom")
    jobs.cancel(job_id)
    # `voxbatch retry` re-opens failed and missing segments; s0 is stored and must stay counted.
    assert jobs.reopen(job_id, ["s0", *(f"s{i}" for i in range(3, 10))]) == 7
    status = jobs.status(job_id)
    assert (status.state, status.done, status.failed, status.errors) == ("running", 3, 0, {})
    assert jobs.r.hget(jobs._k(job_id), "assemble") == "0"
    assert jobs.r.hget(jobs._k(job_id, "attempts"), "s3") is None and jobs.last_error(job_id, "s3") is None
    assert jobs.load() == load_before + 7
    codes = race(7, lambda i: jobs.finish(job_id, f"s{i + 3}"))
    assert Counter(codes) == {1: 1, 0: 6}
    assert jobs.load() == load_before


def test_reopen_after_assembly_lets_the_retried_segment_assemble_again(jobs):
    job_id = new_job(jobs, 3)
    assert jobs.finish(job_id, "a") == 0
    assert jobs.finish(job_id, "b", error="boom") == 0
    assert jobs.finish(job_id, "c") == 1
    assert jobs.finish(job_id, "b", error="boom again") == -2  # a duplicate failure is not counted
    jobs.set_state(job_id, "completed_with_errors")  # what the assembler records
    assert jobs.reopen(job_id, ["b"]) == 1
    assert jobs.status(job_id).state == "running"
    assert jobs.finish(job_id, "b") == 1  # the retry's own assembly
    assert jobs.finish(job_id, "b") == -2
    status = jobs.status(job_id)
    assert (status.state, status.done, status.failed) == ("assembling", 3, 0)


def test_unknown_job_is_refused_by_every_script(jobs):
    assert jobs.finish("no-such-job", "s0") == -1
    assert jobs.cancel("no-such-job") == -1
    assert jobs.reopen("no-such-job", ["s0"]) == -1


def test_begin_attempts_counts_each_pair_in_one_round_trip(jobs):
    """The engine thread counts a whole batch's attempts in one pipelined round trip."""
    a, b = f"ja-{uuid.uuid4().hex[:8]}", f"jb-{uuid.uuid4().hex[:8]}"
    jobs.create(a, "a", "tone", "wav", 2, 0.0)
    jobs.create(b, "b", "tone", "wav", 1, 0.0)
    assert jobs.begin_attempts([(a, "s1"), (a, "s2"), (b, "s1")]) == [1, 1, 1]
    assert jobs.begin_attempts([(a, "s1"), (b, "s1")]) == [2, 2]
    assert jobs.begin_attempts([]) == []
    assert jobs.begin_attempt(a, "s2") == 2
