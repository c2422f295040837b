"""The CosyVoice2 engine's one scheduler: continuous LLM decoding overlapped with flow/HiFT.

    intake ──admit──> feed ──LlmBackend.stream──> finished rows ──length buckets──> flow + HiFT ──emit──>
     (tasks)           (LLM thread: refills free KV rows across tasks)     (vocoder threads, own CUDA streams)

Why one loop: batch-at-a-time serving (decode a batch, vocode it, then take more) left the GPU idle
while the slowest row of each batch decoded alone, and let the worker's batch size follow its Celery
task size. Here the LLM backend takes work from the intake whenever rows free up, whatever task it
came from, longest texts first (a long sequence started late would end the work decoding alone); each
finished sequence goes into a length bucket (half an octave wide); a bucket runs through flow + HiFT as
one batch when it is full, when the vocoder is idle and the bucket a quarter full, when the LLM has too
little left to fill it, or when its oldest row has waited `FLUSH_AFTER_S`. Each vocoder thread (two on
a GPU, `VOCODER_THREADS`) runs on its own CUDA stream and the LLM thread on a higher-priority one, so
the decode step's small kernels take SMs as flow/HiFT blocks retire instead of queueing behind them,
and one flow/HiFT batch's host work and small kernels overlap another's; a batch is queued whole with
no host sync until HiFT's output comes to the host through pinned memory. Each thread begins its next
batch (encoder, step-graph capture) while its current batch's Euler steps run, and queues that batch's
steps before it waits for the current one's audio (VOCODER_PIPELINE), so its stream never runs dry at a
turnover. Each of these choices was
measured against its alternative in one H200 run (BENCHMARKS.md, "This round's changes").

The Pipeline's contract (`Engine.serve`) holds: `admit` is called on what is taken from the intake
before it renders (attempts are counted there); a `solo` request (a suspect) renders with nothing else
in flight, in the LLM or in flow/HiFT; if the LLM fails, what it was decoding is rendered again one
request at a time, and a failing flow/HiFT batch is retried row by row, so one bad segment fails alone
(one that ran out of device memory in halves instead, and later batches are kept within what fit);
`emit` blocking (a full output queue) stops the intake from being taken; `stop` or a None in the intake
ends the loop once what is in flight is emitted. `observe(size, audio_s, wall_s)` hears of every
flow/HiFT batch.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
import torch

from voxbatch.worker import timeline
from voxbatch.worker.engine import SynthesisRequest, SynthesisResult, exception_chain, is_engine_lost, is_out_of_memory

log = logging.getLogger(__name__)

FLUSH_AFTER_S = 1.0  # a partial flow bucket runs once its oldest row has waited this long
POLL_S = 0.05  # how long an idle LLM thread waits on the intake before looking at `stop` again
# CUDA stream priority of the LLM thread (lower is more urgent; 0 is the default streams' priority).
# The decode step is hundreds of small kernels that leave most SMs idle; at a higher priority than
# the vocoder's stream they take SMs as flow/HiFT blocks retire instead of queueing behind whole flow
# kernels, so the LLM decodes inside flow/HiFT's time rather than after it. At the vocoder's priority
# (0) the LLM's kernels would fill more of the vocoder's gaps but end later: no different, the worker
# on an H100, tasks of 16, 338.8x vs 338.7x / 337.9x at -1 (B/A 1.001, bench/results/
# gpu_h100_s43a_worker.json). Bench switch `prio`.
LLM_STREAM_PRIORITY = -1
BUCKETS_PER_OCTAVE = 2  # flow length buckets per doubling of length (1: within 2x, 2: within 1.41x)
IDLE_BATCH_DIV = 4  # an idle vocoder runs a bucket holding flow_batch / this many rows (0: wait for full/old)
# With no vocoder thread rendering at all (a job's start: the LLM's first rows have just finished), run
# the fullest bucket once it holds flow_batch / this many rows instead (0: off, IDLE_BATCH_DIV's bar).
# Why it might pay: a job's vocoder work is most of its wall time, and at the start nothing but the
# LLM runs: its first flow batch began 0.85-0.90 s into ~10.5 s jobs on the H200 (a bucket filling to a
# quarter of a flow batch), with the decode step leaving SMs free beside it
# (bench/results/gpu_h200_worker19.json, timeline). Small batches cost more per row, so this only
# applies while nothing else renders. Not measured yet: off until an A/B on the H200 says otherwise
# (bench switch `start_div`, e.g. `--worker-ab start_div=16`).
START_BATCH_DIV = 0
# Flow/HiFT threads, each with its own CUDA stream. In a job the LLM takes its last rows early (last
# refill 2.6 s into 13.7 s, bench/results/gpu_h200_worker7_worker.log); after them one thread's
# batches run back to back alone, and the GPU idles at each batch's host work and through a small
# last batch.
# A second thread runs another batch meanwhile. It takes only full buckets, buckets past FLUSH_AFTER_S
# and, once the LLM has too little left to fill a bucket, the rest: while the LLM decodes, partial
# buckets stay the first thread's, so the start of the work does not split into smaller batches.
# Engine on the H200: 261.2x with two threads (run second) vs 247.1x with one (run first), peak GPU
# memory 32.1 vs 29.7 GiB (bench/results/gpu_h200_vocoders1.json). On a CPU the threads would share
# the same cores: one. Settings.engine_vocoder_threads, where set, overrides both.
VOCODER_THREADS = 2  # with flow on a GPU
CPU_VOCODER_THREADS = 1
# When the LLM has less than a flow batch left (the end of the work), an idle vocoder could run the
# longest bucket together with the rows of the buckets within a doubling of it (up to flow_batch rows)
# instead of one small bucket after another. Off: it measured no faster (engine median 246.8x with,
# 250.7x without, runs in A B B A order, bench/results/gpu_h200_worker7.json); kept as the bench's
# `merge` switch so that run's command still reproduces it.
TAIL_MERGE = False
# When the LLM has finished everything and one bucket is left while another vocoder thread is still
# rendering, take half of it (at least TAIL_SPLIT_MIN rows a half) and leave the rest to whichever
# thread is free first, instead of one thread running the whole last batch alone while the other
# idles: a job ended on one small batch, the GPU at 4-71% for its last ~0.5 s
# (bench/results/gpu_h200_worker12.json, raw utilisation samples). Off: no faster, engine 299.2x (313.9,
# 299.2) with vs 299.4x (299.4, 314.2) without (bench/results/gpu_h200_worker13.json). Bench switch `split`.
TAIL_SPLIT = False
TAIL_SPLIT_MIN = 8
# Vocoder threads queue their batches' GPU work one at a time: a thread holds this lock from a batch's
# first op until all of its flow and HiFT work is queued, then waits for the copy to the host without
# it. Why it might pay: where two batches start together (a job's end, the LLM done), both threads
# launch eager ops (the flow encoder, the first Euler step, the capture, HiFT's ~8k launches) and hand
# the GIL to each other at every op; the GPU read 12-22% for ~0.2 s each time, with both threads
# "rendering" (bench/results/gpu_h200_worker19.json, tasks of 256: raw utilisation against the
# timeline). With the lock one thread queues at full speed while the other's queued kernels run.
# Off: slower. Worker on an H100, tasks of 16, A B.. A: 279.4x with vs 302.7x / 291.2x without (B/A
# 0.941; with vprio 0.906, with f0_quantum 0.914). The lock did cut a batch's host share from 99% to
# 53%, but the LLM then ended sooner (3.5 vs 4.7 s) and the vocoder-only tail grew (8.4 vs 6.3 s):
# a thread held up by the launch queue while holding the lock keeps the other's batch off the GPU, and
# two batches' kernels side by side fill each other's gaps (bench/results/gpu_h100_worker20.json).
# Bench switch `llock`.
LAUNCH_LOCK = False
# CUDA stream priority of the primary vocoder thread (None: every vocoder stream at the default, 0);
# the other threads stay at 0 and the LLM's stream goes one above it if it is not already. Why it
# might pay: two batches side by side on equal streams advance kernel for kernel, so they end
# together whatever their sizes (11 and 23 rows both took ~1.05 s, 47 and 75 both ~2.05 s) and the two
# threads start their next batches' host work together with nothing of theirs queued: 4 such pairs
# in the vocoder-only tail of the tasks-of-256 job, and a GPU dip after each
# (bench/results/gpu_h200_worker19_worker.log). With the primary's stream ahead, its batch runs as if
# alone and the other's kernels fill the SMs it leaves and the gaps of its host work, so the threads
# fall out of step. CUDA only (torch offers priorities 0 to -3). Off: no faster. Worker on an H100,
# tasks of 16: 291.5x with -1 vs 302.7x / 291.2x without (B/A 0.982), and it left 3 paired starts in
# the job where A had 0 and 1 (bench/results/gpu_h100_worker20.json); engine A B B A 298.1x, 304.6x
# with vs 271.7x, 304.6x without (gpu_h100_engine20.json). Bench switch `vprio`, e.g. `vprio=-1`.
PRIMARY_VOCODER_PRIORITY: int | None = None
# A vocoder thread queues its next batch before it waits for the last one's audio: once a batch's GPU
# work is all queued it takes the next batch it may (full buckets, buckets past FLUSH_AFTER_S, all of
# them once the LLM is nearly done: the secondary thread's rule, since it is not idle), queues that,
# and only then waits for the first batch's copy to the host and emits it. Why it might pay: a
# thread's launches run ahead of its stream by the launch queue only (its host share is 99%: it
# finishes queueing a batch just before the GPU finishes running it), then it waited for the copy,
# emitted, chose and began the next batch's host work with nothing of its own queued; in the
# vocoder-only tail, with the other thread at the same point, the GPU dipped there (tail 84-94% busy,
# bench/results/gpu_h100_worker20.json). With one batch of look-ahead a thread's stream holds work
# through its turnover. The same stream runs the two batches in order, so memory is the next batch's
# inputs and the last one's audio more, not a second batch's intermediates. Off: no faster. Worker on
# the H200, tasks of 16: 316.5x with vs 315.7x / 332.8x without (B/A 0.976), and with one vocoder
# thread instead of two 325.5x (1.004), with three 326.5x (1.007) (bench/results/gpu_h200_worker23.json);
# again A B1 B2 A B1 B2 A: 311.1x, 317.7x with (1.005), 323.7x, 304.6x with one thread (1.004) vs A
# 310.5x, 310.4x, 317.7x (gpu_h200_worker24.json). The tail's dips stayed (80.9-91.3% busy after the
# LLM's last row with it, 82.2-91.0% without): a thread's stream running dry at its turnover is not
# what they are. Bench switch `ahead`.
VOCODER_LOOKAHEAD = False
# A vocoder thread begins its next batch while its current batch's Euler steps run: per thread the GPU
# work goes  steps(N) | begin(N+1) HiFT(N) steps(N+1) | wait(N), emit(N) | begin(N+2) HiFT(N+1) ...
# where begin is the flow's encoder queued and its step graph captured before any step runs (a warm
# thread, flow.ConditionalFlowMatching.start's `ahead`), and steps are the ten graph replays: ten
# launches that queue ~10 flow steps of GPU time (~85 ms each for 64 rows on an H100: the flow alone
# took 6.565 s for 500 rows x 10 steps, bench/results/gpu_h100_s36_parts.json). Why it might pay: a
# batch's capture (44-195 ms of host time, one thread's after the other's under the graph lock)
# and its copy, emits and choice of the next batch came where this thread had nothing queued; with the
# two threads' batches ending together (equal streams advance kernel for kernel), each such turnover in
# the vocoder-only tail was a GPU dip (89%, 92%, the last 22-41% busy,
# bench/results/gpu_h100_s43a_worker.json). Here every capture is taken while the thread's own queue
# holds a batch's steps, and the next batch's steps are queued before the wait for the last one's audio,
# so the thread's stream does not run dry at a turnover. Unlike VOCODER_LOOKAHEAD (the next batch
# queued whole after HiFT's launches, which return only once the GPU has nearly run them: its
# captures still came at a shallow queue), the capture moves to where the queue is deep. The next
# batch is chosen by the secondary thread's rule (full buckets, old ones, all once the LLM is nearly
# done); with none, the thread finishes its batch first and then chooses as before. Memory: the next
# batch's encoder output, ODE state and graph beside the current batch's HiFT. On: faster and the GPU
# busier in both of two runs. The worker on an H100, tasks of 16: A B1 B2 A 328.6x with vs 325.9x /
# 325.2x without (B/A 1.009), GPU busy 90.1% vs 88.5 / 87.6%, the vocoder-only tail 92.5% vs 87.1 /
# 85.5% (bench/results/gpu_h100_s44a_worker.json); A B A 333.5x vs 321.8x / 318.0x (1.043), busy 90.5%
# vs 87.7 / 88.2%, tail 91.5% vs 85.2 / 87.7% (gpu_h100_s44b_worker.json). The captures took longer
# (2.5-3.0 s a job summed, against 1.5-2.3 s), hidden behind queued steps. Bench switch `pipe`; it
# overrides VOCODER_LOOKAHEAD.
VOCODER_PIPELINE = True
# After a flow/HiFT batch runs out of device memory, later batches hold at most half of its padded speech
# tokens (`_Vocoder.token_budget`). Each later batch that renders whole while using at least half of the
# budget raises it by 1/BUDGET_REGROW_STEPS of the budget set at the last failure: back at the failed size
# after that many such batches, then on up until a batch fails again and halves it (additive increase,
# multiplicative decrease, as TCP's congestion window). Why: a budget that only goes down keeps the
# worst moment's size for the life of the process. Under a 24 GiB cap (`card=24`) on an H100, one batch
# of 34 rows failed in the worker's first job (the LLM at its full rows, each vocoder thread with two
# batches under way), and every later batch held ~17 rows or fewer: 234.9x against 326.6x / 337.0x
# uncapped, B/A 0.708 (bench/results/gpu_h100_s47a.json). 0: the budget only goes down. Off: with 8 the
# budget grew back from 7,250 to 14,498 tokens over a job, then an LLM prefill ran out of memory beside
# those batches and its 128 requests rendered one at a time: 46.1x against 232.0x with the budget
# fixed, both under the cap (B/A 0.14 and 0.703, bench/results/gpu_h100_s47b.json). An LLM that runs out
# now decodes what it held again, batched (`StreamingScheduler._decode_again`); `regrow` with that is
# not measured yet. Bench switch `regrow`, e.g. `--worker-ab card=24 card=24,regrow=8`.
BUDGET_REGROW_STEPS = 0
LONGEST_FIRST = True  # refill LLM rows with the longest waiting texts first (shorter tail at the end of the work)
MAX_WAIT_S = 10.0  # ... unless a request has waited this long: then it goes first, whatever its length


def longest_first(text: str) -> int:
    """LONGEST_FIRST's sort key: longer texts (in characters) first. The intake only has the text; the
    benchmark orders its LLM-stage corpus with this same key."""
    return -len(text)


def vocoder_stream_priority(primary: bool) -> int:
    """A vocoder thread's CUDA stream priority (PRIMARY_VOCODER_PRIORITY)."""
    return PRIMARY_VOCODER_PRIORITY if primary and PRIMARY_VOCODER_PRIORITY is not None else 0


