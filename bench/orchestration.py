"""Throughput and per-segment cost of the distributed path: producer → Redis → one worker → storage → done.

The worker runs the `tone` engine, which makes audio of real-speech length as fast as numpy can, so
what is measured is the path (broker, job state, encode, upload, bookkeeping), not a model. Variants
run side by side in one invocation and are reported as segments/s and audio-seconds/s, with ratios:

  s3      one `voxbatch worker` process, SeaweedFS S3 on loopback, real Redis
  local   the same worker process writing to a local folder (file://), real Redis
  inproc  the pipeline alone in this process (no broker, no Redis), local folder: the ceiling

For the distributed variants the same run also measures what one segment costs the shared services,
which is what sizes Redis and S3 for a fleet (docs/scaling.md):

  Redis commands per segment   server side, `INFO commandstats` delta over the job (commands run
                               inside the Lua scripts included), less this bench's own polling
  round trips per segment      client side: every redis-py socket write (one command, one pipeline
                               or one MULTI/EXEC block) counted in the worker and producer processes,
                               by kind; cross-checked against `INFO stats` total_reads_processed
  Redis CPU per segment        `INFO cpu` used_cpu_{user,sys}_main_thread delta over the job
  Redis memory                 per queued segment (tasks published to a queue nobody consumes:
                               `MEMORY USAGE` of the list and the `used_memory` delta, at two text
                               lengths) and per finished segment (`MEMORY USAGE` of the job's keys)
  connections per worker       TCP connections from the worker's processes to Redis (psutil), peak
                               over the run, and what each was last used for (`CLIENT LIST`)
  S3 requests per segment      client side, every botocore API call by operation, in the worker,
                               the producer (this process) and, for s3, an assembler run afterwards
  KEDA blind spot              while the job runs, how long the render list is empty while segments
                               are still outstanding (`LLEN` vs `vb:load`), and how many

The counting in the worker and assembler processes is a small `sitecustomize` this bench writes into
its temporary folder and puts on their PYTHONPATH (COUNTER_SHIM below); nothing in voxbatch changes.
Finally `redis-benchmark` (Debian's redis-tools) measures what this Redis sustains for the commands
the path sends (the real `finish` script, a real render-task message), and the per-segment mix is
priced with those rates, so the single-Redis ceiling is a measured number on recorded hardware.

Usage (from the repo root): python -m bench.orchestration [--segments 2000] [--out bench/results/orchestration.json]
A GPU producing 100 segments/s needs each variant above 100 segments/s.

Re-render after an edit (the content-addressed segment cache, voxbatch/reuse.py): on the s3 setup, a
book of the same size with every segment's text distinct is rendered in full, then the same book with
1% of its segments edited is rendered again (a new job, as a resubmitted book is); reported are the
segments each rendered (the rest reused from storage) and the wall time until every segment is
recorded, side by side. The three throughput variants above render with reuse off (`JobSpec.reuse`):
their texts repeat, and they measure the path, not the cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import psutil
import redis
from rich.console import Console
from rich.table import Table

from bench.provenance import commit, cpu_model
from voxbatch.producer.submit import render_tasks
from voxbatch import testing_services as services
from voxbatch import jobstate
from voxbatch.celery_app import configure_celery, send_render
from voxbatch.jobstate import MemoryJobStore, RedisJobStore
from voxbatch.models import JobSpec, Segment
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage, open_storage
from voxbatch.worker.pipeline import Pipeline
from voxbatch.worker.tone import ToneEngine, tone_duration_s

REPO = Path(__file__).resolve().parents[1]

SENTENCES = [
    "The river ran quiet under the old stone bridge.",
    "She opened the letter, read it twice, and put it back in the drawer without a word.",
    "Rain again.",
    "By the time the lanterns were lit, the square had filled with travellers from the north road.",
    "He laughed.",
    "Nobody in the village remembered who had planted the orchard, only that it had always been there.",
]
SCRIPT_NAMES = {hashlib.sha1(src.encode()).hexdigest()[:8]: name for name, src in
                (("finish", jobstate._FINISH), ("cancel", jobstate._CANCEL), ("reopen", jobstate._REOPEN))}
BENCH_ONLY = {"info", "client|list", "memory|usage", "hello", "client|setinfo"}  # never part of the path
IDLE_S = 6.0  # idle window (longer than the 5-s unacked-restore interval) before each job: what a worker costs Redis with nothing to do

# Counts Redis round trips (one socket write of one command, a pipeline or a MULTI/EXEC block, by the
# command names in it) and botocore API calls (by operation) in a process. `install(dir)` writes the
# counts to dir/<pid>.json every 0.2 s; `install(None)` only counts (this process reads them itself).
COUNTER_SHIM = r'''
import json, os, sys, threading, time
from collections import Counter

def _names(command):
    chunks = [command] if isinstance(command, (str, bytes, bytearray, memoryview)) else command
    buf = b"".join(c.encode() if isinstance(c, str) else bytes(c) for c in chunks)
    names, i = [], 0
    while buf[i:i + 1] == b"*":
        j = buf.index(b"\r\n", i); n = int(buf[i + 1:j]); i = j + 2
        args = []
        for a in range(n):
            j = buf.index(b"\r\n", i); ln = int(buf[i + 1:j]); i = j + 2
            if a < 2:
                args.append(buf[i:i + ln].decode(errors="replace"))
            i += ln + 2
        name = args[0].upper()
        names.append(name + ":" + args[1][:8] if name == "EVALSHA" and len(args) > 1 else name)
    return " ".join(names) or "?"

def install(out_dir):
    counts = {"redis": Counter(), "s3": Counter(), "s3_http": Counter()}
    lock = threading.Lock()
    def bump(kind, key):
        with lock:
            counts[kind][key] += 1
    try:
        import redis.connection as rc
        send = rc.AbstractConnection.send_packed_command
        def send_packed_command(self, command, check_health=True):
            bump("redis", _names(command))
            return send(self, command, check_health)
        rc.AbstractConnection.send_packed_command = send_packed_command
    except ImportError:
        pass
    try:
        import botocore.client as bc, botocore.endpoint as be
        call, http = bc.BaseClient._make_api_call, be.Endpoint._send
        def _make_api_call(self, operation_name, api_params):
            bump("s3", operation_name)
            return call(self, operation_name, api_params)
        def _send(self, request):
            bump("s3_http", request.method)
            return http(self, request)
        bc.BaseClient._make_api_call, be.Endpoint._send = _make_api_call, _send
    except ImportError:
        pass
    def snapshot():
        with lock:
            return {k: dict(v) for k, v in counts.items()}
    if out_dir:
        path = os.path.join(out_dir, f"{os.getpid()}.json")
        def write():
            while True:
                data = {"pid": os.getpid(), "argv": sys.argv, **snapshot()}
                with open(path + ".tmp", "w") as f:
                    json.dump(data, f)
                os.replace(path + ".tmp", path)
                time.sleep(0.2)
        threading.Thread(target=write, name="bench-counters", daemon=True).start()
    return snapshot
'''


def make_spec(n: int, sentences_per_segment: int = 1, *, reuse: bool = False, distinct: bool = False,
              edit_every: int = 0) -> JobSpec:
    """`distinct`: every segment's text its own (numbered); `edit_every` > 0: every that-many-th
    segment edited (the 1%-edited book is edit_every=100)."""
    k = len(SENTENCES)
    texts = [" ".join(SENTENCES[(i + j) % k] for j in range(sentences_per_segment)) for i in range(n)]
    if distinct:
        texts = [f"{t} Part {i}." for i, t in enumerate(texts)]
    if edit_every:
        texts = [f"{t} Revised." if i % edit_every == 0 else t for i, t in enumerate(texts)]
    segs = [Segment(chapter=i // 200, index=i % 200, text=t) for i, t in enumerate(texts)]
    return JobSpec(id=uuid.uuid4().hex[:12], name="bench", voice="tone", chapters=[f"c{c}" for c in range(n // 200 + 1)],
                   segments=segs, created_at=time.time(), source="bench", reuse=reuse)


def hardware() -> dict:
    cpu = cpu_model()
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "platform": platform.platform(), "redis": redis_version,
            "note": "Redis, SeaweedFS, the worker, the bench and redis-benchmark all share these cores"}


# -- counting ------------------------------------------------------------------------------------

def sub(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys() if a.get(k, 0) != b.get(k, 0)}


def per(counts: dict, n: float, digits: int = 3) -> dict:
    return {k: round(v / n, digits) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def n_commands(kinds: dict) -> int:
    return sum(len(kind.split()) * n for kind, n in kinds.items())


def name_scripts(kinds: dict) -> dict:
    def rename(kind: str) -> str:
        return " ".join(f"EVALSHA({SCRIPT_NAMES.get(w[8:], w[8:])})" if w.startswith("EVALSHA:") else w
                        for w in kind.split())
    return {rename(k): v for k, v in kinds.items()}


def process_counts(count_dir: Path) -> dict[str, dict]:
    """Counts written by the shim, summed per role (worker process, launcher, assembler)."""
    out: dict[str, dict] = {}
    for f in count_dir.glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        argv = " ".join(data.get("argv") or [])
        role = ("worker" if "voxbatch/worker/main.py" in argv or "voxbatch.worker.main" in argv  # `python -m voxbatch.worker.main`
                else "assembler" if "assembler" in argv else "launcher")
        acc = out.setdefault(role, {"redis": Counter(), "s3": Counter(), "s3_http": Counter()})
        for kind in acc:
            acc[kind].update(data.get(kind, {}))
    return {role: {k: dict(v) for k, v in acc.items()} for role, acc in out.items()}


def role_delta(after: dict, before: dict, role: str) -> dict:
    a, b = after.get(role, {}), before.get(role, {})
    return {k: sub(a.get(k, {}), b.get(k, {})) for k in ("redis", "s3", "s3_http")}


def redis_snapshot(r: redis.Redis) -> dict:
    stats, cmd, cpu = r.info("stats"), r.info("commandstats"), r.info("cpu")
    return {"commands": {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmd.items()},
            "reads": stats["total_reads_processed"], "commands_processed": stats["total_commands_processed"],
            "cpu_s": cpu["used_cpu_user_main_thread"] + cpu["used_cpu_sys_main_thread"],
            "used_memory": r.info("memory")["used_memory"]}


def redis_connections(pids: list[int], port: int) -> dict[int, set[int]]:
    """pid -> local ports of its TCP connections to Redis."""
    out: dict[int, set[int]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        out[pid] = {c.laddr.port for c in conns if c.raddr and c.raddr.port == port and c.status == "ESTABLISHED"}
    return out


def process_tree(pid: int) -> list[int]:
    try:
        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


# -- memory --------------------------------------------------------------------------------------

def queued_memory(r: redis.Redis, settings: Settings, n: int) -> dict:
    """Bytes per queued segment: the job's tasks published to a queue no worker consumes, at two text
    lengths (1 and 2 sentences per segment), so the cost is known as fixed + per character."""
    points = []
    message = ""
    for k in (1, 2):
        spec = make_spec(n, k)
        q = f"memprobe-{uuid.uuid4().hex[:6]}"
        r.delete(q)
        before = r.info("memory")["used_memory"]
        tasks = list(render_tasks(spec, settings.batch_size))
        for task in tasks:
            send_render(task, q)
        after = r.info("memory")["used_memory"]
        list_bytes = r.memory_usage(q, samples=0)
        message = message or r.lindex(q, 0).decode()
        chars = sum(len(s.text) for s in spec.segments) / n
        points.append({"sentences_per_segment": k, "mean_text_chars": round(chars, 1), "tasks": len(tasks),
                       "list_bytes_per_segment": round(list_bytes / n, 1),
                       "used_memory_delta_per_segment": round((after - before) / n, 1)})
        r.delete(q)
    a, b = points
    per_char = (b["list_bytes_per_segment"] - a["list_bytes_per_segment"]) / (b["mean_text_chars"] - a["mean_text_chars"])
    fixed = a["list_bytes_per_segment"] - per_char * a["mean_text_chars"]
    return {"points": points, "bytes_per_segment_fixed": round(fixed, 1), "bytes_per_text_char": round(per_char, 2),
            "batch_size": settings.batch_size, "message_bytes": len(message), "_message": message}


def finished_memory(r: redis.Redis, job_id: str, n: int) -> dict:
    keys = {part or "hash": RedisJobStore._k(job_id, part) for part in ("", "done", "attempts", "failed", "errors")}
    sizes = {part: r.memory_usage(key, samples=0) or 0 for part, key in keys.items()}
    encodings = {part: r.object("encoding", key).decode() for part, key in keys.items() if r.exists(key)}
    return {"bytes_per_segment": round(sum(sizes.values()) / n, 1), "bytes_by_key": sizes, "encodings": encodings}


# -- runs ----------------------------------------------------------------------------------------

def run_distributed(spec: JobSpec, env: dict[str, str], settings: Settings, workdir: Path, label: str,
                    counters, assemble: bool) -> dict:
    """Start one worker process, enqueue the job's tasks, time until every segment is recorded done,
    and measure what the job cost Redis and storage on the way."""
    n = len(spec.segments)
    count_dir = workdir / f"counts-{label}"
    count_dir.mkdir()
    env = {**env, "VB_BENCH_COUNTS": str(count_dir),
           "PYTHONPATH": os.pathsep.join([str(workdir / "shim"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = redis.Redis.from_url(settings.broker_url)
    port = r.connection_pool.connection_kwargs["port"]
    worker = services.VoxbatchProcess(["worker"], env, workdir / f"worker-{label}.log").start()
    out: dict = {}
    try:
        worker.wait_ready(120)
        storage = open_storage(settings)
        jobs = RedisJobStore.from_url(settings.broker_url)
        configure_celery(settings)
        time.sleep(0.5)
        idle0, idle_server0 = process_counts(count_dir), redis_snapshot(r)
        time.sleep(IDLE_S)
        idle1, idle_server1 = process_counts(count_dir), redis_snapshot(r)
        idle_cpu_s_per_s = (idle_server1["cpu_s"] - idle_server0["cpu_s"]) / IDLE_S
        server0, procs0 = redis_snapshot(r), process_counts(count_dir)
        bench0 = counters()

        t0 = time.perf_counter()
        storage.put(f"jobs/{spec.id}/job.json", spec.model_dump_json().encode())
        jobs.create(spec.id, spec.name, spec.voice, spec.format, n, spec.created_at)
        for task in render_tasks(spec, settings.batch_size):
            send_render(task, settings.render_queue)
        t_enqueued = time.perf_counter() - t0
        bench1 = counters()

        # Poll until done; one pipelined round trip per poll (subtracted from the server's counts below).
        job_key = RedisJobStore._k(spec.id)
        poll = r.pipeline(transaction=False)
        samples: list[tuple[float, int, int]] = []  # (t, render list length, segments outstanding)
        peak: Counter = Counter()
        client_list: dict = {}
        last_conn_check = 0.0
        while True:
            poll.hmget(job_key, "done", "failed").llen(settings.render_queue).get("vb:load")
            (done, failed), llen, load = poll.execute()
            t = time.perf_counter() - t0
            finished = int(done or 0) + int(failed or 0)
            samples.append((t, int(llen), int(load or 0)))
            if finished >= n:
                break
            if t - last_conn_check > 0.2:
                last_conn_check = t
                conns = redis_connections(process_tree(worker.proc.pid), port)
                for pid, ports in conns.items():
                    peak[pid] = max(peak[pid], len(ports))
                if not client_list and finished >= n // 2:
                    ports = set().union(*conns.values()) if conns else set()
                    client_list = Counter(f"{c['cmd']} ({'pubsub' if int(c['sub']) or int(c['psub']) else 'cmd'})"
                                          for c in r.client_list() if int(c["addr"].rsplit(":", 1)[1]) in ports)
            if t > 900:
                raise TimeoutError(f"{label}: job not done after 900 s:\n{worker.tail()}")
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        server1 = redis_snapshot(r)
        bench2 = counters()
        time.sleep(0.3)  # the shim writes every 0.2 s
        procs1 = process_counts(count_dir)

        out = {"wall_s": wall, "enqueue_s": t_enqueued}
        producer = {k: sub(bench1[k], bench0[k]) for k in bench1}
        monitor = sub(bench2["redis"], bench1["redis"])
        worker_d = role_delta(procs1, procs0, "worker")
        idle = role_delta(idle1, idle0, "worker")["redis"]
        # Server-side commands of the path: everything Redis ran in the window, less this bench's polling
        # (counted client side, plain commands only) and the INFO/CLIENT/MEMORY calls of the measurement.
        monitor_cmds = Counter()
        for kind, c in monitor.items():
            for name in kind.split():
                if name not in ("INFO", "CLIENT", "MEMORY"):  # BENCH_ONLY, named by subcommand server side
                    monitor_cmds[name.lower()] += c
        server_cmds = {k: v for k, v in sub(sub(server1["commands"], server0["commands"]), monitor_cmds).items()
                       if k not in BENCH_ONLY}
        worker_rt, producer_rt = sum(worker_d["redis"].values()), sum(producer["redis"].values())
        bench_requests = sum(monitor.values()) + 4  # polls, plus the INFO calls of the two snapshots in the window
        out["redis"] = {
            "commands_per_segment": round(sum(server_cmds.values()) / n, 2),
            "commands_per_segment_by_type": per(server_cmds, n),
            "round_trips_per_segment": round((worker_rt + producer_rt) / n, 2),
            "round_trips_per_segment_worker": round(worker_rt / n, 3),
            "round_trips_per_segment_producer": round(producer_rt / n, 3),
            "round_trips_per_segment_by_kind": {"worker": per(name_scripts(worker_d["redis"]), n),
                                                "producer": per(name_scripts(producer["redis"]), n)},
            "client_commands_per_segment": round((n_commands(worker_d["redis"]) + n_commands(producer["redis"])) / n, 2),
            "server_reads_per_segment": round((server1["reads"] - server0["reads"] - bench_requests) / n, 2),
            "main_thread_cpu_us_per_segment": round((server1["cpu_s"] - server0["cpu_s"]) * 1e6 / n, 1),
            # less what Redis burns per second anyway (serverCron, the idle worker's BRPOP timeouts)
            "main_thread_cpu_us_per_segment_above_idle": round(
                (server1["cpu_s"] - server0["cpu_s"] - idle_cpu_s_per_s * wall) * 1e6 / n, 1),
            "idle_main_thread_cpu_ms_per_s": round(idle_cpu_s_per_s * 1e3, 2),
            "bench_polls": sum(monitor.values()),
            "idle_worker_round_trips_per_s": per(name_scripts(idle), IDLE_S, 2),
            "peak_connections_per_worker_process": max(peak.values(), default=0),
            "peak_connections_by_process": {("launcher" if pid == worker.proc.pid else "worker"): c
                                            for pid, c in peak.items()},
            "connections_at_half_job_by_last_command": dict(client_list),
        }
        out["redis"]["finished_memory"] = finished_memory(r, spec.id, n)
        out["storage_requests_per_segment"] = {
            "worker": per(worker_d["s3"], n), "worker_http_requests": round(sum(worker_d["s3_http"].values()) / n, 3),
            "producer_per_job": producer["s3"],
        }
        empty = [(t, o) for t, llen, o in samples if llen == 0 and o > 0]
        gaps = [b[0] - a[0] for a, b in zip(samples, samples[1:]) if a[1] == 0 and a[2] > 0]
        out["blind_spot"] = {
            "poll_interval_s": 0.05, "polls": len(samples),
            "seconds_list_empty_while_outstanding": round(sum(gaps), 2),
            "share_of_wall": round(sum(gaps) / wall, 3),
            "max_outstanding_while_list_empty": max((o for _, o in empty), default=0),
            "first_empty_list_at_s": round(empty[0][0], 2) if empty else None,
        }
    finally:
        worker.stop()
    if assemble:
        out["assembly"] = run_assembler(spec, env, settings, workdir, label, count_dir, r)
    return out


def run_assembler(spec: JobSpec, env: dict[str, str], settings: Settings, workdir: Path, label: str,
                  count_dir: Path, r: redis.Redis) -> dict:
    """Assemble the finished job (its one assemble task is queued) and count the assembler's requests.
    ffmpeg is kept off the assembler's PATH: the .m4b adds one multipart upload per job and minutes of
    AAC encoding that say nothing about the path."""
    n = len(spec.segments)
    env = {**env, "PATH": str(Path(sys.executable).parent)}
    jobs = RedisJobStore.from_url(settings.broker_url)
    server0 = redis_snapshot(r)
    t0 = time.perf_counter()
    proc = services.VoxbatchProcess(["assembler"], env, workdir / f"assembler-{label}.log").start()
    try:
        services.wait_until(lambda: jobs.state(spec.id) in ("completed", "completed_with_errors", "failed"),
                            600, f"{label} assembly", interval_s=0.2)
        wall = time.perf_counter() - t0
        time.sleep(0.3)
        counts = process_counts(count_dir).get("assembler", {})
    finally:
        proc.stop()
    server1 = redis_snapshot(r)
    s3 = counts.get("s3", {})
    return {"state": jobs.state(spec.id), "wall_s_with_process_start": round(wall, 2), "m4b": False,
            "storage_requests_per_segment": per(s3, n), "storage_requests_per_job": s3,
            "redis_round_trips_per_job": sum(counts.get("redis", {}).values()),
            "redis_commands_per_job_server": sum(v for k, v in sub(server1["commands"], server0["commands"]).items()
                                                 if k not in BENCH_ONLY)}


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


def run_rerender(n: int, env: dict[str, str], settings: Settings, workdir: Path, edit_every: int = 100) -> dict:
    """A distinct-text book rendered in full, then with every `edit_every`-th segment edited (new job):
    segments rendered and wall time of each, one worker process on the s3 setup, cache starting empty."""
    storage = open_storage(settings)
    jobs = RedisJobStore.from_url(settings.broker_url)
    configure_celery(settings)
    worker = services.VoxbatchProcess(["worker"], env, workdir / "worker-rerender.log").start()
    out: dict = {"segments": n, "edited_segments": len(range(0, n, edit_every)), "edited_fraction": 1 / edit_every}
    try:
        worker.wait_ready(120)
        for label, spec in (("full", make_spec(n, reuse=True, distinct=True)),
                            ("edited", make_spec(n, reuse=True, distinct=True, edit_every=edit_every))):
            t0 = time.perf_counter()
            storage.put(f"jobs/{spec.id}/job.json", spec.model_dump_json().encode())
            jobs.create(spec.id, spec.name, spec.voice, spec.format, n, spec.created_at)
            for task in render_tasks(spec, settings.batch_size):
                send_render(task, settings.render_queue)
            services.wait_until(lambda: (s := jobs.status(spec.id)) is not None and s.done + s.failed >= n, 900,
                                f"rerender {label}", interval_s=0.05)
            wall = time.perf_counter() - t0
            status = jobs.status(spec.id)
            out[label] = {"wall_s": round(wall, 2), "segments_rendered": n - status.reused,
                          "segments_reused": status.reused, "failed": status.failed,
                          "segments_per_s_effective": round(n / wall, 1)}
    finally:
        worker.stop()
    out["wall_ratio_edited_to_full"] = round(out["edited"]["wall_s"] / out["full"]["wall_s"], 3)
    return out


# -- the Redis ceiling ---------------------------------------------------------------------------

def redis_benchmark(port: int, args: list[str], n: int, clients: int = 50, pipeline: int = 1,
                    repeats: int = 3) -> dict:
    """requests/s of one command under redis-benchmark: the median of `repeats` runs (the cores are shared)."""
    cmd = ["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-c", str(clients), "-n", str(n),
           "-P", str(pipeline), "-r", "100000000", "--csv", *args]
    runs = []
    for _ in range(repeats):
        lines = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout.strip().splitlines()
        numeric = len(lines[0].split(",")) - 1  # "test","rps",...: the test name may itself hold commas
        runs.append(float(lines[-1].rsplit(",", numeric)[1].strip('"')))
    return {"median": sorted(runs)[len(runs) // 2], "runs": [round(x) for x in runs], "requests": n,
            "pipeline": pipeline, "command": " ".join(a if len(a) < 40 else f"<{len(a)} B>" for a in args[:6])}


def redis_ceiling(redis_url: str, message: str, mix: dict[str, dict], scale: float) -> dict:
    """Requests/s this Redis sustains (redis-benchmark, 50 clients) for each kind of request the path
    sends, and the segments/s that follow for the measured per-segment mix."""
    r = redis.Redis.from_url(redis_url)
    port = r.connection_pool.connection_kwargs["port"]
    r.flushall()
    job = "vb:job:{ceiling}"
    r.hset(job, mapping={"state": "running", "total": 10**15, "done": 0, "failed": 0, "audio_ms": 0, "assemble": 0})
    sha = r.script_load(jobstate._FINISH)
    k = lambda x: max(int(x * scale), 2000)  # noqa: E731
    rates = {
        "HGET (one command per round trip)": redis_benchmark(port, ["HGET", job, "state"], k(200_000)),
        "HGET pipelined 16 deep": redis_benchmark(port, ["HGET", job, "state"], k(1_000_000), pipeline=16),
        "EVALSHA finish (real script, new segment each call)": redis_benchmark(
            port, ["EVALSHA", sha, "4", job, job + ":done", job + ":failed", "vb:load", "__rand_int__", "done",
                   "4000", "", "1700000000"], k(100_000)),
        f"LPUSH one render task ({len(message)} B kombu message)": redis_benchmark(
            port, ["LPUSH", "ceiling-q", message], k(20_000)),
        "BRPOP one render task": redis_benchmark(port, ["BRPOP", "ceiling-q", "1"], k(20_000)),
    }
    r.flushall()
    runs, rates = rates, {k_: v["median"] for k_, v in rates.items()}
    simple_rt, simple_cmd = 1 / rates["HGET (one command per round trip)"], 1 / rates["HGET pipelined 16 deep"]
    special = {"EVALSHA(finish)": 1 / rates["EVALSHA finish (real script, new segment each call)"],
               "LPUSH": 1 / rates[next(x for x in rates if x.startswith("LPUSH"))],
               "BRPOP": 1 / rates["BRPOP one render task"]}

    def price(kinds: dict) -> float:
        """Redis seconds for a mix of round trips: measured rates for the script and the queue ops; for
        the rest one round trip's overhead plus one pipelined command's cost per command in it."""
        total = 0.0
        for kind, per_seg in kinds.items():
            words = kind.split()
            if len(words) == 1 and words[0] in special:
                total += per_seg * special[words[0]]
            else:
                total += per_seg * ((simple_rt - simple_cmd) + len(words) * simple_cmd)
        return total

    out = {"redis_benchmark": {"clients": 50, "requests_per_s": {k_: round(v) for k_, v in rates.items()},
                               "runs": runs, "ceiling_model": "per round trip: measured rate for EVALSHA(finish), "
                               "LPUSH, BRPOP; otherwise (1/HGET - 1/HGET pipelined) + commands x 1/HGET pipelined"}}
    for label, kinds in mix.items():
        s = price(kinds["worker"]) + price(kinds["producer"])
        out[label] = {"redis_us_per_segment": round(s * 1e6, 1), "segments_per_s": round(1 / s)}
    return out


# -- main ----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--upload-threads", type=int, default=8)
    ap.add_argument("--benchmark-scale", type=float, default=1.0, help="scale redis-benchmark request counts")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "orchestration.json")
    args = ap.parse_args()
    if shutil.which("redis-benchmark") is None:
        sys.exit("redis-benchmark not found (Debian: apt-get install redis-tools)")

    hw = hardware()
    workdir = Path(tempfile.mkdtemp(prefix="vb-bench-"))
    (workdir / "shim").mkdir()
    (workdir / "shim" / "sitecustomize.py").write_text(
        COUNTER_SHIM + "\nif os.environ.get('VB_BENCH_COUNTS'):\n    install(os.environ['VB_BENCH_COUNTS'])\n")
    namespace: dict = {}
    exec(compile(COUNTER_SHIM, "COUNTER_SHIM", "exec"), namespace)  # the same counters in this process
    counters = namespace["install"](None)

    redis_server = services.start_redis(workdir)
    s3 = services.start_seaweed(workdir)
    bucket = s3.new_bucket()
    common = {"VOXBATCH_BROKER_URL": redis_server.url, "VOXBATCH_ENGINE": "tone",
              "VOXBATCH_BATCH_SIZE": str(args.batch_size), "VOXBATCH_UPLOAD_THREADS": str(args.upload_threads),
              "VOXBATCH_TASK_CONCURRENCY": "4", "VOXBATCH_OUTPUT_QUEUE_SIZE": "256", "VOXBATCH_ENGINE_MAX_BATCH": "64"}
    variants = {
        "s3": {**common, "VOXBATCH_STORAGE_URL": f"s3://{bucket}/bench", "VOXBATCH_S3_ENDPOINT": s3.endpoint,
               "AWS_ACCESS_KEY_ID": services.S3_KEY, "AWS_SECRET_ACCESS_KEY": services.S3_SECRET},
        "local": {**common, "VOXBATCH_STORAGE_URL": (workdir / "local").as_uri()},
    }
    def settings_for(label: str) -> Settings:
        extra = variants[label]
        return Settings(**{k[9:].lower(): v for k, v in extra.items() if k.startswith("VOXBATCH_")},
                        aws_access_key_id=extra.get("AWS_ACCESS_KEY_ID"),
                        aws_secret_access_key=extra.get("AWS_SECRET_ACCESS_KEY"),
                        render_queue=f"render-{label}", assemble_queue=f"assemble-{label}")

    results: dict = {}
    try:
        configure_celery(settings_for("s3"))
        queued = queued_memory(redis.Redis.from_url(redis_server.url), settings_for("s3"), args.segments)
        for label, extra in variants.items():
            env = {**os.environ, **extra, "VOXBATCH_RENDER_QUEUE": f"render-{label}",
                   "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{label}"}
            results[label] = run_distributed(make_spec(args.segments), env, settings_for(label), workdir, label,
                                             counters, assemble=(label == "s3"))
        spec = make_spec(args.segments)
        results["inproc"] = run_inproc(spec, Settings(batch_size=args.batch_size, upload_threads=args.upload_threads,
                                                      output_queue_size=256), workdir / "inproc")
        message = queued.pop("_message")
        mix = {label: results[label]["redis"]["round_trips_per_segment_by_kind"] for label in variants}
        ceiling = redis_ceiling(redis_server.url, message, mix, args.benchmark_scale)
        s3_env = {**os.environ, **variants["s3"], "VOXBATCH_RENDER_QUEUE": "render-rerender",
                  "VOXBATCH_ASSEMBLE_QUEUE": "assemble-rerender",
                  "VOXBATCH_STORAGE_URL": f"s3://{s3.new_bucket()}/bench"}
        rerender = run_rerender(args.segments, s3_env, settings_for("s3").model_copy(update={
            "render_queue": "render-rerender", "assemble_queue": "assemble-rerender",
            "storage_url": s3_env["VOXBATCH_STORAGE_URL"]}), workdir)
    finally:
        s3.stop()
        redis_server.stop()
    for label in variants:
        cpu_us = results[label]["redis"]["main_thread_cpu_us_per_segment_above_idle"]
        ceiling[label]["segments_per_s_from_path_cpu"] = round(1e6 / cpu_us) if cpu_us > 0 else None

    audio_s = sum(tone_duration_s(s.text) for s in make_spec(args.segments).segments)
    report(args.segments, audio_s, results, queued, ceiling, rerender)
    hw["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out = {"benchmark": "orchestration", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit(),
           "segments": args.segments, "audio_s": audio_s,
           "mean_segment_audio_s": round(audio_s / args.segments, 2),
           "mean_segment_text_chars": round(sum(len(s.text) for s in make_spec(args.segments).segments)
                                            / args.segments, 1),
           "settings": {"batch_size": args.batch_size, "upload_threads": args.upload_threads, "task_concurrency": 4,
                        "output_queue_size": 256, "format": "wav", "unacked_restore_interval_s": 5.0},
           "hardware": hw, "results": results, "redis_queued_memory": queued, "redis_ceiling": ceiling,
           "rerender_after_edit": rerender,
           "command": f"python -m bench.orchestration --segments {args.segments}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    shutil.rmtree(workdir, ignore_errors=True)


def report(n: int, audio_s: float, results: dict, queued: dict, ceiling: dict, rerender: dict) -> None:
    console = Console(width=150)
    best = max(n / r["wall_s"] for r in results.values())
    table = Table(title=f"voxbatch orchestration: {n} segments, {audio_s / 3600:.2f} h of audio (tone engine)")
    for col in ("variant", "wall s", "segments/s", "audio s/s", "x of best", "enqueue s"):
        table.add_column(col, justify="right")
    for label, r in results.items():
        r["segments_per_s"] = n / r["wall_s"]
        r["audio_s_per_s"] = audio_s / r["wall_s"]
        table.add_row(label, f"{r['wall_s']:.2f}", f"{r['segments_per_s']:.0f}", f"{r['audio_s_per_s']:.0f}",
                      f"{r['segments_per_s'] / best:.2f}", f"{r['enqueue_s']:.2f}")
    console.print(table)

    table = Table(title="per segment, what the shared services pay")
    for col in ("variant", "Redis cmds", "round trips", "reads (server)", "Redis CPU µs", "finished B",
                "conns/worker", "storage req", "list empty s (max outstanding)"):
        table.add_column(col, justify="right")
    for label, r in results.items():
        if "redis" not in r:
            continue
        x, b = r["redis"], r["blind_spot"]
        table.add_row(label, f"{x['commands_per_segment']:.2f}", f"{x['round_trips_per_segment']:.2f}",
                      f"{x['server_reads_per_segment']:.2f}", f"{x['main_thread_cpu_us_per_segment']:.0f}",
                      f"{x['finished_memory']['bytes_per_segment']:.0f}", str(x["peak_connections_per_worker_process"]),
                      ", ".join(f"{k} {v}" for k, v in r["storage_requests_per_segment"]["worker"].items()),
                      f"{b['seconds_list_empty_while_outstanding']} ({b['max_outstanding_while_list_empty']})")
    console.print(table)
    s3 = results["s3"]["redis"]
    console.print("Redis commands per segment by type (s3):",
                  ", ".join(f"{k} {v}" for k, v in s3["commands_per_segment_by_type"].items()))
    for side, kinds in s3["round_trips_per_segment_by_kind"].items():
        console.print(f"round trips per segment, {side} (s3):", ", ".join(f"{k} {v}" for k, v in kinds.items()))
    console.print("queued: " + "; ".join(f"{p['mean_text_chars']} chars/segment -> {p['list_bytes_per_segment']} B "
                                         f"(used_memory {p['used_memory_delta_per_segment']} B)" for p in queued["points"])
                  + f"; = {queued['bytes_per_segment_fixed']} B + {queued['bytes_per_text_char']} B/char")
    if "assembly" in results["s3"]:
        a = results["s3"]["assembly"]
        console.print(f"assembly (s3): {a['state']} in {a['wall_s_with_process_start']} s; storage requests per "
                      f"segment {a['storage_requests_per_segment']}")
    table = Table(title="Redis ceiling (redis-benchmark, 50 clients, same machine)")
    table.add_column("request")
    table.add_column("requests/s", justify="right")
    for k, v in ceiling["redis_benchmark"]["requests_per_s"].items():
        table.add_row(k, f"{v:,}")
    for label in results:
        if label in ceiling:
            c = ceiling[label]
            table.add_row(f"{label}: segments/s for the measured mix (priced by redis-benchmark)",
                          f"{c['segments_per_s']:,}")
            table.add_row(f"{label}: segments/s from Redis CPU in the real run",
                          f"{c['segments_per_s_from_path_cpu']:,}")
    console.print(table)
    table = Table(title=f"re-render after editing {rerender['edited_fraction']:.0%} of a {n}-segment book (s3, one worker)")
    for col in ("render", "segments rendered", "reused", "wall s", "x of full"):
        table.add_column(col, justify="right")
    for label in ("full", "edited"):
        r = rerender[label]
        table.add_row(label, str(r["segments_rendered"]), str(r["segments_reused"]), f"{r['wall_s']:.2f}",
                      f"{r['wall_s'] / rerender['full']['wall_s']:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
