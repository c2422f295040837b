"""The host CPU a worker spends taking a task's segments in, per segment, before any of them renders.

A job's tasks reach a worker together, and its task threads look every segment up (is it stored, is it
in the content cache) and queue it for the engine while the engine's LLM thread places its first rows
and the vocoder threads launch kernels: all of them share one GIL. On the GPU every job's first
~0.25 s is that (BENCHMARKS.md, stop 45: the LLM thread's first placement took 146 ms of wall time for
28 ms of its own CPU), so the intake's CPU time per segment is time the GPU waits at each job's start.

Drives the worker's own `Pipeline.submit` (tasks of `--task` segments, as `voxbatch submit` cuts them)
with the engine not started, so only the intake runs, and reads the whole
process's CPU time (task thread and lookup threads) and the wall time `submit` took. Storage: a local
folder, or S3 on a SeaweedFS the bench starts (`--storage s3`). Cases, side by side in one run:
  new          nothing stored: the segment's key and the content cache are looked up, both miss;
  new_no_reuse the same with the job's reuse off (`--no-reuse`): the segment's key only;
  reused       every segment in the content cache: copied from it, recorded done;
  redelivered  every segment stored and recorded done: the task's one done-set read, no lookups.

Usage (repo root): python -m bench.intake_host [--storage local|s3] [--segments 512] [--task 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.provenance import commit, cpu_model

REPO = Path(__file__).resolve().parents[1]
TEXT = "The keeper walked the length of the harbour wall and counted every boat that had come home before dark"
CASES = ("new", "new_no_reuse", "reused", "redelivered")


def make_spec(n: int, reuse: bool):
    from voxbatch.models import JobSpec, Segment

    segments = [Segment(chapter=i // 200, index=i % 200, text=f"{TEXT}, line {i}.") for i in range(n)]
    return JobSpec(id="bench-intake", name="bench", voice="tone", chapters=[f"c{c}" for c in range(n // 200 + 1)],
                   segments=segments, created_at=0.0, source="bench", reuse=reuse)


def pipeline_for(storage, spec, done: bool):
    """A worker's Pipeline (tone engine, not started) over `storage`, its job created (and every segment
    recorded done where `done`)."""
    from voxbatch.jobstate import MemoryJobStore
    from voxbatch.settings import Settings
    from voxbatch.worker.pipeline import Pipeline
    from voxbatch.worker.tone import ToneEngine

    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, len(spec.segments), 0.0)
    if done:
        for seg in spec.segments:
            jobs.finish(spec.id, seg.id, audio_s=0.1)
    return Pipeline(ToneEngine(max_batch=8), storage, jobs, Settings(), lambda _job: None)


def store_all(pipeline, spec, task_size: int, cache: bool) -> None:
    """Every segment's audio where a finished render leaves it: under its own key, or (`cache`) only in
    the content cache, under the key this pipeline's worker would look for."""
    import numpy as np

    from voxbatch.audio import encode
    from voxbatch.producer.submit import render_tasks
    from voxbatch.worker.pipeline import TaskHandle, _Tag

    wav = encode(np.zeros(2400, dtype=np.float32), 24000, "wav")
    for task in render_tasks(spec, task_size):
        for seg in task.segments:
            key = pipeline.cache.key(task, seg) if cache else _Tag(TaskHandle(task), seg).key
            pipeline.storage.put(key, wav)


class Stores:
    """A fresh, empty storage per case: a folder under a temporary root, or a new bucket of a SeaweedFS
    started for the run (`--storage s3`, as the tests start it: voxbatch.testing_services)."""

    def __init__(self, kind: str, tmp: Path):
        self.kind, self.tmp, self.n, self.s3 = kind, tmp, 0, None
        if kind == "s3":
            from voxbatch import testing_services as services

            (tmp / "seaweed").mkdir()
            self.s3 = services.start_seaweed(tmp / "seaweed")
            self.credentials = {"aws_access_key_id": services.S3_KEY, "aws_secret_access_key": services.S3_SECRET}

    def new(self):
        from voxbatch.settings import Settings
        from voxbatch.storage import LocalStorage, open_storage

        self.n += 1
        if self.s3 is None:
            return LocalStorage(self.tmp / f"store{self.n}")
        return open_storage(Settings(storage_url=f"s3://{self.s3.new_bucket()}/p", s3_endpoint=self.s3.endpoint,
                                     **self.credentials))

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.stop()


def one_case(case: str, n: int, task_size: int, stores: Stores) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of `Pipeline.submit` over the job's tasks, on an empty storage."""
    from voxbatch.producer.submit import render_tasks

    spec = make_spec(n, reuse=case != "new_no_reuse")
    pipeline = pipeline_for(stores.new(), spec, done=case == "redelivered")
    if case in ("reused", "redelivered"):
        store_all(pipeline, spec, task_size, cache=case == "reused")
    tasks = list(render_tasks(spec, task_size))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    handles = [pipeline.submit(task) for task in tasks]
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    queued = pipeline.intake.qsize()
    skipped = sum(h.skipped for h in handles)
    pipeline.abandon()
    pipeline.stop(timeout_s=1.0)
    expect_queued = n if case.startswith("new") else 0
    if queued != expect_queued or skipped != n - expect_queued:
        raise SystemExit(f"case {case}: {queued} segments queued and {skipped} skipped, expected {expect_queued} queued")
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=512)
    ap.add_argument("--task", type=int, default=16, help="segments per task (VOXBATCH_BATCH_SIZE)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per case, interleaved; the median is reported")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "intake_host.json")
    ap.add_argument("--storage", choices=["local", "s3"], default="local",
                    help="a local folder, or S3 on a SeaweedFS the bench starts (`weed` on PATH or beside Python)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-intake-") as tmp:
        stores = Stores(a.storage, Path(tmp))
        try:
            one_case("new", min(a.segments, 64), a.task, stores)  # warm-up: imports, first allocations, connections
            times: dict[str, list[tuple[float, float]]] = {c: [] for c in CASES}
            for _ in range(a.rounds):
                for case in CASES:  # interleaved, so a slow moment of the machine spreads over every case
                    times[case].append(one_case(case, a.segments, a.task, stores))
        finally:
            stores.close()
    per_seg = lambda x: round(1e6 * x / a.segments, 1)  # noqa: E731
    rows = {c: {"cpu_us_per_segment": per_seg(statistics.median(cpu for cpu, _ in t)),
                "wall_us_per_segment": per_seg(statistics.median(wall for _, wall in t)),
                "cpu_us_per_segment_rounds": [per_seg(cpu) for cpu, _ in t],
                "wall_us_per_segment_rounds": [per_seg(wall) for _, wall in t]} for c, t in times.items()}
    base = rows["new"]["cpu_us_per_segment"]
    for r in rows.values():
        r["over_new"] = round(r["cpu_us_per_segment"] / base, 3) if base else None
    result = {"commit": commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
              "segments": a.segments, "task": a.task, "rounds": a.rounds,
              "storage": "local folder" if a.storage == "local" else "S3 (SeaweedFS on this machine, loopback)",
              "job_store": "in memory (one done-set read per task)", "cases": rows}
    print(f"intake host time per segment ({a.segments} segments in tasks of {a.task}, {result['storage']}; "
          f"median of {a.rounds}; commit {result['commit'][:12]})")
    print("| case | CPU us / segment | CPU vs new | wall us / segment |\n|---|---|---|---|")
    for c, r in rows.items():
        print(f"| {c} | {r['cpu_us_per_segment']} | {r['over_new']} | {r['wall_us_per_segment']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
