"""The `voxbatch.render` Celery task: hand a batch of segments to this process's pipeline and wait.

The task acks (acks_late) only after every one of its segments is stored or recorded failed, so a
worker that dies mid-task leaves the message to be redelivered; the redelivery skips what is stored.
Outages never fail it: the pipeline and the spec lookup wait for Redis and storage to come back.
A message that is not a render task of a job this worker can read is logged once and discarded
(worker/messages.py); it never raises, so it never reaches Celery's failure path.
"""

from __future__ import annotations

import logging

from celery.exceptions import Reject

from voxbatch.celery_app import RENDER_TASK, app
from voxbatch.outage import Stopped
from voxbatch.worker import messages
from voxbatch.worker.pipeline import Pipeline, TaskAbandoned

log = logging.getLogger(__name__)

_pipeline: Pipeline | None = None
_specs: messages.SpecCache | None = None


def install(pipeline: Pipeline) -> None:
    """Called once by the worker process after the engine is warm, before it consumes tasks."""
    global _pipeline, _specs
    _pipeline = pipeline
    _specs = messages.SpecCache(pipeline.storage)


@app.task(name=RENDER_TASK, bind=True)
def render(self, *args, **kwargs) -> dict:
    if _pipeline is None or _specs is None:
        raise RuntimeError("render task received before the worker's pipeline was installed")
    try:
        task = messages.resolve(messages.parse(args, kwargs), _specs, stop=_pipeline.stopping)
    except messages.Discard as e:
        log.error("discarded render message %.80r: %s", self.request.id, e)
        return {"discarded": str(e)}
    except Stopped as e:  # shut down while waiting for storage: hand the message back
        raise Reject("worker shutting down", requeue=True) from e
    try:
        _pipeline.submit(task).wait()
    except TaskAbandoned as e:
        raise Reject(str(e), requeue=True) from e
    return {"job": task.job_id, "segments": len(task.segments)}
