"""One contract, two job stores: the Redis one (Lua scripts, real redis-server) and the in-memory one
`voxbatch render` uses must record, finish, cancel and re-open jobs the same way."""

from __future__ import annotations

import uuid

import pytest

from voxbatch.jobstate import JobStore, MemoryJobStore, RedisJobStore

pytestmark = pytest.mark.integration


@pytest.fixture(params=["redis", "memory"])
def store(request) -> JobStore:
    if request.param == "memory":
        return MemoryJobStore()
    return RedisJobStore.from_url(request.getfixturevalue("redis_server").url)


def new_job(store: JobStore, total: int) -> str:
    job_id = uuid.uuid4().hex[:12]
    store.create(job_id, "contract", "tone", "wav", total, 1.0)
    return job_id


def test_a_tasks_done_set_answers_is_done_for_each(store):
    """A task's done-set in one call (with the job's state): the same answers as `is_done` one by one,
    in the order asked."""
    job = new_job(store, 4)
    store.finish(job, "a", audio_s=1.0)
    store.finish(job, "c", error="boom")  # failed is not done
    ids = ["d", "a", "c", "b", "a"]
    assert store.state_and_done(job, ids)[1] == [store.is_done(job, s) for s in ids] == [False, True, False, False, True]
    assert store.state_and_done(job, [])[1] == []


def test_state_and_done_in_one_call(store):
    """The upload thread's check: the job's state and whether the segment is done, as `state` and
    `is_done` answer them; an unknown job has no state and nothing done."""
    job = new_job(store, 3)
    store.finish(job, "a", audio_s=1.0)
    store.finish(job, "b", error="boom")
    for seg in ("a", "b", "c"):
        assert store.state_and_done(job, [seg]) == (store.state(job), [store.is_done(job, seg)])
    assert store.state_and_done(job, ["a"]) == ("running", [True])
    store.cancel(job)
    assert store.state_and_done(job, ["c"]) == ("cancelled", [False])
    assert store.state_and_done("no-such-job", ["a"]) == (None, [False])


def test_finish_codes_and_counts(store):
    job = new_job(store, 3)
    assert store.state(job) == "queued"
    assert store.finish(job, "a", audio_s=1.5) == 0
    assert store.state(job) == "running"
    assert store.finish(job, "a", audio_s=1.5) == -2  # recorded once
    assert store.finish(job, "b", error="boom") == 0
    assert store.finish(job, "b", error="boom again") == -2
    assert store.finish(job, "c") == 1  # the last one elects the assembler, once
    s = store.status(job)
    assert (s.state, s.done, s.failed, s.audio_s, s.errors) == ("assembling", 2, 1, 1.5, {"b": "boom"})
    assert store.done_ids(job) == {"a", "c"} and store.failed(job) == {"b": "boom"}
    assert store.finish("no-such-job", "a") == -1


def test_a_failed_segment_stored_later_moves_from_failed_to_done(store):
    job = new_job(store, 2)
    store.finish(job, "a", error="boom")
    assert store.finish(job, "a") == 0
    s = store.status(job)
    assert (s.done, s.failed) == (1, 0) and store.failed(job) == {}


def test_attempts_and_errors(store):
    job = new_job(store, 1)
    assert [store.begin_attempt(job, "a") for _ in range(2)] == [1, 2]
    store.forget_attempt(job, "a")
    assert store.begin_attempts([(job, "a"), (job, "b")]) == [2, 1]
    assert store.last_error(job, "a") is None
    store.note_error(job, "a", "oops")
    assert store.last_error(job, "a") == "oops"


def test_cancel_then_reopen(store):
    job = new_job(store, 3)
    store.finish(job, "a")
    store.finish(job, "b", error="boom")
    store.begin_attempt(job, "b")
    assert store.cancel(job) == 1 and store.state(job) == "cancelled"
    assert store.cancel(job) == 0
    assert store.finish(job, "c") == -1  # nothing is recorded for a cancelled job
    assert store.cancel("no-such-job") == -1
    assert store.reopen(job, ["a", "b", "c"]) == 2  # the done one stays done
    s = store.status(job)
    assert (s.state, s.done, s.failed) == ("running", 1, 0)
    assert store.begin_attempt(job, "b") == 1  # fresh attempts
    assert store.finish(job, "b") == 0 and store.finish(job, "c") == 1


def test_reopen_of_an_assembling_job_lets_the_assembly_be_elected_again(store):
    job = new_job(store, 1)
    assert store.finish(job, "a", error="boom") == 1
    assert store.reopen(job, ["a"]) == 1
    assert store.finish(job, "a") == 1
    assert store.status(job).state == "assembling"
