"""Render messages are untrusted: turn one into a task this worker may run, or discard it.

Anyone who can write to Redis can send a `voxbatch.render` message, so nothing in it is taken on
faith. The payload must parse as a `RenderTask` (bounded sizes, ids that cannot leave a job's
folder); its job must have a spec in storage that this worker can read; and each segment it names
must be a segment of that spec. What the worker then renders comes from the spec, not the message:
text, chapter, seed, voice, format, synthesis parameters and whether the content cache may be used. Storage keys are derived from
(job, segment id, format) by the pipeline (voxbatch/keys.py). So a crafted message can at most ask
for a segment of a real job to be rendered again, which the "already stored" check makes a no-op.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from pydantic import ValidationError

from voxbatch import keys
from voxbatch.models import JobSpec, RenderTask, Segment, TaskSegment
from voxbatch.outage import wait_for_service
from voxbatch.storage import Storage

log = logging.getLogger(__name__)


class Discard(Exception):
    """The message cannot become a render task; its text says why (one log line, no payload dump)."""


class SpecMissing(Discard):
    """The job's spec is not in this worker's storage: the job cannot be rendered here at all (most
    often producer and workers point at different storage); the task records that on the job."""

    def __init__(self, job_id: str, message: str):
        super().__init__(message)
        self.job_id = job_id


class SpecCache:
    """The last few job specs this worker read (jobs/<id>/job.json), with their segments by id.

    A spec is read once per job however many of its tasks arrive, also when they arrive together: a
    worker's task threads (32 at the default budget) all start on a new job at once, and each parsing
    the whole spec (megabytes for a long book) held the engine's first batch back by the sum of those
    parses. One thread reads; the others wait for it. Storage outages are waited out (`stop` ends the
    wait), a missing or unreadable spec is a `Discard`.
    """

    def __init__(self, storage: Storage, size: int = 4):
        self.storage, self.size = storage, size
        self._specs: OrderedDict[str, tuple[JobSpec, dict[str, Segment]]] = OrderedDict()
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}  # job id -> held by the thread reading its spec

    def get(self, job_id: str, stop: threading.Event | None = None) -> tuple[JobSpec, dict[str, Segment]]:
        with self._lock:
            if job_id in self._specs:
                self._specs.move_to_end(job_id)
                return self._specs[job_id]
            reading = self._reading.setdefault(job_id, threading.Lock())
        with reading:
            with self._lock:
                if job_id in self._specs:  # read by the thread this one waited for
                    self._specs.move_to_end(job_id)
                    return self._specs[job_id]
            try:
                return self._read(job_id, stop)
            finally:
                with self._lock:
                    self._reading.pop(job_id, None)

    def _read(self, job_id: str, stop: threading.Event | None) -> tuple[JobSpec, dict[str, Segment]]:
        key = keys.job_spec(job_id)
        try:
            raw = wait_for_service(lambda: self.storage.get(key), f"job {job_id}: reading its spec", log=log,
                                   stop=stop)
        except KeyError:
            raise SpecMissing(job_id, f"job {job_id} has no spec at {self.storage.describe(key)}") from None
        try:
            spec = JobSpec.model_validate_json(raw)
        except ValidationError as e:
            raise Discard(f"job {job_id}: its spec does not parse ({e.error_count()} errors)") from None
        if spec.id != job_id:
            raise Discard(f"job {job_id}: its spec names job {spec.id}")
        entry = (spec, {s.id: s for s in spec.segments})
        with self._lock:
            self._specs[job_id] = entry
            while len(self._specs) > self.size:
                self._specs.popitem(last=False)
        return entry


def parse(args: tuple, kwargs: dict) -> RenderTask:
    """The message's arguments as a RenderTask (one positional dict), or `Discard`."""
    if kwargs or len(args) != 1 or not isinstance(args[0], dict):
        raise Discard(f"expected one JSON object argument, got {len(args)} argument(s)"
                      f"{' and keyword arguments' if kwargs else ''}")
    try:
        return RenderTask.model_validate(args[0])
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "payload"
        raise Discard(f"invalid render task: {where}: {first['msg'][:200]} ({e.error_count()} error(s))") from None


def resolve(task: RenderTask, specs: SpecCache, stop: threading.Event | None = None) -> RenderTask:
    """The task as the job's spec has it: only the spec's segments, with the spec's text, voice,
    params and seed. A task has one voice and one set of params (the producer groups by them), so
    segments of another group than the first one named are dropped too."""
    spec, by_id = specs.get(task.job_id, stop)
    known = [by_id[s.id] for s in task.segments if s.id in by_id]
    if not known:
        raise Discard(f"job {task.job_id}: none of its {len(task.segments)} segment id(s) are in the job's spec")
    voice, params = spec.voice_of(known[0]), spec.params_of(known[0])
    same = [s for s in known if spec.voice_of(s) == voice and spec.params_of(s) == params]
    if len(same) < len(task.segments):
        log.error("job %s: %d segment id(s) of a render task are not in the job's spec or not of its voice; ignored",
                  task.job_id, len(task.segments) - len(same))
    return RenderTask(
        job_id=spec.id, voice=voice, format=spec.format, params=params, reuse=spec.reuse,
        segments=[TaskSegment(id=s.id, chapter=s.chapter, text=s.text, seed=spec.seed_of(s)) for s in same],
    )
