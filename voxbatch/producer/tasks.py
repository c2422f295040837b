"""The `voxbatch.assemble` Celery task, run by `voxbatch assembler` on the CPU `assemble` queue.

Exactly one is enqueued per job (the job store's `finish` script elects the sender). Assembly is
idempotent (it rewrites chapters, subtitles and manifest from the stored segments), so running it
again is safe. A storage or Redis outage is waited out in place (up to `outage_window_s`) and
costs no retry; any other error is retried with backoff, and after the last retry the job is marked
`failed` and `voxbatch retry JOB` can enqueue the assembly again.
"""

from __future__ import annotations

import logging

from voxbatch.celery_app import ASSEMBLE_TASK, app
from voxbatch.jobstate import RedisJobStore
from voxbatch.outage import backoff_s, wait_for_service
from voxbatch.settings import load_settings
from voxbatch.storage import open_storage

log = logging.getLogger(__name__)
MAX_RETRIES = 3


@app.task(name=ASSEMBLE_TASK, bind=True, max_retries=MAX_RETRIES)
def assemble(self, job_id: str) -> dict:
    from voxbatch.producer.assemble import assemble_job
    from voxbatch.producer.submit import load_spec

    settings = load_settings()
    jobs = RedisJobStore.from_url(settings.broker_url)
    state = wait_for_service(lambda: jobs.state(job_id), f"job {job_id}", log=log)
    if state != "assembling":
        log.info("job %s is %s, not assembling: nothing to do", job_id, state)
        return {"job": job_id, "skipped": True}
    storage = open_storage(settings)
    try:
        manifest = wait_for_service(
            lambda: assemble_job(storage, load_spec(storage, job_id), jobs.failed(job_id), None, settings,
                                 jobs.reused_ids(job_id)),
            f"job {job_id}: assembly", log=log, window_s=settings.outage_window_s)
    except Exception as e:
        if self.request.retries >= MAX_RETRIES:
            log.error("job %s: assembly failed for good: %s", job_id, e)
            reason = f"assembly failed: {type(e).__name__}: {e}"
            wait_for_service(lambda: jobs.set_reason(job_id, reason), f"job {job_id}", log=log)
            wait_for_service(lambda: jobs.set_state(job_id, "failed"), f"job {job_id}", log=log)
            raise
        raise self.retry(exc=e, countdown=backoff_s(self.request.retries + 1, 1000, 30_000)) from e
    wait_for_service(lambda: jobs.set_state(job_id, manifest.state), f"job {job_id}", log=log)
    return {"job": job_id, "state": manifest.state}
