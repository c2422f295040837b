"""Status, cancel, retry and listing of jobs: the producer's view of the Redis job state.

Whatever a job holds that a user or a corpus chose (its name, error texts) is escaped before rich
renders it. A job that is not moving says why when it can: it failed (its `reason`), or no worker
is alive, or the live workers have taken no work for `stalled_after_s` (`stall_hint`).
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
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


def progress_columns() -> list:
    """The columns of a job's progress bar (`status --watch`, `render`): segments, audio, rate, ETA."""
    return [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} seg"),
            TextColumn("{task.fields[audio]:.0f}s audio"), TextColumn("{task.fields[rate]:.1f} seg/s"),
            TextColumn("[red]{task.fields[failed]} failed"), TimeRemainingColumn()]


class JobBar:
    """A job's progress bar fed with `JobStatus`es; the rate counts from the first status seen."""

    def __init__(self, progress: Progress, status: JobStatus):
        self.progress = progress
        self.bar = progress.add_task(escape(status.name), total=status.total, audio=0.0, rate=0.0, failed=0)
        self.t0, self.done0 = time.time(), status.done + status.failed

    def update(self, status: JobStatus) -> None:
        finished = status.done + status.failed
        rate = (finished - self.done0) / max(time.time() - self.t0, 1e-6)
        self.progress.update(self.bar, completed=finished, total=status.total, audio=status.audio_s, rate=rate,
                             failed=status.failed, description=f"[bold]{escape(status.name)}[/bold] ({status.state})")


def watch(jobs: RedisJobStore, job_id: str, console: Console, settings: Settings | None = None,
          interval_s: float = 1.0) -> JobStatus:
    """A progress bar until the job finishes: segments, audio seconds, rate, ETA, failures; and a
    line when the job stalls with no worker alive or none taking work (`stall_hint`)."""
    status = get_status(jobs, job_id)
    hinted = None
    with Progress(*progress_columns(), console=console) as progress:
        bar = JobBar(progress, status)
        while True:
            status = get_status(jobs, job_id)
            bar.update(status)
            if status.finished:
                return status
            hint = stall_hint(jobs, status, settings) if settings is not None else None
            if hint and hint != hinted:
                progress.console.print(f"[yellow]hint:[/yellow] {escape(hint)}", soft_wrap=True)
            hinted = hint
            time.sleep(interval_s)


def stall_hint(jobs: RedisJobStore, status: JobStatus, settings: Settings, now: float | None = None) -> str | None:
    """Why an unfinished job may not be moving, or None while it moves (or has not waited long)."""
    now = time.time() if now is None else now
    if status.finished or status.state == "assembling" or now - status.updated_at < settings.stalled_after_s:
        return None
    workers = jobs.workers(settings.worker_heartbeat_s)
    waited = f"{now - status.updated_at:.0f} s"
    if not workers:
        return (f"no progress for {waited} and no render worker is alive (no heartbeat in Redis): start one "
                "with `voxbatch worker`")
    took = max(float(w.get("took") or 0) for w in workers.values())
    if now - took >= settings.stalled_after_s:
        queues = sorted({str(w.get("queues")) for w in workers.values()})
        return (f"no progress for {waited}: {len(workers)} worker(s) alive, but none has taken work for "
                f"{now - took:.0f} s (they consume {', '.join(queues)}; is the job on another queue or "
                "another Redis?)" if took else
                f"no progress for {waited}: {len(workers)} worker(s) alive, none has taken any work yet "
                f"(they consume {', '.join(queues)})")
    return None


def status_table(status: JobStatus, jobs: RedisJobStore | None = None, max_errors: int = 20) -> Table:
    """A job's fields; a failed job's reason; the final errors of failed segments and, while they
    are retried, the last errors of the others (`jobs` is needed for those)."""
    table = Table(title=f"job {escape(status.id)}")
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for k, v in [("name", status.name), ("state", status.state), ("segments", f"{status.done}/{status.total}"),
                 ("reused", str(status.reused)),
                 ("failed", str(status.failed)), ("audio", f"{status.audio_s:.1f} s")]:
        table.add_row(k, escape(v))
    if status.swept:
        table.add_row("re-enqueued by sweeper", f"{status.swept} segment(s) found neither done, failed, queued nor in flight")
    if status.reason:
        table.add_row("reason", escape(status.reason))
    errors = [(f"error {seg}", err) for seg, err in sorted(status.errors.items())]
    if jobs is not None and not status.finished:
        retrying = jobs.last_errors(status.id)
        errors += [(f"last error {seg}", err) for seg, err in sorted(retrying.items()) if seg not in status.errors]
    for k, err in errors[:max_errors]:
        table.add_row(k, escape(err))
    if len(errors) > max_errors:
        table.add_row("...", f"{len(errors) - max_errors} more")
    return table


def jobs_table(jobs: RedisJobStore, limit: int = 50, settings: Settings | None = None) -> Table:
    """Jobs newest first; ids are never cut (the other columns wrap instead); a caption when the
    unfinished jobs are not moving (`stall_hint`)."""
    table = Table(title="jobs (newest first)")
    statuses = [s for s in (jobs.status(j) for j in jobs.job_ids(limit)) if s is not None]
    width = max([len(s.id) for s in statuses] + [2])
    table.add_column("id", no_wrap=True, min_width=width)
    for col in ("name", "state", "done", "failed", "total", "audio s", "created"):
        table.add_column(col, overflow="fold")
    for s in statuses:
        table.add_row(escape(s.id), escape(s.name), s.state, str(s.done), str(s.failed), str(s.total),
                      f"{s.audio_s:.1f}", time.strftime("%Y-%m-%d %H:%M", time.localtime(s.created_at)))
    if settings is not None:
        hints = [h for h in (stall_hint(jobs, s, settings) for s in statuses) if h]
        if hints:
            table.caption = escape(hints[0])
    return table


def retry_job(jobs: RedisJobStore, storage: Storage, settings: Settings, job_id: str, queue: str | None = None) -> int:
    """Re-enqueue only failed or missing segments; returns how many. Resumes a cancelled job.

    Storage is the source of truth: a job Redis has lost (restarted without persistence, flushed, a
    new Redis) is rebuilt from its job.json, and every segment not recorded done is enqueued; the
    workers record what is already stored without rendering it, and render only what is missing.
    """
    from voxbatch.producer.submit import load_spec, render_tasks
    from voxbatch.celery_app import configure_celery, render_sender, send_assemble

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
    with render_sender(queue or settings.render_queue) as send:
        for task in render_tasks(spec, settings.batch_size, todo):
            send(task)
    return len(todo)