def llm_stream_priority() -> int:
    """The LLM thread's CUDA stream priority: LLM_STREAM_PRIORITY, above every vocoder stream."""
    return min(LLM_STREAM_PRIORITY, vocoder_stream_priority(True) - 1)


def length_bucket(n_tokens: int) -> int:
    """Length bucket of a finished sequence: rows within a factor of 2 ** (1 / BUCKETS_PER_OCTAVE)
    share a flow batch, so padding (and attention over it) stays small."""
    return int(BUCKETS_PER_OCTAVE * math.log2(max(n_tokens, 1)))


def padded_tokens(batch: list) -> int:
    """What a flow/HiFT batch holds, as `_Vocoder.token_budget` counts it: rows x the longest row's speech tokens."""
    return len(batch) * max(len(item.tokens) for item in batch)


class _Feed:
    """The LLM backend's view of the intake (`llm_backend.Feed`): admitted, tokenized items.

    Items taken and not yet emitted are `inflight` (key -> item); a solo request is held until the LLM
    and the vocoder are both empty, then taken alone, and nothing else is taken until it is done."""

    def __init__(self, sched: "StreamingScheduler"):
        self.s = sched
        self.inflight: dict[int, object] = {}
        self.closed = False
        self._solo: SynthesisRequest | None = None
        self._exclusive = False  # a solo request is rendering: take nothing else
        self._keys = 0
        self._seen: dict[int, float] = {}  # id(request) -> when this feed first saw it in the intake
        # Keys of in-flight requests the LLM lost to running out of device memory, to be decoded again
        # before anything new (`StreamingScheduler._decode_again`), and of those that already were once.
        self.again: list[int] = []
        self.decoded_again: set[int] = set()

    def waiting(self) -> int:
        if self.again:
            return len(self.again)
        if self.closed or self._solo is not None or self._exclusive or self.s.vocoder.backlogged():
            return 0
        return self.s.intake.qsize()

    def take(self, n: int, wait: bool) -> list | None:
        s = self.s
        if s.stop.is_set():
            self.closed = True
            return None
        if self.again:  # taken before, lost to the LLM running out of memory: they go first
            keys, self.again = self.again[:n], self.again[n:]
            return [(key, self.inflight[key].llm) for key in keys]
        if self.closed:
            return None
        if self._exclusive or self._solo is not None:
            if not wait:
                return []
            s.vocoder.drain()  # the LLM is idle: once flow/HiFT are empty too, the solo part ends/begins
            self._exclusive = False
            if self._solo is not None:
                solo, self._solo = self._solo, None
                got = self._admit([solo])
                self._exclusive = bool(got)
                return got
        if wait:
            s.vocoder.wait_not_backlogged(s.stop)
        if s.vocoder.backlogged():
            return []  # flow/HiFT (or storage behind them) is behind: let it catch up
        if wait:  # block briefly until something arrives; `_pick` chooses among what is there
            with s.intake.not_empty:
                if not s.intake.not_empty.wait_for(lambda: len(s.intake.queue), timeout=POLL_S):
                    return []
        batch = self._pick(n)
        got = self._admit(batch) if batch else []
        if self.closed and not got:
            return None
        return got

    def _pick(self, n: int) -> list[SynthesisRequest]:
        """Up to n requests out of the intake, chosen in place (what is not chosen stays there, so the
        Pipeline can still take it back on shutdown, attempts un-counted). The scan stops at the end
        of the intake (None: the feed closes once what precedes it is taken) or at a solo request
        (held until the LLM and the vocoder are empty). Among what precedes that, requests that have
        waited over MAX_WAIT_S go first, then the longest texts (LONGEST_FIRST): long sequences started
        early do not end the work decoding alone."""
        q = self.s.intake
        now = time.monotonic()
        with q.mutex:
            ready: list[int] = []
            stop_at = None
            for i, req in enumerate(q.queue):
                if req is None or req.solo:
                    stop_at = i
                    break
                ready.append(i)
            seen = {id(q.queue[i]): self._seen.get(id(q.queue[i]), now) for i in ready}
            self._seen = seen
            if LONGEST_FIRST:
                def order(i: int) -> tuple:
                    req = q.queue[i]
                    waited = now - seen[id(req)]
                    return (0, -waited) if waited >= MAX_WAIT_S else (1, longest_first(req.text))
                ready.sort(key=order)
            chosen = sorted(ready[:n])
            batch = [q.queue[i] for i in chosen]
            for i in reversed(chosen):
                del q.queue[i]
            if stop_at is not None and len(chosen) == len(ready):  # everything before the marker is taken
                marker = q.queue[0]
                if marker is None:
                    self.closed = True
                else:
                    self._solo = marker
                    q.queue.popleft()
            for req in batch:
                self._seen.pop(id(req), None)
        return batch

    def _admit(self, batch: list[SynthesisRequest]) -> list:
        s = self.s
        began = time.perf_counter()
        if s.admit is not None:
            batch = s.admit(batch)
        out = []
        for req in batch:
            try:
                item = s.engine.item(req)
            except (LookupError, ValueError) as e:  # a missing/bad voice or text fails that segment only
                s.emit(SynthesisResult(req, None, f"{type(e).__name__}: {e}"))
                continue
            self._keys += 1
            self.inflight[self._keys] = item
            out.append((self._keys, item.llm))
        # The LLM thread's host time for this admission: no decode step is launched meanwhile.
        timeline.event("llm_admit_ms", round(1000 * (time.perf_counter() - began)))
        return out


