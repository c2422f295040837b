"""The `voxbatch.render` Celery task: hand a batch of segments to this process's pipeline and wait.

The task acks (acks_late) only after every one of its segments is stored or recorded failed, so a
worker that dies mid-task leaves the message to be redelivered; the redelivery skips what is stored.
"""

from __future__ import annotations

from contextlib import nullcontext

from celery.exceptions import Reject

from voxbatch.celery_app import RENDER_TASK, app
from voxbatch.models import RenderTask
from voxbatch.worker.budget import SegmentBudget, inflight_segments
from voxbatch.worker.pipeline import Pipeline, TaskAbandoned

_pipeline: Pipeline | None = None
_budget: SegmentBudget | None = None  # segments in flight, whatever the tasks' size (budget.py)


def install(pipeline: Pipeline) -> None:
    """Called once by the worker process after the engine is warm, before it consumes tasks."""
    global _pipeline, _budget
    _pipeline = pipeline
    _budget = SegmentBudget(inflight_segments(pipeline.settings))


@app.task(name=RENDER_TASK)
def render(payload: dict) -> dict:
    if _pipeline is None:
        raise RuntimeError("render task received before the worker's pipeline was installed")
    task = RenderTask.model_validate(payload)
    try:
        with _budget.hold(len(task.segments)) if _budget is not None else nullcontext():
            _pipeline.submit(task).wait()
    except TaskAbandoned as e:
        raise Reject(str(e), requeue=True) from e
    return {"job": task.job_id, "segments": len(task.segments)}
