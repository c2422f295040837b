"""How long a job's intake keeps the GIL from the LLM thread, with the CosyVoice2 engine's own prepare.

At a job's start its tasks reach a worker together: Celery's task threads each take one in
(`Pipeline.submit`: lookups, then `Engine.prepare` of every segment, which tokenizes its text) while the
engine's LLM thread places its first rows, and all of them share one GIL. On the GPU the LLM thread's
first placement took 146 ms of wall time for 28 ms of its own CPU (bench/results/gpu_h100_s45a_worker.json).

This drives the worker's own `Pipeline.submit` from `--threads` task threads at once (tasks of `--task`
segments, as `voxbatch submit` cuts them), the engine a `CosyVoice2Engine` built from an official model
folder (the fixture's by default) and not started, storage a local folder. Beside them a probe thread
stands in for the LLM thread: it sleeps 1 ms over and over and records how late it wakes (the worker
timeline's GIL probe, voxbatch/worker/timeline.py). Variants (bench switches, bench/switches.py) are run
interleaved, side by side: by default the shipped engine against `together=0` (one `prepare` a segment
instead of a task's segments tokenized in one call that lets go of the GIL).

Usage (repo root): python -m bench.intake_gil [--model-dir DIR] [--segments 512] [--task 16] [--threads 32]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.intake_host import make_spec
from bench.provenance import FIXTURE, commit, cpu_model
from bench.switches import parse_switches, switched

REPO = Path(__file__).resolve().parents[1]
PROBE_S = 0.001


class GilProbe:
    """A thread that sleeps PROBE_S over and over, recording how late each wake-up gets the GIL."""

    def __init__(self):
        self.late_us: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(PROBE_S)
            self.late_us.append(1e6 * (time.perf_counter() - t - PROBE_S))

    def __enter__(self) -> "GilProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def build_engine(model_dir: Path, voices: Path):
    """The worker's CosyVoice2 engine on the CPU (`from_settings`, as a worker builds it), its voice
    'bench' made from the folder's prompt recording and stored where the engine reads voices."""
    from voxbatch.producer.voice import create_voice
    from voxbatch.settings import Settings
    from voxbatch.storage import LocalStorage
    from voxbatch.voice import save_voice
    from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine

    meta = json.loads((model_dir / "reference_meta.json").read_text())
    save_voice(LocalStorage(voices), create_voice(model_dir, "bench", model_dir / "prompt_24k.wav", meta["e2e"]["prompt_text"]))
    settings = Settings(engine="cosyvoice2", model_dir=str(model_dir), storage_url=voices.resolve().as_uri(),
                        engine_max_batch=8, llm_device="cpu")
    return CosyVoice2Engine.from_settings(settings)


def one_job(engine, n: int, task_size: int, threads: int, store: Path) -> dict:
    """One job's tasks submitted from `threads` threads at once; the probe's lateness meanwhile."""
    from voxbatch.jobstate import MemoryJobStore
    from voxbatch.producer.submit import render_tasks
    from voxbatch.settings import Settings
    from voxbatch.storage import LocalStorage
    from voxbatch.worker.pipeline import Pipeline

    spec = make_spec(n, reuse=False).model_copy(update={"voice": "bench"})
    jobs = MemoryJobStore()
    jobs.create(spec.id, spec.name, spec.voice, spec.format, n, 0.0)
    settings = Settings()
    pipeline = Pipeline(engine, LocalStorage(store), jobs, settings, lambda _job: None)
    tasks = list(render_tasks(spec, task_size))
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)  # as Pipeline.start sets it in a worker
    with ThreadPoolExecutor(threads) as pool, GilProbe() as probe:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        handles = list(pool.map(pipeline.submit, tasks))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    queued = list(pipeline.intake.queue)
    pipeline.abandon()
    pipeline.stop(timeout_s=1.0)
    prepared = sum(r is not None and r.prepared is not None for r in queued)
    if len(queued) != n or prepared != n or any(h.skipped for h in handles):
        raise SystemExit(f"{len(queued)} of {n} segments queued, {prepared} of them prepared")
    late = sorted(probe.late_us)
    return {"wall_ms": 1e3 * wall, "cpu_ms": 1e3 * cpu, "probe_wakeups": len(late),
            "probe_late_us_mean": statistics.fmean(late) if late else 0.0,
            "probe_late_us_p90": late[int(0.9 * (len(late) - 1))] if late else 0.0,
            "probe_late_us_max": late[-1] if late else 0.0,
            "probe_late_ms_total": sum(late) / 1e3}  # the GIL time the probe was kept waiting over the intake


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=FIXTURE, help="an official CosyVoice2 model folder")
    ap.add_argument("--segments", type=int, default=512)
    ap.add_argument("--task", type=int, default=16, help="segments per task (VOXBATCH_BATCH_SIZE)")
    ap.add_argument("--threads", type=int, default=32, help="task threads submitting at once (a worker's Celery threads)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per variant, interleaved; the median is reported")
    ap.add_argument("--variants", nargs="+", default=["shipped", "together=0"],
                    help="'shipped' or bench-switch specs (bench/switches.py)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "intake_gil.json")
    a = ap.parse_args()
    if not (a.model_dir / "reference_meta.json").is_file():
        ap.error(f"{a.model_dir}: not the fixture's model folder (no reference_meta.json with the prompt's transcript)")
    if len(set(a.variants)) != len(a.variants):
        ap.error(f"--variants repeats a variant: {' '.join(a.variants)}")
    try:
        runs = {v: ({} if v == "shipped" else parse_switches(v)) for v in a.variants}
    except SystemExit as e:  # parse_switches names the bad key or value
        ap.error(str(e))
    with tempfile.TemporaryDirectory(prefix="bench-intake-gil-") as tmp:
        engine = build_engine(a.model_dir, Path(tmp) / "voices")
        n_store = 0

        def job(spec: str) -> dict:
            nonlocal n_store
            n_store += 1
            with switched(runs[spec]):
                return one_job(engine, a.segments, a.task, a.threads, Path(tmp) / f"store{n_store}")

        for spec in runs:
            job(spec)  # warm-up: imports, the voice in the engine's cache, the tokenizer's threads
        rounds: dict[str, list[dict]] = {v: [] for v in runs}
        for _ in range(a.rounds):
            for spec in runs:  # interleaved, so a slow moment of the machine spreads over every variant
                rounds[spec].append(job(spec))
    keys = list(next(iter(rounds.values()))[0])
    rows = {v: {k: round(statistics.median(r[k] for r in rs), 1) for k in keys} | {"rounds": rs} for v, rs in rounds.items()}
    first = rows[a.variants[0]]
    for r in rows.values():
        r["wall_over_first"] = round(r["wall_ms"] / first["wall_ms"], 3) if first["wall_ms"] else None
    result = {"commit": commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "hardware": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
              "model_dir": a.model_dir.name, "segments": a.segments, "task": a.task, "threads": a.threads,
              "rounds": a.rounds, "storage": "local folder", "job_store": "in memory", "variants": rows}
    print(f"a job's intake from {a.threads} task threads ({a.segments} segments in tasks of {a.task}, CosyVoice2 engine "
          f"from {a.model_dir.name}, local folder; median of {a.rounds}; commit {result['commit'][:12]})")
    print("| variant | intake wall ms | vs first | probe kept waiting, ms in all | probe late, mean us | p90 us | CPU ms |\n"
          "|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        print(f"| {v} | {r['wall_ms']} | {r['wall_over_first']} | {r['probe_late_ms_total']} | {r['probe_late_us_mean']} | "
              f"{r['probe_late_us_p90']} | {r['cpu_ms']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
