"""The CosyVoice2 engine's streaming `serve` (worker/cosyvoice2/streaming.py) on the tiny fixture, CPU.

What is checked: rows are refilled from the intake while others still decode (continuous batching
across tasks) and every segment sounds as it does rendered alone; a solo request renders with nothing
else in flight; an LLM failure re-renders what was in flight one at a time; a bad voice fails only its
segment; a blocked `emit` (full output queue) stops the intake from being taken.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import numpy as np
import pytest
import torch

from tests.test_cosyvoice2_engine import BATCH_ATOL, TEXTS, exact_bound, req, speech_tokens, storage_dir, voice  # noqa: F401
from voxbatch.models import SynthesisParams
from voxbatch.settings import Settings
from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine
from voxbatch.worker.engine import SynthesisRequest

MAX_BATCH = 4


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, storage_dir) -> CosyVoice2Engine:  # noqa: F811
    settings = Settings(engine="cosyvoice2", model_dir=str(tiny_model_dir), storage_url=storage_dir.as_uri(),
                        engine_max_batch=MAX_BATCH, engine_flow_batch=2)
    return CosyVoice2Engine.from_settings(settings)


class Recorder:
    """serve()'s callbacks, recording the order of admits and emits."""

    def __init__(self, block: threading.Event | None = None):
        self.events: list[tuple[str, str]] = []
        self.results = {}
        self.block = block
        self.lock = threading.Lock()

    def admit(self, batch):
        with self.lock:
            self.events += [("admit", r.segment_id) for r in batch]
        return batch

    def emit(self, result):
        if self.block is not None:
            self.block.wait()
        with self.lock:
            self.events.append(("emit", result.request.segment_id))
            self.results[result.request.segment_id] = result


def serve(engine, requests, rec: Recorder, close: bool = True) -> tuple[threading.Thread, queue.Queue]:
    intake: queue.Queue = queue.Queue()
    for r in requests:
        intake.put(r)
    if close:
        intake.put(None)
    t = threading.Thread(target=engine.serve, args=(intake, rec.emit, threading.Event(), None, rec.admit), daemon=True)
    t.start()
    return t, intake


def serve_to_the_end(engine, requests, monkeypatch) -> Recorder:
    """serve() until the intake ends, the patches undone after; every request came back, one result each."""
    rec = Recorder()
    t, _ = serve(engine, requests, rec)
    t.join(120)
    assert not t.is_alive()
    monkeypatch.undo()
    assert sorted(rec.results) == sorted(r.segment_id for r in requests)
    return rec


def mixed(engine, n: int, start: int = 0) -> list[SynthesisRequest]:
    wants = [4, 20, 8, 30, 6, 12]
    return [req(start + i, TEXTS[i % len(TEXTS)], exact_bound(engine, TEXTS[i % len(TEXTS)], wants[i % len(wants)]))
            for i in range(n)]


@pytest.fixture(params=["one_batch", "lookahead", "pipeline"])
def lookahead(request, monkeypatch) -> str:
    """The Pipeline contract holds with a vocoder thread's batch of look-ahead (VOCODER_LOOKAHEAD) and
    with its next batch begun while the current one's steps run (VOCODER_PIPELINE) too."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "VOCODER_LOOKAHEAD", request.param == "lookahead")
    monkeypatch.setattr(streaming, "VOCODER_PIPELINE", request.param == "pipeline")
    return request.param


def alone(engine, r) -> np.ndarray:
    (res,) = list(engine.synthesize([r]))
    return res.audio


@pytest.mark.parametrize("vocoders", [1, 2])
def test_rows_refill_across_tasks_and_each_segment_sounds_as_alone(engine, monkeypatch, vocoders, lookahead):
    """Also with two flow/HiFT threads (streaming.VOCODER_THREADS, here on a CPU): every segment
    once, as alone."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", vocoders)
    started = []
    real_start = streaming._Vocoder.start
    monkeypatch.setattr(streaming._Vocoder, "start", lambda self: (started.append(len(self.threads)), real_start(self)))
    batch = mixed(engine, 10)
    rec = Recorder()
    t, _ = serve(engine, batch, rec)
    t.join(120)
    assert not t.is_alive()
    assert sorted(rec.results) == sorted(r.segment_id for r in batch)
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)
    # Continuous: some request was admitted after an earlier one was emitted while a third, admitted
    # before that emit, was still decoding (its rows were refilled, not drained first).
    admitted_at = {sid: i for i, (kind, sid) in enumerate(rec.events) if kind == "admit"}
    emitted_at = {sid: i for i, (kind, sid) in enumerate(rec.events) if kind == "emit"}
    first_emit = min(emitted_at.values())
    late = [sid for sid, i in admitted_at.items() if i > first_emit]
    assert late, rec.events
    assert any(admitted_at[s] < first_emit and emitted_at[s] > min(admitted_at[x] for x in late) for s in admitted_at)
    assert len(admitted_at) == len(batch)  # every request admitted exactly once
    assert started == [vocoders]


