"""Render messages are untrusted: what a worker accepts, and what it makes of what it accepts."""

from __future__ import annotations

import pytest

from voxbatch.models import JobSpec, Segment, SynthesisParams
from voxbatch.producer.submit import render_tasks, store_spec
from voxbatch.storage import LocalStorage
from voxbatch.worker.messages import Discard, SpecCache, parse, resolve


def spec() -> JobSpec:
    segs = [Segment(chapter=c, index=i, text=f"Chapter {c} sentence {i}.") for c in range(2) for i in range(3)]
    return JobSpec(id="abc123", name="n", voice="tone", format="wav", chapters=["a", "b"], segments=segs,
                   created_at=0.0, source="-")


@pytest.fixture
def specs(tmp_path) -> SpecCache:
    storage = LocalStorage(tmp_path)
    store_spec(storage, spec())
    return SpecCache(storage)


def payload(**changes) -> dict:
    task = next(render_tasks(spec(), 4)).model_dump(mode="json")
    task.update(changes)
    return task


@pytest.mark.parametrize("args,kwargs,why", [
    ((), {}, "expected one JSON object"),
    (("a string",), {}, "expected one JSON object"),
    ((payload(), payload()), {}, "expected one JSON object"),
    ((payload(),), {"x": 1}, "keyword"),
    (({"job_id": "abc123"},), {}, "invalid render task"),
    ((payload(job_id="../voices"),), {}, "job_id"),
    ((payload(job_id="a/b"),), {}, "job_id"),
    ((payload(segments=[{"id": "0000-00000", "chapter": 0, "text": "x", "seed": 1, "key": "voices/x"}]),), {},
     "segments.0.key"),
    ((payload(segments=[{"id": "0000-00000", "chapter": 1, "text": "x", "seed": 1}]),), {}, "not in chapter 1"),
    ((payload(segments=[{"id": "../../x", "chapter": 0, "text": "x", "seed": 1}]),), {}, "segments.0.id"),
    ((payload(segments=[{"id": "0000-00000", "chapter": 0, "text": "x" * 20_001, "seed": 1}]),), {}, "text"),
    ((payload(segments=[{"id": "0000-00000", "chapter": 0, "text": "x", "seed": "1; DROP"}]),), {}, "seed"),
])
def test_malformed_messages_are_discarded_with_a_reason(args, kwargs, why):
    with pytest.raises(Discard, match=why.replace("(", r"\(")):
        parse(args, kwargs)


def test_tasks_of_unknown_jobs_or_segments_are_discarded(specs):
    with pytest.raises(Discard, match="no spec"):
        resolve(parse((payload(job_id="nosuchjob"),), {}), specs)
    foreign = payload(segments=[{"id": "0007-00000", "chapter": 7, "text": "x", "seed": 1}])
    with pytest.raises(Discard, match="none of its 1 segment id"):
        resolve(parse((foreign,), {}), specs)


def test_the_worker_renders_what_the_spec_says_not_what_the_message_says(specs):
    crafted = payload(voice="someone-else", format="flac", params={"speed": 3.0},
                      segments=[{"id": "0001-00002", "chapter": 1, "text": "x" * 5000, "seed": 7},
                                {"id": "0009-00001", "chapter": 9, "text": "y", "seed": 8}])
    task = resolve(parse((crafted,), {}), specs)
    assert (task.voice, task.format, task.params) == ("tone", "wav", SynthesisParams())
    (seg,) = task.segments
    assert (seg.id, seg.text, seg.seed) == ("0001-00002", "Chapter 1 sentence 2.", spec().seed_of(spec().segments[5]))


def test_tasks_arriving_together_read_the_spec_once(tmp_path):
    """A worker's task threads all start on a new job at once: one of them reads and parses the spec,
    the others wait for it, so a long book's spec is not parsed once per thread."""
    import threading

    class CountingStorage(LocalStorage):
        def __init__(self, root):
            super().__init__(root)
            self.reads = 0

        def get(self, key):
            self.reads += 1
            threading.Event().wait(0.05)  # a slow store: the other threads arrive while it reads
            return super().get(key)

    storage = CountingStorage(tmp_path)
    store_spec(storage, spec())
    cache = SpecCache(storage)
    start = threading.Barrier(16)
    got = []

    def task() -> None:
        start.wait()
        got.append(cache.get("abc123"))

    threads = [threading.Thread(target=task) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert storage.reads == 1
    assert len(got) == 16 and all(g is got[0] for g in got)
    with pytest.raises(Discard):  # a missing spec still fails each caller, and is not cached
        cache.get("nothere")
