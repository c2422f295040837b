"""Chaos run of the distributed path: one job on real services while workers, Redis and storage fail.

Real redis-server (with the AOF settings compose and Kubernetes ship), real SeaweedFS, several
`voxbatch worker` processes on the tone engine and one `voxbatch assembler` (which also sweeps).
While the job runs, at random moments (random points of its progress, from `--seed`):

  kill            SIGKILL of one worker process (its launcher restarts it, as an orchestrator would)
  redis_restart   Redis SIGKILLed and started again on the same port and folder (AOF reload)
  storage_outage  SeaweedFS stopped for `--outage-s`, then started again

Nobody intervenes afterwards (no `retry`): the job has to finish by itself. Then it checks that
every segment is stored exactly once (the bucket is versioned, so a second PUT of a key shows as a
second version), none is lost or failed, and each one's bytes equal a clean render of the same job
(the tone engine and encoder in this process, no services: S3 ETags are the MD5 of the bytes), and
how long progress stalled after each fault (the longest gap between two increments of the done
counter from the fault's start to the next fault, or to the last segment for the last one). It writes bench/results/chaos*.json.

Usage (from the repo root):
  python -m bench.chaos --segments 10000 --workers 3 --kills 3 --redis-restarts 1 --outage-s 30 \
      --out bench/results/chaos_10k.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from bench.orchestration import make_spec
from voxbatch import keys
from voxbatch import testing_services as services
from voxbatch.audio import encode
from voxbatch.jobstate import RedisJobStore
from voxbatch.producer.submit import submit_job
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage
from voxbatch.worker.engine import SynthesisRequest
from voxbatch.worker.tone import ToneEngine

REPO = Path(__file__).resolve().parents[1]
FINISHED = ("completed", "completed_with_errors", "cancelled", "failed")


@dataclass
class Fault:
    kind: str
    at_s: float  # since the job was submitted
    duration_s: float  # how long the service was away (0 for a kill)
    stall_s: float = 0.0  # longest gap without progress from at_s to the next fault (or the last segment)
    detail: str = ""


class Progress:
    """Samples done + failed every 0.2 s (skipping samples while Redis is away)."""

    def __init__(self, jobs: RedisJobStore, job_id: str, total: int, t0: float):
        self.jobs, self.job_id, self.total, self.t0 = jobs, job_id, total, t0
        self.samples: list[tuple[float, int]] = []
        self.state: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                h = self.jobs.r.hmget(RedisJobStore._k(self.job_id), "done", "failed", "state")
            except redis.RedisError:
                continue
            if h[0] is None:
                continue
            self.samples.append((time.monotonic() - self.t0, int(h[0]) + int(h[1])))
            self.state = h[2]

    def finished(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def stop(self) -> None:
        self._stop.set()

    def longest_gap(self, start_s: float, end_s: float) -> float:
        """Longest time without an increment between start_s and end_s (from the samples), not
        counting the time after the last segment landed."""
        full = next((t for t, n in self.samples if n >= self.total), None)
        if full is not None:
            end_s = min(end_s, full)
        last_change, gap, prev = start_s, 0.0, None
        for t, n in self.samples:
            if t < start_s:
                prev = n
                continue
            if t > end_s:
                break
            if prev is not None and n > prev:
                gap = max(gap, t - last_change)
                last_change = t
            prev = n
        return round(max(gap, min(end_s, self.samples[-1][0] if self.samples else end_s) - last_change), 2)


def reference_md5(spec, fmt: str) -> dict[str, str]:
    """The clean render: each segment through the tone engine and encoder here, no services."""
    engine = ToneEngine()
    out = {}
    for s in spec.segments:
        req = SynthesisRequest(s.id, s.text, spec.voice_of(s), spec.seed_of(s), spec.params_of(s))
        (result,) = engine.synthesize([req])
        out[keys.segment(spec.id, s.chapter, s.index, fmt)] = hashlib.md5(
            encode(result.audio, engine.sample_rate, fmt)).hexdigest()
    return out


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--redis-restarts", type=int, default=1)
    ap.add_argument("--outages", type=int, default=1)
    ap.add_argument("--outage-s", type=float, default=30.0)
    ap.add_argument("--min-gap-s", type=float, default=5.0, help="least time between two faults")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--env", action="append", default=[], metavar="VOXBATCH_X=v",
                    help="extra worker/assembler settings (default: the shipped ones, tone engine at RTF 0)")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/chaos.json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    # The code under test is the checkout as the run starts (workers restarted later re-import it).
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()

    workdir = Path(tempfile.mkdtemp(prefix="vb-chaos-"))
    (workdir / "redis").mkdir()
    rds = services.start_redis(workdir / "redis", services.SHIPPED_PERSISTENCE)
    s3 = services.start_seaweed(workdir)
    procs: list[services.VoxbatchProcess] = []
    try:
        bucket = s3.new_bucket()
        s3.client().put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        tag = uuid.uuid4().hex[:6]
        env = {**os.environ, "VOXBATCH_BROKER_URL": rds.url, "VOXBATCH_STORAGE_URL": f"s3://{bucket}/chaos",
               "VOXBATCH_S3_ENDPOINT": s3.endpoint, "AWS_ACCESS_KEY_ID": services.S3_KEY,
               "AWS_SECRET_ACCESS_KEY": services.S3_SECRET, "AWS_REGION": "us-east-1",
               "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
               "VOXBATCH_ENGINE": "tone", "VOXBATCH_TONE_RTF": "0", "PYTHONUNBUFFERED": "1",
               **dict(kv.split("=", 1) for kv in a.env)}
        settings = Settings(**{k[len("VOXBATCH_"):].lower(): v for k, v in env.items()
                               if k.startswith("VOXBATCH_") and k[len("VOXBATCH_"):].lower() in Settings.model_fields},
                            aws_access_key_id=services.S3_KEY, aws_secret_access_key=services.S3_SECRET)
        storage = S3Storage(settings.storage_url, settings)
        jobs = RedisJobStore.from_url(rds.url)
        for i in range(a.workers):
            procs.append(services.VoxbatchProcess(["worker"], env, workdir / f"worker-{i}.log").start())
        procs.append(services.VoxbatchProcess(["assembler"], env, workdir / "assembler.log").start())
        for p in procs[:-1]:
            p.wait_ready(300)

        # Unique texts: with repeated ones the content-addressed cache (voxbatch/reuse.py) would
        # render each text once and copy it for the rest, and the faults would hit few renders.
        base = make_spec(a.segments)
        spec = base.model_copy(update={"segments": [s.model_copy(update={"text": f"{s.text} Line {i}."})
                                                     for i, s in enumerate(base.segments)]})
        n = len(spec.segments)
        plan = (["kill"] * a.kills + ["redis_restart"] * a.redis_restarts + ["storage_outage"] * a.outages)
        marks = sorted(rng.uniform(0.05, 0.85) for _ in plan)
        rng.shuffle(plan)
        schedule = list(zip(marks, plan))
        print(f"chaos: {n} segments, {a.workers} workers; faults at progress {[(round(m, 2), k) for m, k in schedule]}",
              flush=True)

        t0, submitted_at = time.monotonic(), time.time()
        submit_job(spec, settings, storage)
        progress = Progress(jobs, spec.id, n, t0)
        faults: list[Fault] = []
        killed: set[int] = set()
        last_fault = -a.min_gap_s
        deadline = t0 + a.timeout_s
        while progress.state not in FINISHED and time.monotonic() < deadline:
            time.sleep(0.2)
            if (not schedule or progress.finished() < schedule[0][0] * n
                    or time.monotonic() - t0 - last_fault < a.min_gap_s):
                continue
            _, kind = schedule.pop(0)
            at = time.monotonic() - t0
            if kind == "kill":
                # A worker whose process is up (a launcher may still be restarting the last one killed).
                live = {i: [p for p in children(procs[i].proc.pid) if p not in killed] for i in range(a.workers)}
                victim = rng.choice([i for i, pids in live.items() if pids] or [0])
                for pid in live[victim]:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                faults.append(Fault(kind, round(at, 2), 0.0, detail=f"worker {victim} (pid {live[victim]})"))
            elif kind == "redis_restart":
                rds.restart()
                faults.append(Fault(kind, round(at, 2), round(time.monotonic() - t0 - at, 2), detail="SIGKILL, AOF reload"))
            else:
                s3.proc.kill()  # down at once, in-flight requests cut off
                s3.proc.wait(10)
                time.sleep(a.outage_s)
                s3.start()
                faults.append(Fault(kind, round(at, 2), round(time.monotonic() - t0 - at, 2), detail="SeaweedFS stopped"))
            last_fault = time.monotonic() - t0
            print(f"chaos: {faults[-1]} at {progress.finished()}/{n}", flush=True)
        wall_s = time.monotonic() - t0
        time.sleep(1)
        progress.stop()
        for f, nxt in zip(faults, [*faults[1:], None]):
            f.stall_s = progress.longest_gap(f.at_s, nxt.at_s if nxt else wall_s)
        status = jobs.status(spec.id)

        # Verify against storage: versions per key (a second PUT is a second version), and bytes (ETag = MD5).
        client = s3.client()
        prefix = f"chaos/{keys.segments_prefix(spec.id)}"
        versions: dict[str, list[str]] = {}
        written: dict[str, list[float]] = {}  # seconds after submit of each version, for the report
        for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
            for v in page.get("Versions", []):
                key = v["Key"][len("chaos/"):]
                versions.setdefault(key, []).append(v["ETag"].strip('"'))
                written.setdefault(key, []).append(round(v["LastModified"].timestamp() - submitted_at, 1))
        reference = reference_md5(spec, spec.format)
        stored = {k: v for k, v in versions.items() if k in reference}
        result = {
            "benchmark": "chaos",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "segments": n,
            "stored_once": sum(len(v) == 1 for v in stored.values()),
            "lost": n - len(stored),
            "duplicated": sum(len(v) > 1 for v in stored.values()),
            "duplicated_writes_s": {k.rsplit("/", 1)[-1]: sorted(written[k]) for k, v in stored.items() if len(v) > 1},
            "failed": status.failed if status else None,
            "identical_to_clean": sum(v[0] == reference[k] for k, v in stored.items() if len(set(v)) == 1),
            "state": status.state if status else None,
            "completed_by_itself": bool(status and status.state == "completed"),
            "swept": status.swept if status else None,
            "reused": status.reused if status else None,
            "rendered": int(jobs.r.hlen(RedisJobStore._k(spec.id, "attempts"))),
            "wall_s": round(wall_s, 1),
            "faults": [asdict(f) for f in faults],
            "workers": a.workers,
            "worker_restarts": [p.tail(10**8).count("restarting in") for p in procs[:-1]],
            "settings": {k: v for k, v in env.items() if k.startswith("VOXBATCH_") and "URL" not in k
                         and "QUEUE" not in k and "ENDPOINT" not in k},
            "redis_persistence": " ".join(services.SHIPPED_PERSISTENCE),
            "clean": "the same job rendered in this process (ToneEngine + encode, no services); compared by MD5",
            "hardware": {"cores": os.cpu_count(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                         "python": platform.python_version()},
            "seed": a.seed,
            "commit": commit,
            "command": "python -m bench.chaos " + " ".join(sys.argv[1:]),
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: result[k] for k in ("segments", "stored_once", "lost", "duplicated", "failed",
                                                  "identical_to_clean", "state", "swept", "wall_s")}), flush=True)
        for f in faults:
            print(f"  {f.kind:15s} at {f.at_s:7.1f} s  down {f.duration_s:5.1f} s  stall {f.stall_s:5.1f} s  {f.detail}")
        ok = (result["stored_once"] == n and result["identical_to_clean"] == n and result["failed"] == 0
              and result["completed_by_itself"] and len(faults) == len(plan))
        if not ok:
            print(f"chaos: FAILED; logs in {workdir}", file=sys.stderr)
            for p in procs:
                print(f"--- {p.log.name}\n{p.tail(3000)}", file=sys.stderr)
        sys.exit(0 if ok else 1)
    finally:
        for p in procs:
            p.stop()
        rds.stop()
        s3.stop()


if __name__ == "__main__":
    main()