def test_solo_request_renders_with_nothing_else_in_flight(engine, lookahead):
    batch = mixed(engine, 3) + [SynthesisRequest("solo", TEXTS[0], "v1", 5, SynthesisParams(max_tokens=8), solo=True)] + mixed(engine, 3, start=10)
    rec = Recorder()
    t, _ = serve(engine, batch, rec)
    t.join(120)
    assert not t.is_alive() and len(rec.results) == 7
    i = rec.events.index(("admit", "solo"))
    j = rec.events.index(("emit", "solo"))
    before = {sid for kind, sid in rec.events[:i] if kind == "admit"}
    assert before and before == {sid for kind, sid in rec.events[:i] if kind == "emit"}  # all out before it starts
    assert all(kind == "emit" for kind, _ in rec.events[i + 1 : j]) is True and rec.events[i + 1 : j] == []


def serve_with_a_failing_llm(engine, monkeypatch, batch: list, error: Exception, failures: int) -> list[int]:
    """`batch` served with an LLM whose first `failures` streams raise `error` after their first row;
    every segment must come out as it sounds alone. The sizes of the renders alone (`_run`) it took."""
    real, real_run = type(engine.llm).stream, CosyVoice2Engine._run
    calls, alone_runs = {"n": 0}, []

    def flaky(self, feed):
        calls["n"] += 1
        it = real(self, feed)
        yield next(it)
        if calls["n"] <= failures:
            raise error
        yield from it

    def run(self, items):
        alone_runs.append(len(items))
        return real_run(self, items)

    monkeypatch.setattr(type(engine.llm), "stream", flaky)
    monkeypatch.setattr(CosyVoice2Engine, "_run", run)
    rec = Recorder()
    t, _ = serve(engine, batch, rec)
    t.join(120)
    monkeypatch.undo()
    assert not t.is_alive()
    assert sorted(rec.results) == sorted(r.segment_id for r in batch)
    for r in batch:
        assert rec.results[r.segment_id].error is None
        np.testing.assert_allclose(rec.results[r.segment_id].audio, alone(engine, r), rtol=0, atol=BATCH_ATOL)
    assert calls["n"] > failures
    return alone_runs


def test_llm_failure_renders_what_was_in_flight_one_at_a_time(engine, monkeypatch, lookahead):
    error = RuntimeError("CUDA error: an illegal memory access (simulated)")
    alone_runs = serve_with_a_failing_llm(engine, monkeypatch, mixed(engine, 5), error, 1)
    assert alone_runs and set(alone_runs) == {1}


@pytest.mark.parametrize("failures", [1, 2])
def test_an_llm_out_of_memory_decodes_what_was_in_flight_again(engine, monkeypatch, lookahead, failures):
    """The LLM running out of device memory (a prefill beside flow/HiFT's batches) loses what it was
    decoding: after one such failure all of it is decoded again, batched, and nothing renders alone;
    a request lost so a second time renders alone. Every segment sounds as alone either way."""
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
    alone_runs = serve_with_a_failing_llm(engine, monkeypatch, mixed(engine, 5), oom, failures)
    if failures == 1:
        assert alone_runs == []
    else:
        assert alone_runs and set(alone_runs) == {1}


def test_a_lost_llm_fails_what_it_held_without_rendering_it_alone(engine, monkeypatch):
    """An LLM backend that can serve nothing more (EngineLost: its vLLM core died) fails every request
    it held with `engine_lost` (the pipeline then ends the process), instead of trying each one alone
    on the dead backend, spending their attempts."""
    from voxbatch.worker.engine import EngineLost

    batch = mixed(engine, 5)
    alone_runs = []

    def dead(self, feed):
        yield from ()
        feed.take(len(batch), wait=True)  # the backend takes requests, then its engine dies
        raise EngineLost("the vLLM engine failed earlier")

    monkeypatch.setattr(type(engine.llm), "stream", dead)
    monkeypatch.setattr(CosyVoice2Engine, "_run", lambda self, items: alone_runs.append(len(items)) or iter(()))
    rec = Recorder()
    t, _ = serve(engine, batch, rec)
    t.join(60)
    monkeypatch.undo()
    assert not t.is_alive()
    assert rec.results and alone_runs == []
    for res in rec.results.values():
        assert res.engine_lost and res.audio is None and "failed earlier" in res.error


def test_bad_voice_fails_only_its_segment(engine, lookahead):
    good = mixed(engine, 2)
    bad = SynthesisRequest("bad", TEXTS[0], "nobody", 1, SynthesisParams(max_tokens=4))
    rec = Recorder()
    t, _ = serve(engine, good + [bad], rec)
    t.join(120)
    assert rec.results["bad"].audio is None and "nobody" in rec.results["bad"].error
    assert all(rec.results[r.segment_id].error is None for r in good)


def test_blocked_emit_stops_taking_the_intake(engine, lookahead):
    gate = threading.Event()
    rec = Recorder(block=gate)
    batch = mixed(engine, 24)
    t, intake = serve(engine, batch, rec)
    time.sleep(3.0)
    taken = sum(kind == "admit" for kind, _ in rec.events)
    # The vocoder's backlog limit (max(2 x flow batch, max batch) rows) plus the LLM's rows, not all 24.
    assert taken <= max(2 * engine.flow_batch, MAX_BATCH) + MAX_BATCH + engine.flow_batch, taken
    assert intake.qsize() > 0
    gate.set()
    t.join(120)
    assert len(rec.results) == 24


