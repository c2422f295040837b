"""Job state: per-job counters and per-segment completion, in Redis (or in memory for `voxbatch render`).

Redis key layout (all keys of a job share the `{<job>}` hash tag, so a job lives on one cluster slot):

    vb:jobs                     zset   job id -> created_at                 (`voxbatch jobs`)
    vb:load                     string segments queued + reserved + running, all jobs (autoscaling signal)
    vb:job:{<job>}              hash   name, voice, format, state, total, done, failed, audio_ms,
                                       created_at, updated_at, assemble (0/1: the one assemble claimed),
                                       swept, swept_at (segments the sweeper re-enqueued, and when last)
    vb:job:{<job>}:done         set    ids of segments stored
    vb:job:{<job>}:failed       hash   segment id -> final error
    vb:job:{<job>}:attempts     hash   segment id -> attempts started (survives worker crashes); an attempt
                                       given back unstarted (graceful shutdown, refused poison) is un-counted
    vb:job:{<job>}:errors       hash   segment id -> last error seen (kept while retrying)
    vb:job:{<job>}:reused       set    ids of segments whose audio came from the content cache (reuse.py)
    vb:workers                  hash   worker name -> JSON {"beat": unix s, "took": unix s or 0, "queues"}:
                                       each render worker rewrites its field every `worker_heartbeat_s`;
                                       a field older than 3 beats is a dead worker (`status`, `jobs`
                                       say so when no worker is alive or none has taken work for a while)

A job hash may also hold `reason`: why a job ended `failed` (e.g. the assembler could not read it).

Every step that touches several keys is one Lua script, so two workers finishing the last two
segments at the same moment cannot both (or neither) enqueue the assembly: `finish` returns 1 to
exactly one caller, the one that moved the job to `assembling`.

`MemoryJobStore` keeps the same state machine in one process for `voxbatch render`; the contract
tests (tests/test_jobstate_contract.py) run the same cases against both, so the two cannot drift.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod

import redis

from voxbatch.models import JobState, JobStatus

FINISHED = ("completed", "completed_with_errors", "cancelled", "failed")

# KEYS: job hash, done set, failed hash, load.  ARGV: segment id, outcome ("done"|"failed"), audio_ms, error, now
# Returns: 1 when this call finished the job's last segment (the caller enqueues the assembly),
# 0 when recorded, -1 when the job is cancelled/unknown, -2 when the segment was already recorded.
_FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'cancelled' then return -1 end
local seg, outcome = ARGV[1], ARGV[2]
if redis.call('SISMEMBER', KEYS[2], seg) == 1 then return -2 end
if outcome == 'done' then
  redis.call('SADD', KEYS[2], seg)
  if redis.call('HDEL', KEYS[3], seg) == 1 then
    redis.call('HINCRBY', KEYS[1], 'failed', -1)
  else
    redis.call('DECR', KEYS[4])
  end
  redis.call('HINCRBY', KEYS[1], 'done', 1)
  redis.call('HINCRBY', KEYS[1], 'audio_ms', tonumber(ARGV[3]))
else
  if redis.call('HSETNX', KEYS[3], seg, ARGV[4]) == 0 then return -2 end
  redis.call('HINCRBY', KEYS[1], 'failed', 1)
  redis.call('DECR', KEYS[4])
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[5])
if state == 'queued' then redis.call('HSET', KEYS[1], 'state', 'running') end
local total = tonumber(redis.call('HGET', KEYS[1], 'total'))
local done = tonumber(redis.call('HGET', KEYS[1], 'done'))
local failed = tonumber(redis.call('HGET', KEYS[1], 'failed'))
if done + failed >= total and redis.call('HGET', KEYS[1], 'assemble') == '0' then
  redis.call('HSET', KEYS[1], 'assemble', '1', 'state', 'assembling')
  return 1
end
return 0
"""

