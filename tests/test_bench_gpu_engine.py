"""The GPU benchmark on a CPU with the tiny fixture: every stage runs and the result says what it measured.

`python -m bench.gpu_engine --tiny --device cpu` runs the same code paths as on the H200 (the real
`voxbatch worker` process fed by `voxbatch submit` through redis-server, the worker's engine through
its Pipeline, the baseline, the LLM/flow/HiFT stages, vLLM when installed) at the smallest sizes; a
failing stage makes it exit non-zero. Run as a subprocess: tests do not import bench.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import fake_mps

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--llm-batches", "1", "2", "--llm-tokens", "4",
         "--baseline-segments", "1",
         "--worker-run", "rows=4,flow=2,task=2", "--worker-task-sizes", "4", "2", "--engine-runs", "rows=4,flow=2,task=2",
         "--invariance-run", "rows=4,flow=2,task=2", "--invariance-segments", "4", "--invariance-probes", "2", "--budget-s", "3000",
         "--parts-ab", "resid=1", "--worker-trace"]


def bench(tmp_path: Path, *args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bench.gpu_engine", "--out", str(tmp_path), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_unknown_stage_is_an_error(tmp_path):
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "llm", "e2e", timeout=120)
    assert out.returncode == 2 and "unknown stage(s) e2e" in out.stderr


def test_a_launcher_setting_in_an_engine_run_is_an_error_not_a_run_that_ignores_it(tmp_path):
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "engine", "--engine-runs", "rows=4,mps=true", timeout=120)
    assert out.returncode == 2 and "'rows=4,mps=true': mps act on `voxbatch worker`'s launcher" in out.stderr


def test_a_worker_process_variable_is_refused_where_the_bench_builds_the_engine_itself(tmp_path):
    """`alloc=...` sets PYTORCH_CUDA_ALLOC_CONF of the worker processes a --worker-ab starts (read as
    torch's allocator starts); an engine run or --worker-run, built in the bench's own process, refuses it."""
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "engine", "--engine-runs", "alloc=expandable_segments:True", timeout=120)
    assert out.returncode == 2 and "alloc act on `voxbatch worker`'s processes" in out.stderr
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "parts", "--worker-run", "task=16,alloc=expandable_segments:True", timeout=120)
    assert out.returncode == 2 and "--worker-ab only" in out.stderr


def test_a_process_variable_takes_several_library_options_in_one_run_spec():
    """A run spec's pairs are comma-separated; `+` inside `alloc=` is the comma between torch's allocator
    options, so `card=24,alloc=a:1+b:2` is two run keys and the worker gets `a:1,b:2`."""
    script = ("from bench.gpu_engine import parse_run, process_env_value\n"
              "run = parse_run('card=24,alloc=pinned_use_cuda_host_register:True+pinned_num_register_threads:8', switches=True)\n"
              "print(sorted(run), process_env_value(run['alloc']))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['alloc', 'card'] pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def test_every_stage_runs_on_cpu_and_the_result_has_a_headline(tmp_path, tiny_model_dir):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    out = bench(tmp_path, *SMALL, "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert not r["errors"]
    expected = {"accuracy", "llm", "parts", "worker", "engine", "render", "baseline", "profile", "vllm", "invariance"}
    assert set(r["stages"]) == expected
    h = r["headline"]
    assert set(h) == {"path", "x_realtime", "baseline_x_realtime", "gpu", "commit", "segments", "llm_tokens_per_s_corpus", "gpu_busy_pct"}
    assert h["path"] == "worker" and h["gpu"] == "cpu" and h["commit"] == r["commit"] and len(h["commit"]) >= 40
    worker = r["stages"]["worker"]["runs"]
    assert set(worker) == {"tasks_of_4", "tasks_of_2"}
    for run in worker.values():
        assert run["done"] == run["segments"] == h["segments"] and run["failed"] == 0 and run["x_realtime"] > 0
        # the worker's timeline log, read back per job: admitted, decoded, vocoded, in that order, inside the job
        tl = run["timeline"]
        assert 0 <= tl["first_admit_s"] <= tl["first_llm_session_s"] <= tl["first_vocode_start_s"] <= tl["first_vocode_end_s"] <= run["wall_s"]
        assert tl["admit_events"] >= 1 and tl["vocode_end_events"] == tl["vocode_start_events"] >= 1
        # the GIL probe ran through the job, and each vocoder batch's queueing time is part of its wall time
        assert tl["gil_wait_us_mean"] is not None and tl["gil_wait_us_max"] >= tl["gil_wait_us_p90"] >= 0
        assert 0 < tl["vocode_host_share_pct"] <= 101
    assert h["x_realtime"] == worker["tasks_of_4"]["x_realtime"] and h["baseline_x_realtime"] > 0
    # --worker-trace: one more job, traced in the worker (a CPU has no GPU events: all of it idle)
    traced = r["stages"]["worker"]["traced_job"]
    assert traced["done"] == h["segments"] and "error" not in traced["gpu_trace"]
    assert traced["gpu_trace"]["host_ops"] > 0 and traced["gpu_trace"]["gpu_busy_pct"] == 0.0
    assert "GPU trace of one tasks-of-4 job" in (tmp_path / "gpu_engine_gpu_trace.txt").read_text()
    (engine,) = r["stages"]["engine"]["runs"].values()
    assert engine["stored"] == r["corpus"]["segments"] and engine["failed"] == 0
    parts = r["stages"]["parts"]["variants"]  # the shipped form and --parts-ab's switch, each timed
    assert set(parts) == {"shipped", "resid=1"} and all(v["flow_s"] > 0 and v["hift_s"] > 0 for v in parts.values())
    render = r["stages"]["render"]
    assert render["state"] == "completed" and render["failed"] == 0 and render["segments"] > 0
    assert all(render[k] >= 0 for k in ("startup_s", "first_segment_s", "rendering_s", "assembly_tail_s"))
    inv = r["stages"]["invariance"]
    assert set(inv["dtypes"]) == {"bfloat16", "float32"} and len(inv["probes"]) == 2
    for run in inv["dtypes"].values():  # a CPU runs the LLM in fp32 whatever is asked: batch-invariant tokens
        assert run["effective_llm_dtype"] == "float32" and run["tokens_identical"] == run["probes"] == 2
        assert run["llm_tokens_per_s_corpus"] > 0 and run["x_realtime"] > 0 and run["pipeline"]["failed"] == 0
        assert run["alone_rerun_identical"] == "2/2"
    assert set(inv["decision"]) >= {"fp32_x_realtime_cost_pct", "fp32_llm_cost_pct", "bfloat16", "float32", "recommend"}
    assert "## Re-render identity" in (tmp_path / "gpu_engine.md").read_text()
    host = r["environment"]["host"]  # bench/host_speed.py: the host's speed beside the GPU's
    assert host["python_loop_ns"] > 0 and host["torch_cpu_op_us"] > 0 and host["cuda_launch_us"] is None


def test_parts_ab_of_a_switch_the_parts_stage_does_not_vary_is_an_error(tmp_path):
    """The parts stage times flow and HiFT per variant: an LLM switch there would be timed as if it mattered."""
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "parts", "--parts-ab", "rope=1", timeout=120)
    assert out.returncode == 2 and "rope is not a flow or HiFT switch" in out.stderr


def test_vllm_run_specs_read_every_vllm_option_through_settings():
    """A --vllm-runs spec reaches VllmOptions through Settings (types and bounds as a worker reads them):
    every key it may set lands in an option (mps: in the MPS flag), and a key outside them or a value
    out of bounds is refused."""
    script = (
        "import json; from bench.gpu_engine import VLLM_RUN_KEYS, vllm_run, vllm_run_mps\n"
        "spec = 'process=1,async=1,vgraphs=1024,vmode=PIECEWISE,vgroup=16,vpriority=-1,vengines=2,mps=true'\n"
        "print(json.dumps([len(VLLM_RUN_KEYS), vllm_run(spec), vllm_run('shipped'),"
        " [vllm_run_mps(s) for s in (spec, 'shipped', 'vengines=2', 'mps=false')], vllm_run('mps=true,vengines=2')]))\n"
        "for bad in ('rows=8', 'vpriority=3', 'process=0,vengines=2', 'process=0,mps=true', 'mps=maybe'):\n"
        "    try:\n        vllm_run(bad)\n    except (SystemExit, ValueError) as e:\n        print(bad, '->', str(e).splitlines()[0:3])\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    first, *refused = out.stdout.splitlines()
    n_keys, opts, shipped, mps, default_process = json.loads(first)
    assert opts == {"engine_process": True, "async_scheduling": True, "cudagraph_max_tokens": 1024,
                    "cudagraph_mode": "PIECEWISE", "admit_group": 16, "stream_priority": -1, "engines": 2}
    # every key but mps is an engine option; mps says whether the cores are clients of an MPS daemon
    assert n_keys == len(opts) + 1 and shipped.pop("engines") == 1 and set(shipped.values()) == {None}
    assert mps == [True, False, False, False]
    # mps with the core process left to its default (None: its own process on a GPU) is a run, not an error
    assert default_process["engines"] == 2 and default_process["engine_process"] is None
    assert refused[0].startswith("rows=8 ->") and "not vLLM options" in refused[0]
    # CUDA priorities run from 0 (the default) to -5 (most urgent): 3 is out of the setting's bounds
    assert refused[1].startswith("vpriority=3 ->") and "vllm_stream_priority" in refused[1]
    # several engines with their cores in the worker's process cannot run
    assert refused[2].startswith("process=0,vengines=2 ->") and "own process" in refused[2]
    # an MPS daemon serves other processes: a core in the bench's own process would not be its client
    assert refused[3].startswith("process=0,mps=true ->") and "process=1" in refused[3]
    assert refused[4].startswith("mps=maybe ->") and "cuda_mps" in refused[4]


def test_an_mps_vllm_run_spawns_its_cores_as_clients_of_a_daemon_it_stops_after(tmp_path):
    """`--vllm-runs mps=true,...`: what the bench spawns inside `mps_clients` (vLLM's cores) inherits a
    fresh daemon's folders; on the way out, even by an error, the environment is as before and the
    daemon is asked to quit and its folders go."""
    bin_dir, record = fake_mps.install(tmp_path)
    script = (
        "import json, os, subprocess, sys; from bench.gpu_engine import mps_clients\n"
        "before = os.environ.get('CUDA_MPS_PIPE_DIRECTORY')\n"
        "try:\n"
        "    with mps_clients(True):\n"
        "        child = subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"CUDA_MPS_PIPE_DIRECTORY\"])'],\n"
        "                               capture_output=True, text=True).stdout.strip()\n"
        "        raise RuntimeError('a core failed')\n"
        "except RuntimeError:\n"
        "    pass\n"
        "with mps_clients(False):\n"
        "    off = os.environ.get('CUDA_MPS_PIPE_DIRECTORY')\n"
        "print(json.dumps([before, child, os.environ.get('CUDA_MPS_PIPE_DIRECTORY'), off]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, child, after, off = json.loads(out.stdout.splitlines()[-1])
    calls = record.read_text().splitlines()
    assert len(calls) == 2 and calls[0].startswith(f"args=-d pipe={child} ") and calls[1].endswith("stdin=quit")
    assert before is None and after is None and off is None and child.endswith("pipe")
    assert not Path(child).parent.exists()  # the daemon's folders went with it


def test_repeated_engine_configuration_is_an_error(tmp_path):
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "engine", "--engine-runs", "task=2", "task=2", timeout=120)
    assert out.returncode == 2 and "--engine-repeats" in out.stderr


def test_engine_repeats_alternate_the_order_and_keep_the_median(tmp_path, tiny_model_dir):
    """Two configurations, two passes: run order A B B A; each configuration's record is one of its
    own runs (the lower median) and lists both runs with their places in the order."""
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--stages", "engine",
                "--engine-runs", "rows=4,flow=2,task=2", "rows=4,flow=2,task=2,merge=0", "--engine-repeats", "2",
                "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"), "--budget-s", "3000")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_engine.json").read_text())
    engine = r["stages"]["engine"]
    assert engine["repeats"] == 2 and list(engine["runs"]) == ["rows=4,flow=2,task=2", "rows=4,flow=2,task=2,merge=0"]
    places = {spec: sorted(x["position"] for x in run["repeats"]) for spec, run in engine["runs"].items()}
    assert places == {"rows=4,flow=2,task=2": [0, 3], "rows=4,flow=2,task=2,merge=0": [1, 2]}
    for run in engine["runs"].values():
        figures = sorted(x["x_realtime"] for x in run["repeats"])
        assert run["x_realtime"] == figures[0] and run["failed"] == 0
        # The engine's own timeline, recorded in this process: admitted, decoded, a first row vocoded.
        t = run["timeline"]
        assert t["admit_events"] >= 1 and t["llm_session_events"] >= 1 and t["vocode_end_events"] >= 1
        assert 0 <= t["first_admit_s"] <= t["first_llm_session_s"] <= t["first_vocoder_first_row_s"] <= t["first_vocode_start_s"]
        assert t["llm_admit_ms_total"] >= 0 and t["llm_place_ms_total"] >= 0
        # Each placement's one-launch probe, its fill time and the thread's CPU time (parts of the
        # placement's wall time, each rounded to the millisecond per placement).
        assert t["llm_launch_us_max"] is not None and 0 <= t["llm_launch_us_median"] <= t["llm_launch_us_max"]
        placements = t["llm_session_events"] + t["llm_refill_events"]
        assert 0 <= t["llm_prefill_ms_total"] <= t["llm_place_ms_total"] + placements
        assert 0 <= t["llm_place_cpu_ms_total"] <= t["llm_place_ms_total"] + placements
        # The LLM ran out of work before the job's end: from there flow/HiFT alone (the vocoder-only tail).
        assert t["first_llm_session_s"] <= t["last_llm_done_s"] <= run["wall_s"]
        assert run["vocoder_tail_s"] == pytest.approx(run["wall_s"] - t["last_llm_done_s"], abs=0.01)
        # Every batch is in the tail or before it; the tail's rows are at most the job's.
        assert len(t["vocode_tail_batches"]) <= t["vocode_start_events"] and sum(t["vocode_tail_batches"]) <= 4
        assert 0 <= t["vocode_paired_starts"] < t["vocode_start_events"]
    md = (tmp_path / "gpu_engine.md").read_text()
    assert "paired starts" in md


def _pyspy() -> str | None:
    found = shutil.which("py-spy")
    local = Path(sys.executable).with_name("py-spy")
    return found or (str(local) if local.exists() else None)


def test_worker_stage_samples_the_gil_holders_at_each_jobs_start(tmp_path, tiny_model_dir):
    """`--pyspy-job-start`: py-spy attached to the worker over each measured job's first seconds, GIL
    holders only, summarised per process and thread next to the result; the job is measured as usual."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    pyspy = _pyspy()
    if pyspy is None:
        pytest.skip("py-spy not installed")
    args = ["--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--worker-run", "rows=4,flow=2,task=2",
            "--worker-task-sizes", "4", "--budget-s", "3000"]
    out = bench(tmp_path, *args, "--stages", "worker", "--pyspy-job-start", pyspy, "--pyspy-seconds", "1",
                "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"), "--name", "spy")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = json.loads((tmp_path / "spy.json").read_text())["stages"]["worker"]["runs"].values()
    assert run["done"] == run["segments"] > 0
    spy = run["pyspy_job_start"]
    if "error" in spy and "ermission" in spy["error"]:
        pytest.skip(f"py-spy cannot attach here: {spy['error']}")
    assert spy.get("samples", 0) > 0, spy
    text = (tmp_path / spy["file"]).read_text()
    assert text.startswith("# py-spy --gil of the worker from before `voxbatch submit`") and "== process" in text
    assert "-- threads" in text


def test_bench_switches_reach_the_worker_processes_started_with_them():
    """bench/switches.py: the environment `worker_env` gives sets the switch in any Python process
    started with it (the `voxbatch worker` launcher's children too), as the module is imported; a
    process without it keeps the shipped value."""
    probe = "import voxbatch.worker.cosyvoice2.engine as e; print(e.PREPARE_AT_ENQUEUE)"
    code = ("import os, subprocess, sys; from bench.switches import worker_env; "
            "env = {**os.environ, **worker_env({'prepare': '0', 'task': '16'}, os.environ['PYTHONPATH'])}; "
            f"print(subprocess.run([sys.executable, '-c', {probe!r}], env=env, capture_output=True, text=True, check=True).stdout.strip()); "
            f"print(subprocess.run([sys.executable, '-c', {probe!r}], capture_output=True, text=True, check=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_worker_ab_runs_each_variant_between_two_runs_of_the_first(tmp_path, tiny_model_dir):
    """`--worker-ab`: each variant (a bench switch, a setting) in a worker of its own between two runs of
    the first configuration, and the result holds them all with each variant's ratio and environment."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    args = ["--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--worker-run", "rows=4,flow=2,task=2",
            "--worker-task-sizes", "4", "--worker-warm-segments", "2", "--budget-s", "3000",
            "--worker-ab", "prepare=0", "upload=1"]
    out = bench(tmp_path, *args, "--stages", "worker", "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"), "--name", "ab")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ab = json.loads((tmp_path / "ab.json").read_text())["stages"]["worker"]["ab"]
    assert ab["order"] == "A B1 B2 A" and [v["spec"] for v in ab["variants"]] == ["prepare=0", "upload=1"]
    first, second = ab["variants"]
    assert first["env"]["BENCH_SWITCHES"] == "prepare=0" and "BENCH_SWITCHES" not in second["env"]
    assert second["env"]["VOXBATCH_UPLOAD_THREADS"] == "1"
    for r in [*ab["a_runs"], first["run"], second["run"]]:
        assert r["done"] == r["segments"] == 4 and r["failed"] == 0
        # The worker's torch LLM placements, read back from its timeline and printed per job.
        assert r["timeline"]["llm_launch_us_max"] is not None and r["timeline"]["llm_place_cpu_ms_total"] >= 0
    assert out.stdout.count("LLM placements:") == 4, out.stdout[-3000:]
    assert all(v["over_a_mean"] > 0 for v in ab["variants"])
    assert {"ab_worker.log", "ab_ab1_worker.log", "ab_ab2_worker.log", "ab_ab_again_worker.log"} <= {p.name for p in tmp_path.iterdir()}
    assert "voxbatch worker A/B (A B1 B2 A)" in (tmp_path / "ab.md").read_text()


def test_a_variant_whose_worker_cannot_start_fails_the_stage_and_keeps_what_ran(tmp_path, tiny_model_dir):
    """`--worker-ab` where B's worker never starts (here: its launcher's MPS daemon refuses): the stage
    fails (exit 1, its error in the result) and the result still holds A's job, measured before."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    refusing = tmp_path / "bin"
    refusing.mkdir()
    control = refusing / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\necho 'no MPS here' >&2\nexit 1\n")
    control.chmod(0o755)
    args = ["--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--stages", "worker", "--worker-run",
            "rows=4,flow=2,task=2", "--worker-task-sizes", "4", "--worker-warm-segments", "2", "--budget-s", "3000",
            "--worker-ab", "mps=true", "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"), "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": f"{refusing}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "bench.gpu_engine", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert "no MPS here" in result["errors"]["worker"]
    worker = result["stages"]["worker"]
    (a_run,) = worker["ab"]["a_runs"]
    assert a_run == worker["runs"]["tasks_of_4"] and a_run["done"] == 4 and a_run["failed"] == 0
    assert worker["ab"]["b_runs"] == {"mps=true": []} and "exited (2)" in worker["ab"]["failed"]
    assert result["headline"]["x_realtime"] == a_run["x_realtime"]


def test_a_worker_that_dies_while_starting_fails_the_stage_at_once(tmp_path, tiny_model_dir):
    """A worker that dies before it is ready is restarted by its supervisor, and dies again: the stage
    fails at the first death with that failure's message, instead of waiting out the 300 s for a ready
    worker (two vLLM engines where the core runs in the worker's process, the CPU's default, are refused
    when the engine is built: settings alone cannot tell)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not on PATH")
    pytest.importorskip("vllm")
    t0 = time.monotonic()
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--segments", "4", "--max-s", "3", "--stages", "worker",
                "--worker-run", "rows=4,flow=2,task=2,backend=vllm,vengines=2", "--worker-task-sizes", "4",
                "--worker-warm-segments", "2", "--budget-s", "3000", "--fixture-yaml", str(tiny_model_dir / "cosyvoice2.yaml"),
                timeout=600)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_engine.json").read_text())
    error = result["errors"]["worker"]
    assert "died while starting" in error and "own process" in error, error[-2000:]
    assert time.monotonic() - t0 < 240  # not the 300 s ready wait


def test_a_bad_switch_value_stops_the_bench_and_any_process_started_with_it(tmp_path):
    """A switch's value is checked before any stage runs (usage error, exit 2), and a process started
    with a bad one ends at start-up rather than running as the variant it is not."""
    out = bench(tmp_path, "--tiny", "--device", "cpu", "--stages", "worker", "--worker-ab", "start_div=abc", timeout=120)
    assert out.returncode == 2 and "bench switch start_div='abc'" in out.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "bench" / "worker_site"), str(REPO)]),
           "BENCH_SWITCHES": "start_div=abc"}
    proc = subprocess.run([sys.executable, "-c", "print('ran')"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ran" not in proc.stdout and "start_div='abc'" in proc.stderr