@pytest.mark.parametrize("ahead", [False, True], ids=["one_batch", "lookahead"])
def test_lookahead_queues_the_next_batch_before_waiting_for_the_last(engine, monkeypatch, ahead):
    """VOCODER_LOOKAHEAD: one vocoder thread launches its next batch before it waits for the previous
    one's audio (two batches launched and not yet waited for, at some point); off, never more than one.
    Every segment still sounds as alone, and a batch whose audio fails to arrive is rendered again row
    by row, so only the row that fails again fails."""
    from voxbatch.worker.cosyvoice2 import engine as engine_mod
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", 1)
    monkeypatch.setattr(streaming, "VOCODER_PIPELINE", False)  # the loop VOCODER_LOOKAHEAD changes
    monkeypatch.setattr(streaming, "VOCODER_LOOKAHEAD", ahead)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    outstanding, most, failed = [0], [0], []
    real_launch, real_results = CosyVoice2Engine.vocode_launch, engine_mod.VocodedBatch.results

    def vocode_launch(self, items, queued=None, begun=None):
        out = real_launch(self, items, queued, begun)
        outstanding[0] += 1
        most[0] = max(most[0], outstanding[0])
        return out

    def results(self):
        outstanding[0] -= 1
        if len(self.items) > 1 and not failed:  # the first multi-row batch's audio "never arrives"
            failed.append([item.request.segment_id for item in self.items])
            raise RuntimeError("CUDA error: unspecified launch failure (simulated)")
        return real_results(self)

    monkeypatch.setattr(CosyVoice2Engine, "vocode_launch", vocode_launch)
    monkeypatch.setattr(engine_mod.VocodedBatch, "results", results)
    batch = mixed(engine, 12)
    rec = serve_to_the_end(engine, batch, monkeypatch)
    assert failed, "no multi-row batch"
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)
    assert most[0] == (2 if ahead else 1)


def test_pipeline_begins_the_next_batch_while_the_current_ones_steps_run(engine, monkeypatch):
    """VOCODER_PIPELINE, one vocoder thread: some batch is begun (encoder, step graph) after the current
    batch's steps are queued and before its HiFT is, its own steps are queued before the current batch's
    audio is waited for, and every batch's steps are queued once, before its HiFT. Every segment still
    sounds as alone; a batch whose begin fails and one whose audio fails to arrive are rendered again row
    by row, so only the row that fails again fails."""
    from voxbatch.worker.cosyvoice2 import engine as engine_mod
    from voxbatch.worker.cosyvoice2 import flow as flow_mod
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", 1)
    monkeypatch.setattr(streaming, "VOCODER_PIPELINE", True)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    events: list[tuple[str, int]] = []  # (what, the batch's number: an id() is reused once a batch is freed)
    numbers = itertools.count()
    broken: list[str] = []
    real_begin, real_launch = CosyVoice2Engine.vocode_begin, CosyVoice2Engine.vocode_launch
    real_finish, real_results = flow_mod.PendingMel.finish, engine_mod.VocodedBatch.results

    def vocode_begin(self, items):
        if len(items) > 1 and "begin" not in broken:  # the first multi-row batch cannot begin
            broken.append("begin")
            raise RuntimeError("flow: CUDNN_STATUS_EXECUTION_FAILED (simulated)")
        pending = real_begin(self, items)
        pending.key = next(numbers)
        events.append(("begin", pending.key))
        return pending

    def finish(self):
        if getattr(self, "key", None) is not None and not getattr(self, "queued", False):  # begun by the pipeline
            self.queued = True
            events.append(("steps", self.key))
        return real_finish(self)

    def vocode_launch(self, items, queued=None, begun=None):
        out = real_launch(self, items, queued, begun)
        out.key = None
        if begun is not None:  # not a row-by-row retry (`engine.vocode`)
            events.append(("hift", begun.key))
            out.key = begun.key
        return out

    def results(self):
        if self.key is None:
            return real_results(self)
        events.append(("wait", self.key))
        if len(self.items) > 1 and "audio" not in broken:  # the next multi-row batch's audio never arrives
            broken.append("audio")
            raise RuntimeError("CUDA error: unspecified launch failure (simulated)")
        return real_results(self)

    monkeypatch.setattr(CosyVoice2Engine, "vocode_begin", vocode_begin)
    monkeypatch.setattr(CosyVoice2Engine, "vocode_launch", vocode_launch)
    monkeypatch.setattr(flow_mod.PendingMel, "finish", finish)
    monkeypatch.setattr(engine_mod.VocodedBatch, "results", results)
    batch = mixed(engine, 12)
    rec = serve_to_the_end(engine, batch, monkeypatch)
    assert broken == ["begin", "audio"], broken
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)
    at = {e: i for i, e in enumerate(events)}
    for what, key in events:
        if what == "hift":
            assert at[("steps", key)] < at[("hift", key)], "a batch's HiFT before its steps"
            assert events.count(("steps", key)) == 1
    overlapped = [key for what, key in events if what == "begin" and any(
        at[("steps", cur)] < at[("begin", key)] < at[("hift", cur)] < at[("steps", key)] < at[("wait", cur)]
        for w, cur in events if w == "hift" and cur != key)]
    assert overlapped, events


