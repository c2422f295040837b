"""BENCHMARKS.md's and docs/scaling.md's GPU numbers are generated from bench/results, so they cannot drift.

`python -m bench.report --check` regenerates every marked block from the committed result files and
fails when a committed block differs; a result with another figure makes it fail; and every number
in a "× real time" column of a generated block is an `x_realtime` figure of some result file. Run as
a subprocess: tests do not import bench.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BLOCK = re.compile(r"<!-- bench:([\w-]+) begin -->\n(.*?)<!-- bench:\1 end -->", re.DOTALL)


def report(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "bench.report", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def x_realtime_figures() -> set[float]:
    found: set[float] = set()

    def walk(v, key: str = "") -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, k)
        elif isinstance(v, list):
            for x in v:
                walk(x, key)
        elif "x_realtime" in key and isinstance(v, (int, float)):
            found.add(float(v))

    for path in RESULTS.glob("*.json"):
        walk(json.loads(path.read_text(encoding="utf-8")))
    return found


def real_time_cells(block: str) -> list[str]:
    """The cells of every "real time" column of the markdown tables in a block."""
    cells, columns = [], None
    for line in block.splitlines():
        if not line.startswith("|"):
            columns = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if columns is None:
            columns = [i for i, name in enumerate(row) if "real time" in name]
        elif not set(line) <= set("|-"):
            cells += [row[i] for i in columns]
    return cells


def test_committed_docs_are_what_the_results_give():
    out = report("--check")
    assert out.returncode == 0, out.stderr


def test_a_changed_result_makes_the_docs_stale(tmp_path):
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    # The file BENCHMARKS.md's first table names (`From \`bench/results/NAME.json\``).
    name = re.search(r"From `bench/results/([\w.-]+\.json)`", (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")).group(1)
    r = json.loads((tmp_path / name).read_text())
    first = next(iter(r["stages"]["worker"]["runs"].values()))
    first["x_realtime"] += 1
    (tmp_path / name).write_text(json.dumps(r))
    out = report("--check", "--results", str(tmp_path))
    assert out.returncode == 1 and "BENCHMARKS.md" in out.stderr and "docs/scaling.md" in out.stderr


def test_every_real_time_figure_in_a_generated_block_is_in_a_result():
    figures = x_realtime_figures()
    blocks = {name: body for path in ("BENCHMARKS.md", "docs/scaling.md")
              for name, body in BLOCK.findall((REPO / path).read_text(encoding="utf-8"))}
    assert {"headline", "gpu-stages", "scaling-gpu", "scaling-example", "scaling-load"} <= set(blocks)
    checked = 0
    for name, body in blocks.items():
        for cell in real_time_cells(body):
            m = re.match(r"\**([\d,]+(?:\.\d+)?)", cell)
            if m:
                assert float(m.group(1).replace(",", "")) in figures, f"bench:{name}: {cell} × real time is in no result file"
                checked += 1
    assert checked >= 4  # the worker runs, the engine run and the baseline at least


def test_the_first_table_is_the_newest_whole_h200_worker_result(tmp_path):
    """A newer worker result from another GPU (a device call that got an H100), or a newer H200 one
    without a baseline (an A/B-only run), leaves the docs as the headline result gives them; a newer
    whole H200 worker result replaces it; with no H200 worker result left, another takes its place."""
    name = re.search(r"From `bench/results/([\w.-]+\.json)`", (REPO / "BENCHMARKS.md").read_text(encoding="utf-8")).group(1)
    head = json.loads((RESULTS / name).read_text())
    assert "H200" in head["headline"]["gpu"] and head["headline"]["path"] == "worker"
    assert head["headline"]["baseline_x_realtime"] is not None
    results = {p.name: json.loads(p.read_text()) for p in RESULTS.glob("*.json")}
    for n in results:
        shutil.copy(RESULTS / n, tmp_path / n)

    def newer(gpu: str, baseline) -> dict:
        r = json.loads(json.dumps(head))
        r["when"] = "9999-01-01T00:00:00Z"
        r["headline"].update(gpu=gpu, baseline_x_realtime=baseline, x_realtime=round(head["headline"]["x_realtime"] + 1.5, 1))
        return r

    (tmp_path / "zz_h100.json").write_text(json.dumps(newer("NVIDIA H100 80GB HBM3", head["headline"]["baseline_x_realtime"])))
    (tmp_path / "zz_ab_only.json").write_text(json.dumps(newer(head["headline"]["gpu"], None)))
    assert report("--check", "--results", str(tmp_path)).returncode == 0
    (tmp_path / "zz_whole.json").write_text(json.dumps(newer(head["headline"]["gpu"], head["headline"]["baseline_x_realtime"])))
    out = report("--check", "--results", str(tmp_path))
    assert out.returncode == 1 and "BENCHMARKS.md" in out.stderr
    (tmp_path / "zz_whole.json").unlink()
    for n, r in results.items():  # every H200 worker result gone: the docs would change
        if r.get("headline", {}).get("path") == "worker" and "H200" in str(r["headline"].get("gpu")):
            (tmp_path / n).unlink(missing_ok=True)
    out = report("--check", "--results", str(tmp_path))
    assert out.returncode == 1 and "BENCHMARKS.md" in out.stderr


def test_a_render_ab_is_one_row_per_run(tmp_path):
    """A render stage with an A/B (`--render-ab`) comes out as a table with a row per run (A, each B
    with its wall over the A runs' mean, A again), not as dotted `ab.` keys."""
    results = {p.name: json.loads(p.read_text()) for p in RESULTS.glob("*.json")}
    for n in results:
        shutil.copy(RESULTS / n, tmp_path / n)
    _, base = max(((n, r) for n, r in results.items() if isinstance(r.get("stages", {}).get("render"), dict)
                      and "skipped" not in r["stages"]["render"]), key=lambda kv: kv[1]["when"])
    r = json.loads(json.dumps(base))
    r["when"] = "9999-01-01T00:00:00Z"
    run = {k: v for k, v in r["stages"]["render"].items() if k != "ab"}
    slower = {**run, "wall_s": round(run["wall_s"] * 1.5, 3), "x_realtime": round(run["x_realtime"] / 1.5, 1)}
    r["stages"]["render"]["ab"] = {"order": "A B1 A", "a_runs": [run, run],
                                   "variants": [{"spec": "probe_switch=1", "run": slower, "wall_over_a_mean": 1.5}]}
    (tmp_path / "zz_render_ab.json").write_text(json.dumps(r))
    docs = tmp_path / "docs"
    (docs / "docs").mkdir(parents=True)
    shutil.copy(REPO / "BENCHMARKS.md", docs / "BENCHMARKS.md")
    shutil.copy(REPO / "docs" / "scaling.md", docs / "docs" / "scaling.md")
    out = report("--results", str(tmp_path), "--root", str(docs))
    assert out.returncode == 0, out.stderr
    text = (docs / "BENCHMARKS.md").read_text(encoding="utf-8")
    start = text.index("### render")
    end = text.find("\n### ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    assert "| B: `probe_switch=1` (wall B/A 1.5) |" in section
    assert f"| A | {run['wall_s']} |" in section and f"| A again | {run['wall_s']} |" in section
    assert "`ab." not in section