# KEYS: job hash, load.  ARGV: now.  Cancels a job; outstanding segments leave the load counter.
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state == 'completed' or state == 'completed_with_errors' or state == 'cancelled' then return 0 end
local h = redis.call('HMGET', KEYS[1], 'total', 'done', 'failed')
local left = tonumber(h[1]) - tonumber(h[2]) - tonumber(h[3])
redis.call('DECRBY', KEYS[2], left)
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'updated_at', ARGV[1])
return 1
"""

# KEYS: job hash, done set, failed hash, attempts hash, errors hash, load.  ARGV: now, segment ids...
# Re-opens a job for the given segments (failed or missing); returns how many were re-opened.
_REOPEN = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
local h = redis.call('HMGET', KEYS[1], 'total', 'done', 'failed')
local outstanding = tonumber(h[1]) - tonumber(h[2]) - tonumber(h[3])
if state == 'cancelled' then outstanding = 0 end
local n = 0
for i = 2, #ARGV do
  local seg = ARGV[i]
  if redis.call('SISMEMBER', KEYS[2], seg) == 0 then
    if redis.call('HDEL', KEYS[3], seg) == 1 then redis.call('HINCRBY', KEYS[1], 'failed', -1) end
    redis.call('HDEL', KEYS[4], seg)
    redis.call('HDEL', KEYS[5], seg)
    n = n + 1
  end
end
local h2 = redis.call('HMGET', KEYS[1], 'total', 'done', 'failed')
local now_outstanding = tonumber(h2[1]) - tonumber(h2[2]) - tonumber(h2[3])
redis.call('INCRBY', KEYS[6], now_outstanding - outstanding)
if n > 0 or state == 'cancelled' or state == 'assembling' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'assemble', '0', 'updated_at', ARGV[1])
end
return n
"""


class JobStore(ABC):
    """What the worker pipeline and the producer need to know and record about jobs."""

    @abstractmethod
    def create(self, job_id: str, name: str, voice: str, fmt: str, total: int, created_at: float) -> None: ...

    @abstractmethod
    def begin_attempt(self, job_id: str, seg_id: str) -> int:
        """Count one more attempt at a segment; returns the attempts so far, this one included."""

    def begin_attempts(self, segments: list[tuple[str, str]]) -> list[int]:
        """`begin_attempt` for many (job, segment) pairs at once: one engine batch, one round trip."""
        return [self.begin_attempt(job_id, seg_id) for job_id, seg_id in segments]

    @abstractmethod
    def forget_attempt(self, job_id: str, seg_id: str) -> None:
        """Un-count an attempt that never reached the engine (its task was handed back, or refused)."""

    @abstractmethod
    def note_error(self, job_id: str, seg_id: str, error: str) -> None: ...

    @abstractmethod
    def last_error(self, job_id: str, seg_id: str) -> str | None: ...

    @abstractmethod
    def finish(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None) -> int:
        """Record a segment stored (error None) or failed for good. See `_FINISH` for the return codes."""

    @abstractmethod
    def is_done(self, job_id: str, seg_id: str) -> bool: ...

    @abstractmethod
    def state_and_done(self, job_id: str, seg_ids: list[str]) -> tuple[JobState | None, list[bool]]:
        """`state` and `is_done` of each of `seg_ids`, in one call (one round trip): what a worker asks
        once per task at intake (cancelled? which segments are done?) and once per segment before it
        stores one (a cancelled job, or another delivery that stored it meanwhile). An unknown job:
        (None, all False)."""

    @abstractmethod
    def mark_reused(self, job_id: str, seg_id: str) -> None:
        """Note that a segment's audio was copied from the cache (before it is recorded done)."""

    @abstractmethod
    def reused_ids(self, job_id: str) -> set[str]: ...

    @abstractmethod
    def state(self, job_id: str) -> JobState | None: ...

    @abstractmethod
    def set_state(self, job_id: str, state: JobState) -> None: ...

    @abstractmethod
    def status(self, job_id: str) -> JobStatus | None: ...

    @abstractmethod
    def done_ids(self, job_id: str) -> set[str]:
        """Ids of the segments recorded stored."""

    @abstractmethod
    def failed(self, job_id: str) -> dict[str, str]:
        """Segment id -> final error, for the segments recorded failed."""

    @abstractmethod
    def cancel(self, job_id: str) -> int:
        """Cancel a job: 1 when cancelled now, 0 when it had already finished, -1 when unknown."""

    @abstractmethod
    def reopen(self, job_id: str, seg_ids: list[str]) -> int:
        """Re-open a job for the given segments (failed or missing; done ones are left alone), with
        fresh attempts; returns how many were re-opened, -1 when the job is unknown."""