def test_a_lost_device_fails_the_batch_without_retrying_row_by_row(engine, monkeypatch):
    """A CUDA kernel fault (torch.AcceleratorError: an illegal memory access) in a batch's audio leaves
    nothing in the process able to render: the batch's rows come back marked `engine_lost` (the pipeline
    then ends the process) and are not rendered again one by one on the broken device."""
    from voxbatch.worker.cosyvoice2 import engine as engine_mod
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", 1)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    faulted, row_retries = [], []
    real_results, real_vocode = engine_mod.VocodedBatch.results, CosyVoice2Engine.vocode

    def results(self):
        if len(self.items) > 1 and not faulted:
            faulted.extend(item.request.segment_id for item in self.items)
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real_results(self)

    def vocode(self, items):
        row_retries.append(len(items))
        return real_vocode(self, items)

    monkeypatch.setattr(engine_mod.VocodedBatch, "results", results)
    monkeypatch.setattr(CosyVoice2Engine, "vocode", vocode)
    batch = mixed(engine, 6)
    rec = serve_to_the_end(engine, batch, monkeypatch)
    assert faulted, "no multi-row batch"
    for sid in faulted:
        res = rec.results[sid]
        assert res.engine_lost and res.audio is None and "illegal memory access" in res.error
    assert row_retries == []
    assert not any(rec.results[r.segment_id].engine_lost for r in batch if r.segment_id not in faulted)


class TrickleFeed:
    """One request at first, then one more becomes available at each look: the backend must grow its
    row count while rows decode (bucketed sizes 1 -> 2 -> 4 -> 8) and refill across the arrivals."""

    def __init__(self, requests):
        self.items = list(enumerate(requests))
        self.available = 1
        self.taken = 0

    def waiting(self) -> int:
        self.available = min(len(self.items), self.available + 1)
        return self.available - self.taken

    def take(self, n: int, wait: bool):
        if self.taken >= len(self.items):
            return None
        if wait:
            self.available = max(self.available, self.taken + 1)
        out = self.items[self.taken : min(self.available, self.taken + n)]
        self.taken += len(out)
        return out


def test_torch_backend_grows_its_rows_and_gives_the_same_tokens(engine):
    from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

    voice = engine.voices.get("v1")
    requests = [engine.llm_request(r, voice) for r in mixed(engine, 7)]
    backend = TorchLlmBackend(engine.llm.model, max_batch=8, max_seq=engine.llm.max_seq, cuda_graphs=False,
                              bucket_batches=True, sync_every=2)
    want = {r.index: r.tokens for r in backend.generate(requests)}
    got = dict(backend.stream(TrickleFeed(requests)))
    assert got == want
    assert sorted(backend._states) == [1, 2, 4, 8]  # grew while decoding, never past max_batch


@pytest.mark.parametrize("merge", [True, False], ids=["tail_merge", "bucket_by_bucket"])
def test_vocoder_tail_batches(monkeypatch, merge):
    """With the LLM out of work, the vocoder's batches at the end: the longest bucket together with the
    bucket within a doubling below it, up to flow_batch rows (TAIL_MERGE), else one bucket at a time.
    Every row is handed out exactly once, longest first."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "TAIL_MERGE", merge)
    monkeypatch.setattr(streaming, "BUCKETS_PER_OCTAVE", 2)
    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=4, max_batch=8), llm_rows=lambda: 0)
    vocoder = streaming._Vocoder(sched)
    for n in (200, 150, 120, 100, 40, 210, 205, 202):  # buckets (2 per octave): 15: 200/210/205/202, 14: 150, 13: 120/100, 10: 40
        vocoder.put(SimpleNamespace(tokens=[0] * n))
    batches = []
    while vocoder.buckets:
        batch, _ = vocoder._next()
        batches.append([len(item.tokens) for item in batch])
    if merge:  # bucket 15 fills a batch alone; then 14 takes 13's rows (within a doubling); 10 is alone
        assert batches == [[200, 210, 205, 202], [150, 120, 100], [40]]
    else:
        assert batches == [[200, 210, 205, 202], [150], [120, 100], [40]]
    assert vocoder.pending == 8 and not vocoder.since


@pytest.mark.parametrize("split", [True, False], ids=["tail_split", "whole"])
def test_last_bucket_is_halved_while_another_thread_renders(monkeypatch, split):
    """TAIL_SPLIT: with the LLM out of work and one bucket left, a thread takes half of it while another
    thread is rendering (the rest goes to whichever is free first), halving again down to TAIL_SPLIT_MIN
    rows; with no other thread rendering, or while the LLM still decodes, the bucket goes whole."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "TAIL_SPLIT", split)
    monkeypatch.setattr(streaming, "TAIL_SPLIT_MIN", 4)
    left = [3]
    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=64, max_batch=64), llm_rows=lambda: left[0])
    vocoder = streaming._Vocoder(sched)

    def fill(n: int) -> None:
        for _ in range(n):
            vocoder.put(SimpleNamespace(tokens=[0] * 100))  # one bucket

    fill(20)
    vocoder.rendering = 1  # the other thread is busy
    assert len(vocoder._next()[0]) == 20  # the LLM still decodes 3 rows: they may join, so whole
    assert vocoder.rendering == 2
    left[0] = 0
    vocoder.rendering = 1
    fill(20)
    sizes = []
    while vocoder.buckets:
        sizes.append(len(vocoder._next()[0]))
        vocoder.rendering = 1
    assert sizes == ([10, 5, 5] if split else [20])  # 5 < 2 x 4: the last 5 go whole
    fill(20)
    vocoder.rendering = 0  # nobody else renders: whole
    assert len(vocoder._next()[0]) == 20 and not vocoder.buckets and not vocoder.since