class _Vocoder:
    """Flow + HiFT in a thread of their own, on their own CUDA stream, over length buckets."""

    def __init__(self, sched: "StreamingScheduler"):
        self.s = sched
        self.flow_batch = sched.engine.flow_batch
        self.limit = max(2 * self.flow_batch, sched.engine.max_batch)  # finished rows before the intake pauses
        self.buckets: dict[int, list] = {}
        self.since: dict[int, float] = {}  # bucket -> when its oldest row arrived
        self.pending = 0  # rows handed over and not yet emitted
        self.rendering = 0  # threads rendering a batch now
        self.cv = threading.Condition()
        self.launch = threading.Lock()  # LAUNCH_LOCK
        self.draining = 0
        self.closing = False
        self.last_observed = time.perf_counter()
        # The most padded speech tokens (rows x the longest row's tokens) a batch may hold: None until a
        # batch runs out of device memory, then half of that batch's (`_shrink`). Why: flow_batch comes
        # from the LLM's rows, not from what flow and HiFT hold, and a card with less free memory than
        # the one measured (or long rows, whose activations grow with their length and the encoder's
        # scores with its square) would otherwise fail such batches on every job, each retried row by row.
        self.token_budget: int | None = None
        self.regrow_step = 0  # tokens the budget grows per batch that used it (BUDGET_REGROW_STEPS)
        flow = getattr(sched.engine, "flow", None)
        self.flow_device = flow.encoder_proj.weight.device if flow is not None else None  # None: an engine without one
        n = getattr(sched.engine, "vocoder_threads", None)
        if n is None:
            on_gpu = self.flow_device is not None and self.flow_device.type == "cuda"
            n = VOCODER_THREADS if on_gpu else CPU_VOCODER_THREADS
        self.threads = [threading.Thread(target=self._loop, args=(i == 0,), name=f"flow-hift-{i}", daemon=True)
                        for i in range(max(1, n))]

    # -- the LLM thread's side -----------------------------------------------------------------------

    def put(self, item) -> None:
        with self.cv:
            if not self.pending:  # the vocoder had nothing: how long its first row waits for a batch (the timeline)
                timeline.event("vocoder_first_row", 1)
            key = length_bucket(len(item.tokens))
            self.buckets.setdefault(key, []).append(item)
            self.since.setdefault(key, time.perf_counter())
            self.pending += 1
            self.cv.notify_all()

    def backlogged(self) -> bool:
        return self.pending >= self.limit

    def wait_not_backlogged(self, stop: threading.Event) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.pending < self.limit or stop.is_set(), timeout=POLL_S)

    def drain(self) -> None:
        """Run every partial bucket now and wait until all rows handed over are emitted."""
        with self.cv:
            self.draining += 1
            self.cv.notify_all()
            try:
                self.cv.wait_for(lambda: self.pending == 0 or not any(t.is_alive() for t in self.threads))
            finally:
                self.draining -= 1

    def close(self) -> None:
        with self.cv:
            self.closing = True
            self.cv.notify_all()
        for t in self.threads:
            t.join()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    # -- the vocoder thread ----------------------------------------------------------------------------

    def _next(self, primary: bool = True, wait: bool = True) -> tuple[list, float] | None:
        """The next batch to run and when its oldest row arrived; None once closing and empty (or, not
        waiting, when nothing may run now). A thread that is not the `primary` one leaves partial
        buckets to it while the LLM has work."""
        with self.cv:
            while True:
                got = self._choose(time.perf_counter(), primary)
                if got is not None:
                    self.rendering += 1
                    return self._fit(*got)
                if not wait or not self.buckets and self.closing:
                    return None
                self.cv.wait(timeout=0.02 if self.buckets else 0.2)

    def _choose(self, now: float, primary: bool) -> tuple[list, float] | None:
        """`_next`'s choice among the buckets now (under the lock), or None to wait."""
        full = [k for k, rows in self.buckets.items() if len(rows) >= self.flow_batch]
        if full:
            key = max(full)
            rows, started = self.buckets[key], self.since[key]
            batch, self.buckets[key] = rows[: self.flow_batch], rows[self.flow_batch :]
            if not self.buckets[key]:
                del self.buckets[key], self.since[key]
            else:
                self.since[key] = now
            return batch, started
        if not self.buckets:
            return None
        if TAIL_MERGE and self._llm_nearly_done():
            return self._tail()
        key = self._partial(now, primary)
        if key is None:
            return None
        return self._half_of_last(key) or (self.buckets.pop(key), self.since.pop(key))

    def _fit(self, batch: list, started: float) -> tuple[list, float]:
        """The batch cut to `token_budget` (one row at least); the rows cut go back to the front of
        their buckets, pending still (under the lock)."""
        if self.token_budget is None or len(batch) < 2:
            return batch, started
        longest = max(len(item.tokens) for item in batch)
        keep = max(1, self.token_budget // max(1, longest))
        for item in reversed(batch[keep:]):
            key = length_bucket(len(item.tokens))
            self.buckets.setdefault(key, []).insert(0, item)
            self.since[key] = min(self.since.get(key, started), started)
        return batch[:keep], started

    def _shrink(self, batch: list) -> None:
        """A batch ran out of device memory: later batches hold at most half of its padded tokens."""
        tokens = padded_tokens(batch)
        with self.cv:
            if self.token_budget is not None and self.token_budget <= tokens // 2:
                return  # another thread lowered it already, as far or further
            self.token_budget = max(1, tokens // 2)
            self.regrow_step = self.token_budget // BUDGET_REGROW_STEPS if BUDGET_REGROW_STEPS else 0
        timeline.event("vocode_oom", len(batch))
        timeline.event("vocode_budget", self.token_budget)
        log.warning("a flow/HiFT batch of %d rows (%d padded speech tokens) ran out of device memory; it is "
                    "rendered in halves and batches hold at most %d tokens from now on", len(batch), tokens,
                    self.token_budget)

    def _regrow(self, batch: list) -> None:
        """A batch rendered whole: the budget grows by `regrow_step` where the batch used at least half
        of it (a batch well under the budget says nothing about what more would need)."""
        if not self.regrow_step:  # BUDGET_REGROW_STEPS off, or nothing failed yet: nothing to do per batch
            return
        tokens = padded_tokens(batch)
        with self.cv:
            if self.token_budget is None or 2 * tokens < self.token_budget:
                return
            self.token_budget += self.regrow_step
            budget = self.token_budget
        timeline.event("vocode_budget", budget)

    def _partial(self, now: float, primary: bool = True) -> int | None:
        """The bucket to run before it is full (the vocoder is idle here), or None to wait: the longest
        when the LLM has too little left to fill a bucket; else the longest of those whose oldest row
        waited FLUSH_AFTER_S; else the fullest holding flow_batch / IDLE_BATCH_DIV rows, rather than
        leaving flow/HiFT's stream empty while it fills (the start of the work, gaps later); with no
        thread rendering at all, flow_batch / START_BATCH_DIV rows where that is set."""
        if self._llm_nearly_done():
            return max(self.buckets)
        old = [k for k, t in self.since.items() if now - t >= FLUSH_AFTER_S]
        if old:
            return max(old)
        if IDLE_BATCH_DIV and primary:
            fullest = max(self.buckets, key=lambda k: len(self.buckets[k]))
            div = max(IDLE_BATCH_DIV, START_BATCH_DIV) if not self.rendering else IDLE_BATCH_DIV
            if len(self.buckets[fullest]) >= max(1, self.flow_batch // div):
                return fullest
        return None

    def _half_of_last(self, key: int) -> tuple[list, float] | None:
        """TAIL_SPLIT: half of the last bucket (`key`), when the LLM has nothing left and another thread
        is rendering; None to take the bucket whole."""
        rows = self.buckets[key]
        if not TAIL_SPLIT or len(self.buckets) > 1 or not self.rendering or len(rows) < 2 * TAIL_SPLIT_MIN:
            return None
        if self.s.llm_rows():
            return None
        n = (len(rows) + 1) // 2
        self.buckets[key] = rows[n:]
        return rows[:n], self.since[key]

    def _llm_nearly_done(self) -> bool:
        """Too little left in the LLM and the intake to fill a flow bucket (or a drain/close asks)."""
        return bool(self.draining or self.closing or self.s.llm_rows() < self.flow_batch)

    def _tail(self) -> tuple[list, float]:
        """The longest bucket plus, longest first, the rows of the buckets within a doubling of its
        length, up to flow_batch rows (TAIL_MERGE); the batch's start is its oldest row's."""
        top = max(self.buckets)
        batch: list = []
        started = self.since[top]
        for key in sorted((k for k in self.buckets if k > top - BUCKETS_PER_OCTAVE), reverse=True):
            rows = self.buckets[key]
            n = self.flow_batch - len(batch)
            batch += rows[:n]
            started = min(started, self.since[key])
            if len(rows) <= n:
                del self.buckets[key], self.since[key]
            else:
                self.buckets[key], self.since[key] = rows[n:], time.perf_counter()
                break
        return batch, started

    def _loop(self, primary: bool = True) -> None:
        engine = self.s.engine
        priority = vocoder_stream_priority(primary)
        with ExitStack() as stack:
            for dev in {engine.flow.encoder_proj.weight.device, engine.hift.conv_pre.weight.device}:
                if dev.type == "cuda":
                    stack.enter_context(torch.cuda.stream(torch.cuda.Stream(dev, priority=priority)))
            if VOCODER_PIPELINE:
                self._pipelined(primary)
                return
            unfinished: list[tuple] = []  # (batch, started, began, launched), oldest first: queued, not yet emitted
            try:
                while True:
                    # With a batch in flight (VOCODER_LOOKAHEAD) this thread is not idle: the secondary's rule.
                    nxt = self._next(primary and not unfinished, wait=not unfinished)
                    if nxt is None and not unfinished:
                        break  # closing, and nothing left
                    if nxt is not None:
                        unfinished.append(self._launch(*nxt))
                    while unfinished and (len(unfinished) > 1 or nxt is None or not VOCODER_LOOKAHEAD):
                        self._finish(*unfinished.pop(0))  # its rows stop being pending there, even if it raises
            finally:
                for batch, *_ in unfinished:  # the loop died (e.g. `emit` raised): nobody will emit these
                    self._done(batch)

    def _pipelined(self, primary: bool) -> None:
        """VOCODER_PIPELINE's loop, on this thread's stream: begin the next batch while the current
        one's steps run, queue its steps behind the current one's HiFT, then wait for and emit the
        current one."""
        current = None  # (batch, started, began, begun or the exception it raised): steps queued
        following = None  # the same, begun and its steps not queued yet
        try:
            while True:
                if current is None:
                    nxt = self._next(primary)
                    if nxt is None:
                        break  # closing, and nothing left
                    current = self._steps(self._begin(*nxt))
                nxt = self._next(False, wait=False)  # busy: the secondary's rule
                following = self._begin(*nxt) if nxt is not None else None
                launched, current = self._launch(*current), None
                if following is not None:
                    current, following = self._steps(following), None
                self._finish(*launched)  # its rows stop being pending there, even if it raises
        finally:
            for entry in (current, following):  # the loop died (e.g. `emit` raised): nobody will emit these
                if entry is not None:
                    self._done(entry[0])

    def _begin(self, batch: list, started: float) -> tuple:
        """`engine.vocode_begin` on a batch: (batch, started, began, the begun batch or the exception it
        raised)."""
        timeline.event("vocode_start", len(batch))
        began = time.perf_counter()
        try:
            begun = self.s.engine.vocode_begin(batch)
        except Exception as e:  # noqa: BLE001 - rendered again in _finish
            begun = self._failed(batch, e)
        return batch, started, began, begun

    def _steps(self, entry: tuple) -> tuple:
        """Queue a begun batch's ODE steps; the entry with the exception instead where that raised."""
        batch, started, began, begun = entry
        if not isinstance(begun, Exception):
            try:
                begun.finish()
            except Exception as e:  # noqa: BLE001 - rendered again in _finish
                begun = self._failed(batch, e)
        return batch, started, began, begun

    def _launch(self, batch: list, started: float, began: float | None = None, begun=None) -> tuple:
        """Queue a batch's GPU work (`engine.vocode_launch`; after `_begin`, its `begun` flow): (batch,
        started, began, the queued batch or the exception it raised)."""
        if began is None:
            timeline.event("vocode_start", len(batch))
            began = time.perf_counter()
        if isinstance(begun, Exception):
            return batch, started, began, begun
        gate = _LaunchGate(self.launch if LAUNCH_LOCK and len(self.threads) > 1 else None)
        try:
            with gate:
                launched = self.s.engine.vocode_launch(batch, queued=gate.release, begun=begun)
        except Exception as e:  # noqa: BLE001 - rendered again in _finish
            launched = self._failed(batch, e)
        return batch, started, began, launched

    def _finish(self, batch: list, started: float, began: float, launched) -> None:
        """Wait for a launched batch's audio and emit it; a failed batch is rendered again (`_retry`).
        Its rows stop counting as pending whatever happens."""
        s = self.s
        try:
            try:
                if isinstance(launched, Exception):
                    raise launched
                results = launched.results()
                self._regrow(batch)
            except Exception as e:  # noqa: BLE001
                results = self._retry(batch, e)
            timeline.event("vocode_ms", round(1000 * (time.perf_counter() - began)))  # rendered, before the emits
            audio_s = 0.0
            for r in results:
                if r.audio is not None:
                    audio_s += len(r.audio) / s.engine.sample_rate
                s.emit(r)
            timeline.event("vocode_end", len(batch))
            timeline.allocator_probe(self.flow_device)
            now = time.perf_counter()
            if s.observe is not None:  # wall: since the previous batch was out, or since this one's first row
                s.observe(len(batch), audio_s, now - max(self.last_observed, started))
            self.last_observed = now
        finally:
            self._done(batch)

    def _failed(self, batch: list, e: Exception) -> Exception:
        """`e`, raised while queueing `batch`, kept for `_finish`; out of device memory, the failed attempt's
        tensors go back to the allocator and the budget comes down at once, before this thread or the other
        chooses and begins another batch."""
        if is_out_of_memory(e) and len(batch) > 1:
            _drop_frames(e)
            self._shrink(batch)
        return e

    def _retry(self, batch: list, e: Exception) -> list[SynthesisResult]:
        """The results of a batch that raised `e`, rendered again: in halves after the device ran out of
        memory (each half again so, and `token_budget` lowered), else row by row so that one bad segment
        fails alone; a single row, or every row of a lost engine, fails with `e`."""
        if len(batch) == 1 or is_engine_lost(e):
            return [SynthesisResult.failed(item.request, e) for item in batch]
        if is_out_of_memory(e):
            self._failed(batch, e)  # a failure while waiting for the audio has not been through it yet
            half = len(batch) // 2
            parts = [batch[:half], batch[half:]]
        else:
            parts = [[item] for item in batch]
        results: list[SynthesisResult] = []
        for part in parts:
            try:
                results += list(self.s.engine.vocode(part))
            except Exception as e1:  # noqa: BLE001
                results += self._retry(part, e1)
        return results

    def _done(self, batch: list) -> None:
        """A batch taken by `_next` is out of the vocoder (emitted, failed or abandoned)."""
        with self.cv:
            self.pending -= len(batch)
            self.rendering -= 1
            self.cv.notify_all()


def _drop_frames(e: BaseException | None) -> None:
    """Let go of the frames `e` and the exceptions chained to it were raised through (their locals)."""
    for x in list(exception_chain(e)):
        x.__traceback__ = None


class _LaunchGate:
    """LAUNCH_LOCK for one batch: held from entry until `release` (all GPU work queued) or exit."""

    def __init__(self, lock: threading.Lock | None):
        self.lock, self.held = lock, False

    def __enter__(self) -> "_LaunchGate":
        if self.lock is not None:
            self.lock.acquire()
            self.held = True
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self.lock.release()

    def __exit__(self, *exc) -> None:
        self.release()


class StreamingScheduler:
    """One `serve` call of the CosyVoice2 engine (see the module docstring)."""

    def __init__(self, engine, intake: "queue.Queue[SynthesisRequest | None]", emit: Callable[[SynthesisResult], None],
                 stop: threading.Event, observe: Callable[[int, float, float], None] | None = None,
                 admit: Callable[[list[SynthesisRequest]], list[SynthesisRequest]] | None = None):
        self.engine, self.intake, self.emit, self.stop = engine, intake, emit, stop
        self.observe, self.admit = observe, admit
        self.feed = _Feed(self)
        self.vocoder = _Vocoder(self)

    def llm_rows(self) -> int:
        """Rows the LLM is decoding now plus requests waiting in the intake: the work that could still
        join a partial flow bucket."""
        return len(self.feed.inflight) + self.intake.qsize()

    def run(self) -> None:
        self.vocoder.start()
        try:
            with ExitStack() as stack:
                dev = getattr(self.engine.llm, "device", None)  # the torch backend's; vLLM keeps its own streams
                if dev is not None and dev.type == "cuda":
                    stack.enter_context(torch.cuda.stream(torch.cuda.Stream(dev, priority=llm_stream_priority())))
                self._decode()
        finally:
            self.vocoder.close()

    def _decode(self) -> None:
        """The LLM thread: stream finished rows to the vocoder until the intake ends."""
        while not self.feed.closed or self.feed.again:
            try:
                for key, tokens in self.engine.llm.stream(self.feed):
                    self._finished_row(key, tokens)
            except Exception as e:  # noqa: BLE001 - what the LLM was decoding is rendered alone
                if is_engine_lost(e):  # nothing can render here any more: what was in flight is lost with it
                    self._lost_in_flight(e)
                    continue
                if is_out_of_memory(e):
                    self._decode_again(e)
                    continue
                log.warning("LLM batch failed (%s: %s); rendering its %d requests one at a time",
                            type(e).__name__, e, len(self.feed.inflight))
                self._one_at_a_time(list(self.feed.inflight))
                continue
            break

    def _decode_again(self, e: Exception) -> None:
        """The LLM ran out of device memory (a prefill beside flow/HiFT's batches): once the vocoder has
        rendered what it holds, and so let go of its memory, what the LLM was decoding is decoded again,
        batched, before anything new; a request lost so a second time renders alone. Why: rendering all
        of it alone, as any other LLM failure is, took one worker's job from ~14 s to 72 s when a
        prefill ran out under a 24 GiB cap with 128 requests in flight (gpu_h100_s47b.json,
        `card=24,regrow=8`)."""
        _drop_frames(e)  # the failed step's frames hold its activations
        keys = list(self.feed.inflight)
        waiting = set(self.feed.again)  # requeued before and not yet taken again: not lost a second time
        alone = [key for key in keys if key in self.feed.decoded_again and key not in waiting]
        again = [key for key in keys if key not in alone]
        log.warning("the LLM ran out of device memory (%s); decoding its %d requests again once flow/HiFT have "
                    "drained, %d of them alone", type(e).__name__, len(keys), len(alone))
        timeline.event("llm_oom", len(keys))
        self.vocoder.drain()
        if alone:
            self._one_at_a_time(alone)
        self.feed.decoded_again.update(again)
        self.feed.again = again

    def _finished_row(self, key: int, tokens: list[int]) -> None:
        item = self.feed.inflight.pop(key)
        self.feed.decoded_again.discard(key)
        if not tokens:
            self.emit(SynthesisResult(item.request, None, "the LLM stopped before any speech token"))
            return
        item.tokens = tokens
        self.vocoder.put(item)
        if not self.feed.inflight and not self.intake.qsize():  # the LLM is out of work: flow/HiFT alone from here
            timeline.event("llm_done", 0)

    def _lost_in_flight(self, e: Exception) -> None:
        """The LLM can serve nothing more (`is_engine_lost`): each request it held comes back marked so."""
        items, self.feed.inflight, self.feed.again = list(self.feed.inflight.values()), {}, []
        self.feed.decoded_again.clear()
        for item in items:
            self.emit(SynthesisResult.failed(item.request, e))

    def _one_at_a_time(self, keys: list[int]) -> None:
        """The in-flight requests `keys`, each rendered alone once flow/HiFT are empty."""
        self.vocoder.drain()
        items = [self.feed.inflight.pop(key) for key in keys]
        self.feed.again = [key for key in self.feed.again if key in self.feed.inflight]
        self.feed.decoded_again.difference_update(keys)
        for item in items:
            try:
                results = list(self.engine._run([item]))
            except Exception as e:  # noqa: BLE001
                results = [SynthesisResult.failed(item.request, e)]
            for r in results:
                self.emit(r)
