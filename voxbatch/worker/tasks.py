"""The `voxbatch.render` Celery task: hand a batch of segments to this process's pipeline and wait.

The task acks (acks_late) only after every one of its segments is stored or recorded failed, so a
worker that dies mid-task leaves the message to be redelivered; the redelivery skips what is stored.
Outages never fail it: the pipeline and the spec lookup wait for Redis and storage to come back.
A message that is not a render task of a job this worker can read is logged once and discarded
(worker/messages.py); it never raises, so it never reaches Celery's failure path.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

from celery.exceptions import Reject

from voxbatch.celery_app import RENDER_TASK, app
from voxbatch.outage import Stopped
from voxbatch.worker import messages
from voxbatch.worker.budget import SegmentBudget, inflight_segments
from voxbatch.worker.pipeline import Pipeline, TaskAbandoned

log = logging.getLogger(__name__)

_pipeline: Pipeline | None = None
_specs: messages.SpecCache | None = None
_budget: SegmentBudget | None = None  # segments in flight, whatever the tasks' size (budget.py)


def install(pipeline: Pipeline) -> None:
    """Called once by the worker process after the engine is warm, before it consumes tasks."""
    global _pipeline, _specs, _budget
    _pipeline = pipeline
    _specs = messages.SpecCache(pipeline.storage)
    _budget = SegmentBudget(inflight_segments(pipeline.settings, pipeline.engine.max_batch))


def _fail_job(job_id: str, reason: str) -> None:
    """A job that exists in Redis but can never render here: mark it failed with the reason, so
    `voxbatch status` says why instead of showing 0/N forever (a forged message for a job whose spec
    exists never gets here)."""
    jobs = _pipeline.jobs
    try:
        if jobs.state(job_id) in ("queued", "running"):
            jobs.set_reason(job_id, reason)
            jobs.set_state(job_id, "failed")
    except Exception as e:  # noqa: BLE001 - Redis away: the log line above still says it
        log.warning("job %s: could not record its failure: %s", job_id, e)


@app.task(name=RENDER_TASK, bind=True)
def render(self, *args, **kwargs) -> dict:
    if _pipeline is None or _specs is None:
        raise RuntimeError("render task received before the worker's pipeline was installed")
    try:
        task = messages.resolve(messages.parse(args, kwargs), _specs, stop=_pipeline.stopping)
    except messages.SpecMissing as e:
        log.error("discarded render message %.80r: %s", self.request.id, e)
        _fail_job(e.job_id, f"a render worker found no spec for it ({e}); do the producer and the workers "
                            "use the same storage (VOXBATCH_STORAGE_URL, VOXBATCH_S3_ENDPOINT)?")
        return {"discarded": str(e)}
    except messages.Discard as e:
        log.error("discarded render message %.80r: %s", self.request.id, e)
        return {"discarded": str(e)}
    except Stopped as e:  # shut down while waiting for storage: hand the message back
        raise Reject("worker shutting down", requeue=True) from e
    try:
        with _budget.hold(len(task.segments)) if _budget is not None else nullcontext():
            _pipeline.submit(task).wait()
    except TaskAbandoned as e:
        raise Reject(str(e), requeue=True) from e
    return {"job": task.job_id, "segments": len(task.segments)}