def test_second_vocoder_thread_leaves_partial_buckets_while_the_llm_has_work(monkeypatch):
    """While the LLM has a flow batch's worth left, a partial bucket a quarter full goes to the first
    thread only; once it has too little left, any thread takes what there is."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    left = [100]
    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", 2)
    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=8, max_batch=8), llm_rows=lambda: left[0])
    vocoder = streaming._Vocoder(sched)
    assert len(vocoder.threads) == 2
    for n in (50, 52):  # one bucket, 2 rows = a quarter of flow_batch
        vocoder.put(SimpleNamespace(tokens=[0] * n))
    now = time.perf_counter()
    assert vocoder._partial(now, primary=False) is None
    key = vocoder._partial(now, primary=True)
    assert key is not None
    left[0] = 0
    assert vocoder._partial(now, primary=False) == key


def test_vocoder_threads_follow_the_engine_setting(tiny_model_dir, storage_dir):  # noqa: F811
    """Settings.engine_vocoder_threads reaches the engine and sets the vocoder's threads; unset, a CPU
    engine gets CPU_VOCODER_THREADS."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    settings = Settings(engine="cosyvoice2", model_dir=str(tiny_model_dir), storage_url=storage_dir.as_uri(),
                        engine_max_batch=MAX_BATCH, engine_flow_batch=2, engine_vocoder_threads=3)
    eng = CosyVoice2Engine.from_settings(settings)
    assert eng.vocoder_threads == 3
    assert len(streaming._Vocoder(SimpleNamespace(engine=eng)).threads) == 3
    unset = CosyVoice2Engine.from_settings(settings.model_copy(update={"engine_vocoder_threads": None}))
    assert unset.vocoder_threads is None
    assert len(streaming._Vocoder(SimpleNamespace(engine=unset)).threads) == streaming.CPU_VOCODER_THREADS


def test_a_tasks_requests_prepared_together_are_what_prepare_makes_of_each(engine, monkeypatch):
    """`prepare_many` tokenizes a task's texts in one call (`encode_many`, the same ids as `encode` of
    each) and composes each request's LLM input as `prepare` does; a request with a missing voice or
    a text of no tokens comes back as it was (never raises), the rest prepared. Off (PREPARE_TOGETHER):
    one `prepare` a request, the same inputs."""
    from voxbatch.worker.cosyvoice2 import engine as engine_module

    batch = mixed(engine, 6)
    texts = [r.text for r in batch] + ["", "<|endofprompt|> speak slowly"]
    assert engine.tokenizer.encode_many(texts) == [engine.tokenizer.encode(t) for t in texts]
    missing = SynthesisRequest("missing", TEXTS[0], "nobody", 1, SynthesisParams(max_tokens=4))
    blank = SynthesisRequest("blank", "", batch[0].voice, 2, SynthesisParams(max_tokens=4))
    requests = [batch[0], missing, *batch[1:3], blank, *batch[3:]]
    together = engine.prepare_many(requests)
    assert [r.segment_id for r in together] == [r.segment_id for r in requests]
    assert together[1] is missing and together[4] is blank  # as they were: the LLM thread reports them
    for made, r in zip([together[0], *together[2:4], *together[5:]], batch):
        assert made.prepared.llm == engine.prepare(r).prepared.llm
    monkeypatch.setattr(engine_module, "PREPARE_TOGETHER", False)
    one_by_one = engine.prepare_many(requests)
    assert one_by_one[1] is missing and one_by_one[4] is blank
    assert [r.prepared.llm for i, r in enumerate(one_by_one) if i not in (1, 4)] == \
        [r.prepared.llm for i, r in enumerate(together) if i not in (1, 4)]


