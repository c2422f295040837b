"""The `voxbatch.assemble` Celery task, run by `voxbatch assembler` on the CPU `assemble` queue."""

from __future__ import annotations

import logging

from voxbatch.celery_app import ASSEMBLE_TASK, app
from voxbatch.jobstate import RedisJobStore
from voxbatch.settings import load_settings
from voxbatch.storage import open_storage

log = logging.getLogger(__name__)


@app.task(name=ASSEMBLE_TASK)
def assemble(job_id: str) -> dict:
    from producer.assemble import assemble_job
    from producer.submit import load_spec

    settings = load_settings()
    jobs = RedisJobStore.from_url(settings.broker_url)
    if jobs.state(job_id) != "assembling":
        log.info("job %s is %s, not assembling: nothing to do", job_id, jobs.state(job_id))
        return {"job": job_id, "skipped": True}
    storage = open_storage(settings)
    manifest = assemble_job(storage, load_spec(storage, job_id), jobs.failed(job_id), None, settings)
    jobs.set_state(job_id, manifest.state)
    return {"job": job_id, "state": manifest.state}
