"""Throughput of the distributed path itself: producer → Redis → one worker process → storage → done.

The worker runs the `tone` engine, which makes audio of real-speech length as fast as numpy can, so
what is measured is the path (broker, job state, encode, upload, bookkeeping), not a model. Variants
run side by side in one invocation and are reported as segments/s and audio-seconds/s, with ratios:

  s3      one `voxbatch worker` process, SeaweedFS S3 on loopback, real Redis
  local   the same worker process writing to a local folder (file://), real Redis
  inproc  the pipeline alone in this process (no broker, no Redis), local folder: the ceiling

Usage (from the repo root): python -m bench.orchestration [--segments 2000] [--out bench/results/orchestration.json]
A GPU producing 100 segments/s needs each variant above 100 segments/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rich.console import Console
from rich.table import Table

from producer.submit import render_tasks
from tests import services
from voxbatch.celery_app import configure_celery, send_render
from voxbatch.jobstate import MemoryJobStore, RedisJobStore
from voxbatch.models import JobSpec, Segment
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage, open_storage
from worker.pipeline import Pipeline
from worker.tone import ToneEngine, tone_duration_s

REPO = Path(__file__).resolve().parents[1]

SENTENCES = [
    "The river ran quiet under the old stone bridge.",
    "She opened the letter, read it twice, and put it back in the drawer without a word.",
    "Rain again.",
    "By the time the lanterns were lit, the square had filled with travellers from the north road.",
    "He laughed.",
    "Nobody in the village remembered who had planted the orchard, only that it had always been there.",
]


def make_spec(n: int) -> JobSpec:
    segs = [Segment(chapter=i // 200, index=i % 200, text=SENTENCES[i % len(SENTENCES)]) for i in range(n)]
    return JobSpec(id=uuid.uuid4().hex[:12], name="bench", voice="tone", chapters=[f"c{c}" for c in range(n // 200 + 1)],
                   segments=segs, created_at=time.time(), source="bench")


def hardware() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def run_distributed(spec: JobSpec, env: dict[str, str], settings: Settings, workdir: Path, label: str) -> dict:
    """Start one worker process, enqueue the job's tasks, time until every segment is recorded done."""
    log = workdir / f"worker-{label}.log"
    worker = services.VoxbatchProcess(["worker"], env, log).start()
    try:
        worker.wait_ready(120)
        storage = open_storage(settings)
        jobs = RedisJobStore.from_url(settings.broker_url)
        configure_celery(settings)
        t0 = time.perf_counter()
        storage.put(f"jobs/{spec.id}/job.json", spec.model_dump_json().encode())
        jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
        for task in render_tasks(spec, settings.batch_size):
            send_render(task, settings.render_queue)
        t_enqueued = time.perf_counter() - t0
        services.wait_until(lambda: jobs.status(spec.id).done >= len(spec.segments), 900, label, interval_s=0.05)
        wall = time.perf_counter() - t0
    finally:
        worker.stop()
    return {"wall_s": wall, "enqueue_s": t_enqueued}


def run_inproc(spec: JobSpec, settings: Settings, root: Path) -> dict:
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), spec.created_at)
    done = threading.Event()
    t0 = time.perf_counter()
    with Pipeline(ToneEngine(max_batch=settings.engine_max_batch), LocalStorage(root), jobs, settings,
                  lambda _j: done.set()) as pipeline:
        for h in [pipeline.submit(t) for t in render_tasks(spec, settings.batch_size)]:
            h.wait()
    return {"wall_s": time.perf_counter() - t0, "enqueue_s": 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--upload-threads", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "orchestration.json")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="vb-bench-"))
    redis = services.start_redis(workdir)
    s3 = services.start_seaweed(workdir)
    bucket = s3.new_bucket()
    common = {"VOXBATCH_BROKER_URL": redis.url, "VOXBATCH_ENGINE": "tone", "VOXBATCH_BATCH_SIZE": str(args.batch_size),
              "VOXBATCH_UPLOAD_THREADS": str(args.upload_threads), "VOXBATCH_TASK_CONCURRENCY": "4",
              "VOXBATCH_OUTPUT_QUEUE_SIZE": "256", "VOXBATCH_ENGINE_MAX_BATCH": "64"}
    variants = {
        "s3": {**common, "VOXBATCH_STORAGE_URL": f"s3://{bucket}/bench", "VOXBATCH_S3_ENDPOINT": s3.endpoint,
               "AWS_ACCESS_KEY_ID": services.S3_KEY, "AWS_SECRET_ACCESS_KEY": services.S3_SECRET},
        "local": {**common, "VOXBATCH_STORAGE_URL": (workdir / "local").as_uri()},
    }
    results = {}
    try:
        for label, extra in variants.items():
            spec = make_spec(args.segments)
            env = {**os.environ, **extra, "VOXBATCH_RENDER_QUEUE": f"render-{label}"}
            settings = Settings(**{k[9:].lower(): v for k, v in extra.items() if k.startswith("VOXBATCH_")},
                                aws_access_key_id=extra.get("AWS_ACCESS_KEY_ID"),
                                aws_secret_access_key=extra.get("AWS_SECRET_ACCESS_KEY"),
                                render_queue=f"render-{label}")
            results[label] = run_distributed(spec, env, settings, workdir, label)
        spec = make_spec(args.segments)
        results["inproc"] = run_inproc(spec, Settings(batch_size=args.batch_size, upload_threads=args.upload_threads,
                                                      output_queue_size=256), workdir / "inproc")
    finally:
        s3.stop()
        redis.stop()

    audio_s = sum(tone_duration_s(s.text) for s in make_spec(args.segments).segments)
    best = max(args.segments / r["wall_s"] for r in results.values())
    table = Table(title=f"voxbatch orchestration: {args.segments} segments, {audio_s / 3600:.2f} h of audio (tone engine)")
    for col in ("variant", "wall s", "segments/s", "audio s/s", "x of best", "enqueue s"):
        table.add_column(col, justify="right")
    for label, r in results.items():
        r["segments_per_s"] = args.segments / r["wall_s"]
        r["audio_s_per_s"] = audio_s / r["wall_s"]
        table.add_row(label, f"{r['wall_s']:.2f}", f"{r['segments_per_s']:.0f}", f"{r['audio_s_per_s']:.0f}",
                      f"{r['segments_per_s'] / best:.2f}", f"{r['enqueue_s']:.2f}")
    Console().print(table)
    out = {"benchmark": "orchestration", "segments": args.segments, "audio_s": audio_s,
           "settings": {"batch_size": args.batch_size, "upload_threads": args.upload_threads, "task_concurrency": 4,
                        "output_queue_size": 256, "format": "wav"},
           "hardware": hardware(), "results": results,
           "command": f"python -m bench.orchestration --segments {args.segments}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