def test_prepared_requests_take_their_input_from_prepare_and_sound_the_same(engine, monkeypatch):
    """`prepare` (on the task's thread) composes the LLM input the LLM thread would: `item` takes it
    as made while the voice is the one the cache holds, makes it again for a voice re-created
    meanwhile, and one that cannot be prepared raises what `item` would (the pipeline then queues it
    as it came, and its error is reported when the engine takes it). Served prepared, every segment sounds as it does alone."""
    from voxbatch.worker.cosyvoice2 import engine as engine_module

    batch = mixed(engine, 6)
    prepared = [engine.prepare(r) for r in batch]
    assert all(p.prepared is not None and r.prepared is None for p, r in zip(prepared, batch))
    for p, r in zip(prepared, batch):
        item = engine.item(p)
        assert item.llm is p.prepared.llm  # taken as made, not composed again
        assert item.llm == engine.llm_request(r, engine.voices.get(r.voice))
    engine.voices._voices.clear()  # the voice is loaded again: a new profile object under the same name
    again = engine.item(prepared[0])
    assert again.llm is not prepared[0].prepared.llm and again.llm == prepared[0].prepared.llm
    bad = SynthesisRequest("bad", TEXTS[0], "nobody", 1, SynthesisParams(max_tokens=4))
    with pytest.raises(LookupError, match="nobody"):
        engine.prepare(bad)  # the pipeline queues it unprepared (tests/test_pipeline.py)
    monkeypatch.setattr(engine_module, "PREPARE_AT_ENQUEUE", False)
    assert engine.prepare(batch[0]) is batch[0]
    monkeypatch.undo()

    rec = Recorder()
    t, _ = serve(engine, prepared + [bad], rec)
    t.join(120)
    assert not t.is_alive()
    assert rec.results["bad"].audio is None and "nobody" in rec.results["bad"].error
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)


@pytest.mark.parametrize("start_div", [0, 8])
def test_with_nothing_rendering_a_smaller_bucket_starts_the_vocoder(monkeypatch, start_div):
    """START_BATCH_DIV: while no vocoder thread renders (a job's start) the fullest bucket runs at
    flow_batch / START_BATCH_DIV rows; once a thread renders, the idle bar (IDLE_BATCH_DIV) is back.
    Off (0), the idle bar holds throughout."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "START_BATCH_DIV", start_div)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 4)
    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=16, max_batch=32), llm_rows=lambda: 100)
    vocoder = streaming._Vocoder(sched)
    for n in (100, 101):  # one bucket of 2 rows: 16 / 8, under 16 / 4
        vocoder.put(SimpleNamespace(tokens=[0] * n))
    now = time.perf_counter()
    key = vocoder._partial(now, primary=True)
    assert (key is not None) == bool(start_div)
    vocoder.rendering = 1
    assert vocoder._partial(now, primary=True) is None  # another batch renders: the idle bar
    for n in (102, 103):
        vocoder.put(SimpleNamespace(tokens=[0] * n))
    assert vocoder._partial(now, primary=True) is not None  # 4 rows = 16 / 4


@pytest.mark.parametrize("lock", [False, True])
def test_launch_lock_lets_one_vocoder_thread_queue_at_a_time(engine, monkeypatch, lock):
    """LAUNCH_LOCK: with two flow/HiFT threads, a batch's GPU work is queued by one thread at a time
    (from its first op until `queued`), while the wait for the host copy overlaps; every segment still
    sounds as alone. Off, both threads queue at once (the barrier below would time out with the lock)."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "CPU_VOCODER_THREADS", 2)
    monkeypatch.setattr(streaming, "VOCODER_PIPELINE", False)  # the loop LAUNCH_LOCK was measured in
    monkeypatch.setattr(streaming, "LAUNCH_LOCK", lock)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    real = CosyVoice2Engine.vocode_launch
    inside, most, both = [0], [0], threading.Barrier(2, timeout=2)
    guard = threading.Lock()

    def vocode_launch(self, items, queued=None, begun=None):
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        left = [False]

        def done():
            with guard:
                if not left[0]:
                    left[0] = True
                    inside[0] -= 1
            if queued is not None:
                queued()
        if not lock:  # off, both threads may stand here at once: wait for the other's batch
            try:
                both.wait()
            except threading.BrokenBarrierError:
                pass
        try:
            return real(self, items, queued=done, begun=begun)
        finally:
            done()

    monkeypatch.setattr(CosyVoice2Engine, "vocode_launch", vocode_launch)
    batch = mixed(engine, 12)
    rec = Recorder()
    t, _ = serve(engine, batch, rec)
    t.join(120)
    assert not t.is_alive()
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)
    assert most[0] == (2 if not lock else 1)


def test_the_llm_running_out_of_work_is_a_timeline_event(engine):
    """`llm_done`: logged when the LLM hands over its last row with nothing waiting; after the last
    one the job has only flow/HiFT left (no admission, no refill), and every batch still ends."""
    from voxbatch.worker import timeline

    batch = mixed(engine, 6)
    rec = Recorder()
    with timeline.recording() as lines:
        t, intake = serve(engine, batch, rec, close=False)
        deadline = time.time() + 120
        while len(rec.results) < len(batch) and time.time() < deadline:
            time.sleep(0.05)
        intake.put(None)
        t.join(60)
    assert len(rec.results) == len(batch)
    events = timeline.read(lines, 0, time.time() + 1)
    kinds = [e for _, e, _ in events]
    assert "llm_done" in kinds
    last = len(kinds) - 1 - kinds[::-1].index("llm_done")
    assert not {"admit", "llm_session", "llm_refill"} & set(kinds[last:])
    assert kinds.count("vocode_start") == kinds.count("vocode_end") >= 1
    assert timeline.summary(events)["last_llm_done_s"] == round(events[last][0], 3)


