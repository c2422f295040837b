"""Status, cancel, retry and listing of jobs: the producer's view of the Redis job state."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from voxbatch.jobstate import RedisJobStore
from voxbatch.models import JobStatus
from voxbatch.settings import Settings
from voxbatch.storage import Storage


class JobNotFound(KeyError):
    pass


def get_status(jobs: RedisJobStore, job_id: str, storage: Storage | None = None) -> JobStatus:
    status = jobs.status(job_id)
    if status is None:
        hint = ""
        if storage is not None:
            from voxbatch import keys

            try:
                if storage.exists(keys.job_spec(job_id)):
                    hint = (f"; its spec is in storage, so `voxbatch retry {job_id}` rebuilds its state and "
                            "renders only what is not stored")
            except (ValueError, KeyError):
                pass
        raise JobNotFound(f"no job {job_id!r} in Redis{hint}")
    return status


def watch(jobs: RedisJobStore, job_id: str, console: Console, interval_s: float = 1.0) -> JobStatus:
    """A progress bar until the job finishes: segments, audio seconds, rate, ETA, failures."""
    status = get_status(jobs, job_id)
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} seg"),
               TextColumn("{task.fields[audio]:.0f}s audio"), TextColumn("{task.fields[rate]:.1f} seg/s"),
               TextColumn("[red]{task.fields[failed]} failed"), TimeRemainingColumn()]
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task(status.name, total=status.total, audio=0.0, rate=0.0, failed=0)
        t0, done0 = time.time(), status.done + status.failed
        while True:
            status = get_status(jobs, job_id)
            finished = status.done + status.failed
            rate = (finished - done0) / max(time.time() - t0, 1e-6)
            progress.update(bar, completed=finished, audio=status.audio_s, rate=rate, failed=status.failed,
                            description=f"{status.name} [{status.state}]")
            if status.finished:
                return status
            time.sleep(interval_s)


def status_table(status: JobStatus) -> Table:
    table = Table(title=f"job {status.id}")
    table.add_column("field")
    table.add_column("value")
    for k, v in [("name", status.name), ("state", status.state), ("segments", f"{status.done}/{status.total}"),
                 ("reused", str(status.reused)),
                 ("failed", str(status.failed)), ("audio", f"{status.audio_s:.1f} s")]:
        table.add_row(k, v)
    if status.swept:
        table.add_row("re-enqueued by sweeper", f"{status.swept} segment(s) found neither done, failed, queued nor in flight")
    for seg, err in sorted(status.errors.items())[:20]:
        table.add_row(f"error {seg}", err)
    return table


def jobs_table(jobs: RedisJobStore, limit: int = 50) -> Table:
    table = Table(title="jobs (newest first)")
    for col in ("id", "name", "state", "done", "failed", "total", "audio s", "created"):
        table.add_column(col)
    for job_id in jobs.job_ids(limit):
        s = jobs.status(job_id)
        if s is not None:
            table.add_row(s.id, s.name, s.state, str(s.done), str(s.failed), str(s.total), f"{s.audio_s:.1f}",
                          time.strftime("%Y-%m-%d %H:%M", time.localtime(s.created_at)))
    return table


def retry_job(jobs: RedisJobStore, storage: Storage, settings: Settings, job_id: str, queue: str | None = None) -> int:
    """Re-enqueue only failed or missing segments; returns how many. Resumes a cancelled job.

    Storage is the source of truth: a job Redis has lost (restarted without persistence, flushed, a
    new Redis) is rebuilt from its job.json, and every segment not recorded done is enqueued; the
    workers record what is already stored without rendering it, and render only what is missing.
    """
    from voxbatch.producer.submit import load_spec, render_tasks
    from voxbatch.celery_app import configure_celery, send_assemble, send_render

    spec = load_spec(storage, job_id)  # SubmitError when storage has no job.json either
    configure_celery(settings)
    if jobs.status(job_id) is None:
        jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    done = jobs.done_ids(job_id)
    todo = [s for s in spec.segments if s.id not in done]
    if not todo:
        if jobs.state(job_id) == "assembling":  # every segment landed but the assembly never finished
            send_assemble(job_id, settings.assemble_queue)
        return 0
    jobs.reopen(job_id, [s.id for s in todo])
    for task in render_tasks(spec, settings.batch_size, todo):
        send_render(task, queue or settings.render_queue)
    return len(todo)
