"""The Celery app, configured in this one place, and the task names both sides send by.

The producer sends tasks by name (`send_task`), so it never imports worker code; the worker and the
assembler register their tasks against this same `app` object. Settings that matter for not losing
work: JSON only; acks late and rejected-on-worker-lost, so a crashed worker's task goes back to the
queue; prefetch 1, so a worker does not hoard tasks other workers could run; a short visibility
timeout that running tasks keep extending (voxbatch/broker.py's heartbeat), so a SIGKILLed worker's
tasks come back within it, and a short unacked-restore interval (kombu's default re-checks only
every ~100 s). On Redis the transport is voxbatch/broker.py's, which drops undecodable list entries
instead of dying on them.

Shutdown: Celery 5 treats SIGTERM (and a first SIGINT) as a *warm* shutdown: stop consuming, then
wait for the running tasks without limit. Its `worker_soft_shutdown_timeout` bounds only the *cold*
shutdown (SIGQUIT, or SIGTERM when the environment has REMAP_SIGTERM=SIGQUIT), and that path cancels
tasks through `pool.terminate_job`, which the thread pool does not implement. So it is not set here;
the render worker bounds the warm shutdown itself (worker/main.py): it waits `shutdown_window_s` for
the segments in flight, then hands every unfinished task back to the queue and exits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from celery import Celery

from voxbatch.models import RenderTask
from voxbatch.settings import Settings

RENDER_TASK = "voxbatch.render"
ASSEMBLE_TASK = "voxbatch.assemble"

app = Celery("voxbatch", set_as_current=False)


def shutdown_window_s(settings: Settings) -> float:
    """How long a render worker told to stop (SIGTERM) keeps working on its in-flight tasks before it
    hands the unfinished ones back (`settings.shutdown_window_s`; Kubernetes' and compose's grace
    periods are longer), but never longer than the visibility timeout: a task running that long
    has already been restored to the queue for another worker, so waiting on it only doubles work."""
    return min(settings.shutdown_window_s, float(settings.visibility_timeout_s))


def configure_celery(settings: Settings) -> Celery:
    redis_broker = settings.broker_url.startswith(("redis://", "rediss://", "unix://"))
    app.conf.update(
        broker_url=settings.broker_url,
        broker_transport="voxbatch.broker:Transport" if redis_broker else None,
        worker_consumer="voxbatch.broker:Consumer",
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Only a bug fails a render task now (outages are waited out, bad messages discarded without
        # raising). Acking or rejecting it is the same on Redis (kombu drops a message rejected
        # without requeue); the sweeper re-enqueues any segment such a task leaves unfinished.
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            "unacked_restore_interval": settings.unacked_restore_interval_s,
            "unacked_restore_throttle": 1,
        },
        task_routes={
            RENDER_TASK: {"queue": settings.render_queue},
            ASSEMBLE_TASK: {"queue": settings.assemble_queue},
        },
        task_default_queue=settings.render_queue,
    )
    return app


def send_render(task: RenderTask, queue: str | None = None, producer=None) -> str:
    """Send one render task; returns its Celery task id (what the worker's log lines name)."""
    return app.send_task(RENDER_TASK, args=[task.model_dump(mode="json")], queue=queue, producer=producer).id


@contextmanager
def render_sender(queue: str | None = None) -> Iterator[Callable[[RenderTask], str]]:
    """`send(task)` over one producer connected up front. The broker pool's first acquire is most
    of a quarter second; a job's tasks are sent right after it is registered, so that wait comes
    before the job exists rather than between its registration and its first task."""
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=1)
        yield lambda task: send_render(task, queue, producer)


def send_assemble(job_id: str, queue: str | None = None) -> None:
    app.send_task(ASSEMBLE_TASK, args=[job_id], queue=queue)