def test_the_primary_vocoder_stream_can_run_ahead_with_the_llm_still_first(monkeypatch):
    """PRIMARY_VOCODER_PRIORITY: off, every vocoder stream at CUDA's default priority (0); on, the
    primary thread's at it, the others at 0, and the LLM's stream stays above both."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "PRIMARY_VOCODER_PRIORITY", None)
    assert streaming.vocoder_stream_priority(True) == streaming.vocoder_stream_priority(False) == 0
    assert streaming.llm_stream_priority() == streaming.LLM_STREAM_PRIORITY
    monkeypatch.setattr(streaming, "PRIMARY_VOCODER_PRIORITY", -1)
    assert (streaming.vocoder_stream_priority(True), streaming.vocoder_stream_priority(False)) == (-1, 0)
    assert streaming.llm_stream_priority() < -1
    monkeypatch.setattr(streaming, "LLM_STREAM_PRIORITY", -3)  # already above: kept
    assert streaming.llm_stream_priority() == -3


@pytest.mark.gpu
def test_vocoder_threads_render_on_streams_of_their_priority_on_gpu(tiny_model_dir, storage_dir, monkeypatch):  # noqa: F811
    """On CUDA, with PRIMARY_VOCODER_PRIORITY set, the primary vocoder thread's batches run on a
    stream of that priority and the other thread's at 0; every segment renders."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "PRIMARY_VOCODER_PRIORITY", -1)
    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    settings = Settings(engine="cosyvoice2", model_dir=str(tiny_model_dir), storage_url=storage_dir.as_uri(),
                        engine_max_batch=MAX_BATCH, engine_flow_batch=2, llm_device="cuda:0")
    gpu = CosyVoice2Engine.from_settings(settings)
    real = CosyVoice2Engine.vocode_launch
    seen: dict[str, set[int]] = {}

    def vocode_launch(self, items, queued=None, begun=None):
        seen.setdefault(threading.current_thread().name, set()).add(torch.cuda.current_stream().priority)
        return real(self, items, queued=queued, begun=begun)

    monkeypatch.setattr(CosyVoice2Engine, "vocode_launch", vocode_launch)
    try:
        batch = mixed(gpu, 12)
        rec = Recorder()
        t, _ = serve(gpu, batch, rec)
        t.join(300)
        assert not t.is_alive()
        assert all(rec.results[r.segment_id].error is None for r in batch)
        assert seen.get("flow-hift-0") == {-1}, seen
        assert seen.get("flow-hift-1", {0}) == {0}, seen  # the second thread may have had nothing to take
    finally:
        gpu.llm.close()


def test_a_batch_out_of_device_memory_renders_in_halves_and_later_batches_fit(engine, monkeypatch, lookahead, caplog):
    """A flow/HiFT batch that runs out of device memory (torch.OutOfMemoryError, raised here wherever the
    batch is bigger than a card could hold) is rendered again in halves, not row by row, and the
    vocoder keeps later batches within half of what failed: every segment sounds as alone, and once a
    batch has failed (one vocoder thread here) no batch bigger than what fit is tried again."""
    from voxbatch.worker.cosyvoice2 import streaming

    monkeypatch.setattr(streaming, "IDLE_BATCH_DIV", 1)
    monkeypatch.setattr(engine, "flow_batch", MAX_BATCH)  # the LLM's rows finish together: batches of MAX_BATCH
    batch = [req(i, TEXTS[i % len(TEXTS)], exact_bound(engine, TEXTS[i % len(TEXTS)], 12)) for i in range(4 * MAX_BATCH)]
    longest = max(speech_tokens(engine, batch).values())
    fits = 2 * longest  # two rows fit, no more of the longest
    tried, failed, retried = [], [], []
    real, real_vocode = CosyVoice2Engine.mel_batch, CosyVoice2Engine.vocode

    def mel_batch(self, tokens, voices, ahead=False):
        cost = len(tokens) * max(len(t) for t in tokens)
        tried.append(cost)
        if cost > fits:
            failed.append(len(tried))
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {cost} tokens' activations")
        return real(self, tokens, voices, ahead)

    def vocode(self, items, queued=None):  # the vocoder's retries of a failed batch
        retried.append(len(items))
        return real_vocode(self, items, queued)

    monkeypatch.setattr(CosyVoice2Engine, "mel_batch", mel_batch)
    monkeypatch.setattr(CosyVoice2Engine, "vocode", vocode)
    with caplog.at_level("WARNING", logger="voxbatch.worker.cosyvoice2.streaming"):
        rec = serve_to_the_end(engine, batch, monkeypatch)
    for r in batch:
        res = rec.results[r.segment_id]
        assert res.error is None, res.error
        np.testing.assert_allclose(res.audio, alone(engine, r), rtol=0, atol=BATCH_ATOL, err_msg=r.text)
    assert failed, f"no batch over {fits} tokens: {tried}"
    assert len(failed) == 1, (failed, tried)  # the budget came down before the next batch was chosen
    assert all(cost <= fits for cost in tried[failed[-1]:]), tried
    assert retried and max(retried) == MAX_BATCH // 2, retried  # halves of the failed batch, not its rows alone
    assert "ran out of device memory" in caplog.text