class RedisJobStore(JobStore):
    def __init__(self, client: redis.Redis):
        self.r = client
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._reopen = client.register_script(_REOPEN)

    @classmethod
    def from_url(cls, url: str) -> "RedisJobStore":
        return cls(redis.Redis.from_url(url, decode_responses=True, health_check_interval=30))

    @staticmethod
    def _k(job_id: str, part: str = "") -> str:
        return f"vb:job:{{{job_id}}}{':' + part if part else ''}"

    def create(self, job_id: str, name: str, voice: str, fmt: str, total: int, created_at: float) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.hset(self._k(job_id), mapping={
                "name": name, "voice": voice, "format": fmt, "state": "queued", "total": total, "done": 0,
                "failed": 0, "audio_ms": 0, "created_at": created_at, "updated_at": created_at, "assemble": 0,
            })
            p.zadd("vb:jobs", {job_id: created_at})
            p.incrby("vb:load", total)
            p.execute()

    def begin_attempt(self, job_id: str, seg_id: str) -> int:
        return int(self.r.hincrby(self._k(job_id, "attempts"), seg_id, 1))

    def begin_attempts(self, segments: list[tuple[str, str]]) -> list[int]:
        with self.r.pipeline(transaction=False) as p:
            for job_id, seg_id in segments:
                p.hincrby(self._k(job_id, "attempts"), seg_id, 1)
            return [int(n) for n in p.execute()]

    def forget_attempt(self, job_id: str, seg_id: str) -> None:
        self.r.hincrby(self._k(job_id, "attempts"), seg_id, -1)

    def note_error(self, job_id: str, seg_id: str, error: str) -> None:
        self.r.hset(self._k(job_id, "errors"), seg_id, error[:2000])

    def last_error(self, job_id: str, seg_id: str) -> str | None:
        return self.r.hget(self._k(job_id, "errors"), seg_id)

    def finish(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None) -> int:
        keys = [self._k(job_id), self._k(job_id, "done"), self._k(job_id, "failed"), "vb:load"]
        args = [seg_id, "failed" if error else "done", round(audio_s * 1000), (error or "")[:2000], time.time()]
        return int(self._finish(keys=keys, args=args))

    def is_done(self, job_id: str, seg_id: str) -> bool:
        return bool(self.r.sismember(self._k(job_id, "done"), seg_id))

    def state_and_done(self, job_id: str, seg_ids: list[str]) -> tuple[JobState | None, list[bool]]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self._k(job_id), "state")
        if seg_ids:
            pipe.smismember(self._k(job_id, "done"), seg_ids)  # Redis >= 6.2
        state, *done = pipe.execute()
        return state, [bool(x) for x in done[0]] if seg_ids else []

    def done_ids(self, job_id: str) -> set[str]:
        return set(self.r.smembers(self._k(job_id, "done")))

    def mark_reused(self, job_id: str, seg_id: str) -> None:
        self.r.sadd(self._k(job_id, "reused"), seg_id)

    def reused_ids(self, job_id: str) -> set[str]:
        return set(self.r.smembers(self._k(job_id, "reused")))

    def failed(self, job_id: str) -> dict[str, str]:
        return dict(self.r.hgetall(self._k(job_id, "failed")))

    def state(self, job_id: str) -> JobState | None:
        return self.r.hget(self._k(job_id), "state")  # type: ignore[return-value]

    def set_state(self, job_id: str, state: JobState) -> None:
        self.r.hset(self._k(job_id), mapping={"state": state, "updated_at": time.time()})

    def cancel(self, job_id: str) -> int:
        return int(self._cancel(keys=[self._k(job_id), "vb:load"], args=[time.time()]))

    def discard(self, job_id: str) -> None:
        """Remove a job that never got going (a submit that failed half-way): its outstanding segments
        leave the load counter, then every key of the job goes; tasks already queued find no job and skip."""
        self.cancel(job_id)
        parts = ("", "done", "failed", "attempts", "errors", "reused")
        with self.r.pipeline(transaction=True) as p:
            p.delete(*(self._k(job_id, part) for part in parts))
            p.zrem("vb:jobs", job_id)
            p.execute()

    def reopen(self, job_id: str, seg_ids: list[str]) -> int:
        keys = [self._k(job_id, p) for p in ("", "done", "failed", "attempts", "errors")] + ["vb:load"]
        return int(self._reopen(keys=keys, args=[time.time(), *seg_ids]))

    def note_swept(self, job_id: str, n: int) -> None:
        """Record that the sweeper re-enqueued `n` of the job's segments (shown by `voxbatch status`)."""
        with self.r.pipeline(transaction=True) as p:
            p.hincrby(self._k(job_id), "swept", n)
            p.hset(self._k(job_id), "swept_at", time.time())
            p.execute()

    def progress(self, job_ids: list[str]) -> dict[str, tuple[str, int, int, int]]:
        """job id -> (state, total, done, failed) for the jobs that exist, in one round trip."""
        with self.r.pipeline(transaction=False) as p:
            for job_id in job_ids:
                p.hmget(self._k(job_id), "state", "total", "done", "failed")
            rows = p.execute()
        return {j: (r[0], int(r[1]), int(r[2]), int(r[3])) for j, r in zip(job_ids, rows) if r[0] is not None}

    def status(self, job_id: str) -> JobStatus | None:
        h = self.r.hgetall(self._k(job_id))
        if not h:
            return None
        errors = dict(self.r.hgetall(self._k(job_id, "failed")))
        return JobStatus(
            id=job_id, name=h["name"], state=h["state"], total=int(h["total"]), done=int(h["done"]),
            failed=int(h["failed"]), audio_s=int(h["audio_ms"]) / 1000, created_at=float(h["created_at"]),
            updated_at=float(h["updated_at"]), errors=errors, reused=int(self.r.scard(self._k(job_id, "reused"))),
            swept=int(h.get("swept", 0)),
            reason=h.get("reason"),
        )

    def worker_beat(self, name: str, took: float, queues: str) -> None:
        """A render worker is alive; `took` is when its engine last took segments (0: never)."""
        self.r.hset("vb:workers", name, json.dumps({"beat": time.time(), "took": took, "queues": queues}))

    def workers(self, beat_s: float) -> dict[str, dict]:
        """Live workers (heartbeat within 3 beats) -> their last beat; dead fields are pruned."""
        now, live, dead = time.time(), {}, []
        for name, raw in self.r.hgetall("vb:workers").items():
            try:
                beat = json.loads(raw)
                alive = now - float(beat["beat"]) <= 3 * beat_s
            except (ValueError, KeyError, TypeError):
                alive = False
            (live.__setitem__(name, beat) if alive else dead.append(name))
        if dead:
            self.r.hdel("vb:workers", *dead)
        return live

    def last_errors(self, job_id: str) -> dict[str, str]:
        """Segment id -> the last error of a segment still being retried (or failed)."""
        return dict(self.r.hgetall(self._k(job_id, "errors")))

    def set_reason(self, job_id: str, reason: str) -> None:
        """Why a job failed, for `voxbatch status` (the assembler's error, not only its log)."""
        self.r.hset(self._k(job_id), "reason", reason[:2000])

    def job_ids(self, limit: int = 50) -> list[str]:
        return list(self.r.zrevrange("vb:jobs", 0, limit - 1))

    def load(self) -> int:
        return int(self.r.get("vb:load") or 0)


