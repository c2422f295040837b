"""The sweeper: finds segments that nothing is going to finish, and enqueues them again.

A segment of an unfinished job is normally in one of four places: recorded done, recorded failed,
in a render message waiting in the queue, or in a message a worker holds (kombu's `unacked` hash,
which a dead worker's messages return from within the visibility timeout). Anything that loses a
message outside those paths (a task acked by a bug, a Redis that lost its last second of writes on
restart, a queue flushed by hand) leaves segments in none of them, and the job would wait forever.
The sweeper looks every `sweep_interval_s`: a segment in none of the four places twice in a row is
enqueued again (twice, because a message moving between the queue and a worker is briefly in
neither), and the job's `swept` counter says so in `voxbatch status`. A job left `assembling` with
no assemble message anywhere, twice in a row, gets its assembly sent again (assembly is idempotent).

It runs in `voxbatch assembler` (one thread); with several assemblers a short Redis lock lets one
of them sweep per interval. It only reads what it needs: the render and assemble lists and the
unacked hash in one MULTI (a consistent snapshot), the done sets and failure hashes of unfinished
jobs, and the specs of jobs that have something missing.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections import defaultdict
from dataclasses import dataclass, field

from voxbatch.celery_app import ASSEMBLE_TASK, RENDER_TASK, configure_celery, send_assemble, send_render
from voxbatch.jobstate import RedisJobStore
from voxbatch.outage import is_outage
from voxbatch.settings import Settings
from voxbatch.storage import Storage

log = logging.getLogger(__name__)

LOCK_KEY = "vb:sweeper"
UNFINISHED = ("queued", "running", "assembling")


@dataclass
class Held:
    """What the broker holds right now: segment ids per job in render messages, jobs with an assemble message."""

    segments: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    assembling: set[str] = field(default_factory=set)

    def add(self, envelope: object) -> None:
        """Note one kombu envelope (a queue entry, decoded); anything unreadable is skipped."""
        try:
            task = (envelope.get("headers") or {}).get("task")
            body = envelope["body"]
            if envelope.get("properties", {}).get("body_encoding") == "base64":
                body = base64.b64decode(body)
            args = json.loads(body)[0]
            if task == RENDER_TASK:
                payload = args[0]
                self.segments[str(payload["job_id"])].update(str(s["id"]) for s in payload["segments"])
            elif task == ASSEMBLE_TASK:
                self.assembling.add(str(args[0]))
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return  # not ours to judge: the worker's transport drops malformed messages

    def add_raw(self, raw: bytes | str, unacked: bool = False) -> None:
        """Note a queue entry (the envelope as JSON) or an `unacked` hash value ([envelope, exchange, key])."""
        try:
            value = json.loads(raw)
        except ValueError:
            return
        self.add(value[0] if unacked and isinstance(value, list) and value else value)


class Sweeper:
    def __init__(self, jobs: RedisJobStore, storage: Storage, settings: Settings):
        self.jobs, self.storage, self.settings = jobs, storage, settings
        self._suspects: dict[str, set[str]] = {}  # job -> segments found nowhere at the last look
        self._assembly_suspects: set[str] = set()
        self._unreadable: set[str] = set()  # jobs whose spec could not be read, warned about once

    def held(self) -> Held:
        queues = (self.settings.render_queue, self.settings.assemble_queue)
        with self.jobs.r.pipeline(transaction=True) as p:
            for q in queues:
                p.lrange(q, 0, -1)
            p.hvals("unacked")
            *lists, unacked = p.execute()
        held = Held()
        for items in lists:
            for raw in items:
                held.add_raw(raw)
        for raw in unacked:
            held.add_raw(raw, unacked=True)
        return held

    def sweep(self) -> dict[str, int]:
        """One look; returns job id -> segments re-enqueued (an assembly sent again counts as 0)."""
        if not self.jobs.r.set(LOCK_KEY, "1", nx=True, ex=max(1, int(self.settings.sweep_interval_s) - 1)):
            return {}  # another assembler swept this interval
        unfinished = {j: p for j, p in self.jobs.progress(self.jobs.job_ids(10_000)).items() if p[0] in UNFINISHED}
        held = self.held()
        swept: dict[str, int] = {}
        suspects: dict[str, set[str]] = {}
        for job_id, (state, total, done, failed) in unfinished.items():
            if state == "assembling":
                if job_id not in held.assembling and job_id in self._assembly_suspects:
                    log.warning("job %s: assembling, but no assemble message anywhere; sending it again", job_id)
                    send_assemble(job_id, self.settings.assemble_queue)
                    swept[job_id] = 0
                continue
            accounted = self.jobs.done_ids(job_id) | set(self.jobs.failed(job_id)) | held.segments.get(job_id, set())
            if done + failed >= total or len(accounted) >= total:
                continue
            from voxbatch.producer.submit import load_spec

            try:
                spec = load_spec(self.storage, job_id)
            except ValueError as e:  # missing/malformed spec: one unreadable job must not stop the whole sweep
                if job_id not in self._unreadable:
                    self._unreadable.add(job_id)
                    log.warning("sweeper: job %s skipped: %s", job_id, e)
                continue
            missing = {s.id for s in spec.segments} - accounted
            again = missing & self._suspects.get(job_id, set())
            suspects[job_id] = missing - again
            if again:
                self._resend(spec, again)
                swept[job_id] = len(again)
        self._suspects = suspects
        self._assembly_suspects = {j for j, p in unfinished.items() if p[0] == "assembling" and j not in held.assembling
                                   and j not in swept}
        return swept

    def _resend(self, spec, seg_ids: set[str]) -> None:
        from voxbatch.producer.submit import render_tasks

        segments = [s for s in spec.segments if s.id in seg_ids]
        for task in render_tasks(spec, self.settings.batch_size, segments):
            send_render(task, self.settings.render_queue)
        self.jobs.note_swept(spec.id, len(segments))
        log.warning("job %s: %d segment(s) were neither done, failed, queued nor in flight; re-enqueued (%s..%s)",
                    spec.id, len(segments), segments[0].id, segments[-1].id)

    def run(self, stop: threading.Event) -> None:
        """Sweep every `sweep_interval_s` until `stop`; outages skip a round, they never end the loop."""
        configure_celery(self.settings)
        while not stop.wait(self.settings.sweep_interval_s):
            try:
                self.sweep()
            except Exception as e:  # noqa: BLE001 - the sweeper is a backstop: it must outlive any one failure
                if is_outage(e):
                    log.warning("sweeper: service unavailable (%s: %s); next look in %.0f s", type(e).__name__, e,
                                self.settings.sweep_interval_s)
                else:
                    log.exception("sweeper: this look failed; next look in %.0f s", self.settings.sweep_interval_s)


def start_sweeper(jobs: RedisJobStore, storage: Storage, settings: Settings) -> threading.Event:
    """Run a sweeper in a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    threading.Thread(target=Sweeper(jobs, storage, settings).run, args=(stop,), name="sweeper", daemon=True).start()
    return stop