def test_the_token_budget_cuts_a_batch_and_puts_the_rest_back(monkeypatch):
    """`_Vocoder.token_budget`: a batch holds at most that many padded speech tokens (rows x the
    longest row's), one row at least; the rows cut go back to the front of their buckets, still pending,
    and come next in their order."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=8, max_batch=8), llm_rows=lambda: 0)
    vocoder = streaming._Vocoder(sched)
    rows = [SimpleNamespace(tokens=[0] * n, n=i) for i, n in enumerate((100, 110, 105, 120, 101, 102, 103, 104))]
    for row in rows:
        vocoder.put(row)
    vocoder.token_budget = 3 * 120
    got, _ = vocoder._next()
    assert [r.n for r in got] == [0, 1, 2]  # 3 x 120 (the longest of all 8) tokens
    assert vocoder.pending == 8
    vocoder._done(got)
    vocoder.token_budget = 50  # less than one row: the row goes alone
    got, _ = vocoder._next()
    assert [r.n for r in got] == [3]
    vocoder._done(got)
    vocoder.token_budget = None
    got, _ = vocoder._next()
    assert [r.n for r in got] == [4, 5, 6, 7] and not vocoder.buckets and vocoder.pending == 4


def test_shrink_halves_the_failed_batch_and_never_raises_the_budget():
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=8, max_batch=8), llm_rows=lambda: 0)
    vocoder = streaming._Vocoder(sched)
    vocoder._shrink([SimpleNamespace(tokens=[0] * n) for n in (90, 100, 80, 70)])
    assert vocoder.token_budget == 200
    vocoder._shrink([SimpleNamespace(tokens=[0] * 300)] * 4)  # a bigger batch that failed beside it
    assert vocoder.token_budget == 200
    vocoder._shrink([SimpleNamespace(tokens=[0] * 100)] * 2)
    assert vocoder.token_budget == 100


def test_the_budget_grows_back_after_batches_that_used_it_and_halves_at_the_next_failure(monkeypatch):
    """BUDGET_REGROW_STEPS: each batch rendered whole that used at least half of the budget raises it by
    1/steps of the budget set at the last failure; a batch under half leaves it; the next failure halves
    that batch and sets a new step; with 0 the budget only goes down."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    def rows(n: int, tokens: int) -> list:
        return [SimpleNamespace(tokens=[0] * tokens)] * n

    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=8, max_batch=8), llm_rows=lambda: 0)
    monkeypatch.setattr(streaming, "BUDGET_REGROW_STEPS", 4)
    vocoder = streaming._Vocoder(sched)
    vocoder._regrow(rows(4, 100))
    assert vocoder.token_budget is None  # nothing failed: no budget to grow
    vocoder._shrink(rows(4, 100))
    assert (vocoder.token_budget, vocoder.regrow_step) == (200, 50)
    vocoder._regrow(rows(1, 99))  # 99 tokens, under half of 200
    assert vocoder.token_budget == 200
    for want in (250, 300, 350, 400, 450):  # back at the failed size after 4, then on up
        vocoder._regrow(rows(2, 100))
        assert vocoder.token_budget == want
    vocoder._shrink(rows(4, 110))
    assert (vocoder.token_budget, vocoder.regrow_step) == (220, 55)

    monkeypatch.setattr(streaming, "BUDGET_REGROW_STEPS", 0)
    vocoder = streaming._Vocoder(sched)
    vocoder._shrink(rows(4, 100))
    vocoder._regrow(rows(2, 100))
    assert vocoder.token_budget == 200


def test_drop_frames_lets_go_of_what_the_failed_attempt_held():
    """The exception a failed batch raised keeps the frames it came through, and their tensors, alive
    while the batch renders again in halves; `_drop_frames` lets them go (and those of what it chained)."""
    import weakref

    from voxbatch.worker.cosyvoice2 import streaming

    refs = []

    def attempt():
        held = torch.zeros(4)
        refs.append(weakref.ref(held))
        try:
            raise RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
        except RuntimeError:
            inner = torch.zeros(4)  # noqa: F841
            refs.append(weakref.ref(inner))
            raise torch.OutOfMemoryError("CUDA out of memory")

    try:
        attempt()
    except torch.OutOfMemoryError as e:
        kept = e
    assert all(r() is not None for r in refs)
    streaming._drop_frames(kept)
    assert all(r() is None for r in refs)


def test_a_batch_failing_out_of_memory_lowers_the_budget_when_it_fails():
    """`_failed`, where a batch's queueing raised: out of device memory, the budget comes down and the
    attempt's frames are let go right then (a thread may choose and begin another batch before it
    renders this one again); any other error is kept as it is."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2 import streaming

    sched = SimpleNamespace(engine=SimpleNamespace(flow_batch=8, max_batch=8), llm_rows=lambda: 0)
    vocoder = streaming._Vocoder(sched)
    batch = [SimpleNamespace(tokens=[0] * 100)] * 4

    def raised(e: Exception) -> Exception:
        try:
            raise e
        except Exception as caught:  # noqa: BLE001
            return caught

    other = raised(RuntimeError("CUDNN_STATUS_EXECUTION_FAILED"))
    assert vocoder._failed(batch, other) is other and other.__traceback__ is not None and vocoder.token_budget is None
    oom = raised(torch.OutOfMemoryError("CUDA out of memory"))
    assert vocoder._failed(batch, oom) is oom and oom.__traceback__ is None and vocoder.token_budget == 200