class MemoryJobStore(JobStore):
    """The same bookkeeping in one process, for `voxbatch render` (no Redis)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict] = {}

    def create(self, job_id: str, name: str, voice: str, fmt: str, total: int, created_at: float) -> None:
        with self._lock:
            self._jobs[job_id] = dict(name=name, state="queued", total=total, done=set(), failed={}, attempts={},
                                      errors={}, audio_s=0.0, created_at=created_at, updated_at=created_at,
                                      assemble=False, reused=set())

    def begin_attempt(self, job_id: str, seg_id: str) -> int:
        with self._lock:
            a = self._jobs[job_id]["attempts"]
            a[seg_id] = a.get(seg_id, 0) + 1
            return a[seg_id]

    def forget_attempt(self, job_id: str, seg_id: str) -> None:
        with self._lock:
            a = self._jobs[job_id]["attempts"]
            a[seg_id] = a.get(seg_id, 0) - 1

    def note_error(self, job_id: str, seg_id: str, error: str) -> None:
        with self._lock:
            self._jobs[job_id]["errors"][seg_id] = error

    def last_error(self, job_id: str, seg_id: str) -> str | None:
        with self._lock:
            return self._jobs[job_id]["errors"].get(seg_id)

    def finish(self, job_id: str, seg_id: str, *, audio_s: float = 0.0, error: str | None = None) -> int:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or j["state"] == "cancelled":
                return -1
            if seg_id in j["done"] or (error and seg_id in j["failed"]):
                return -2
            if error:
                j["failed"][seg_id] = error
            else:
                j["failed"].pop(seg_id, None)
                j["done"].add(seg_id)
                j["audio_s"] += audio_s
            j["updated_at"] = time.time()
            if j["state"] == "queued":
                j["state"] = "running"
            if len(j["done"]) + len(j["failed"]) >= j["total"] and not j["assemble"]:
                j["assemble"], j["state"] = True, "assembling"
                return 1
            return 0

    def is_done(self, job_id: str, seg_id: str) -> bool:
        with self._lock:
            return seg_id in self._jobs[job_id]["done"]

    def state_and_done(self, job_id: str, seg_ids: list[str]) -> tuple[JobState | None, list[bool]]:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None:
                return None, [False] * len(seg_ids)
            return j["state"], [s in j["done"] for s in seg_ids]

    def failed(self, job_id: str) -> dict[str, str]:
        with self._lock:
            return dict(self._jobs[job_id]["failed"])

    def done_ids(self, job_id: str) -> set[str]:
        with self._lock:
            return set(self._jobs[job_id]["done"])

    def cancel(self, job_id: str) -> int:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None:
                return -1
            if j["state"] in ("completed", "completed_with_errors", "cancelled"):
                return 0
            j["state"], j["updated_at"] = "cancelled", time.time()
            return 1

    def reopen(self, job_id: str, seg_ids: list[str]) -> int:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None:
                return -1
            n = 0
            for seg in seg_ids:
                if seg not in j["done"]:
                    j["failed"].pop(seg, None)
                    j["attempts"].pop(seg, None)
                    j["errors"].pop(seg, None)
                    n += 1
            if n > 0 or j["state"] in ("cancelled", "assembling"):
                j["state"], j["assemble"], j["updated_at"] = "running", False, time.time()
            return n

    def mark_reused(self, job_id: str, seg_id: str) -> None:
        with self._lock:
            self._jobs[job_id]["reused"].add(seg_id)

    def reused_ids(self, job_id: str) -> set[str]:
        with self._lock:
            return set(self._jobs[job_id]["reused"])

    def state(self, job_id: str) -> JobState | None:
        with self._lock:
            j = self._jobs.get(job_id)
            return j["state"] if j else None

    def set_state(self, job_id: str, state: JobState) -> None:
        with self._lock:
            self._jobs[job_id]["state"] = state

    def status(self, job_id: str) -> JobStatus | None:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None:
                return None
            return JobStatus(id=job_id, name=j["name"], state=j["state"], total=j["total"], done=len(j["done"]),
                             failed=len(j["failed"]), audio_s=j["audio_s"], created_at=j["created_at"],
                             updated_at=j["updated_at"], errors=dict(j["failed"]), reused=len(j["reused"]))
