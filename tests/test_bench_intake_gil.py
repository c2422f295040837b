"""bench/intake_gil.py on the fixture: both variants run, every segment reaches the intake prepared, and
the result records the commit, the hardware and the probe's figures. Run as a subprocess: tests do not
import bench."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_intake_gil_bench_runs_both_variants_on_the_fixture(tmp_path, tiny_model_dir):
    out = tmp_path / "intake_gil.json"
    r = subprocess.run([sys.executable, "-m", "bench.intake_gil", "--model-dir", str(tiny_model_dir), "--segments", "48",
                        "--task", "8", "--threads", "4", "--rounds", "1", "--out", str(out)],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["commit"]) >= 40 and result["hardware"]["cores"] >= 1
    assert set(result["variants"]) == {"shipped", "together=0"}
    for v in result["variants"].values():
        assert v["wall_ms"] > 0 and v["probe_wakeups"] >= 1 and len(v["rounds"]) == 1
    assert result["variants"]["shipped"]["wall_over_first"] == 1.0
    assert "| together=0 |" in r.stdout


def test_a_folder_without_the_prompts_transcript_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.intake_gil", "--model-dir", str(tmp_path)],
                       cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no reference_meta.json" in r.stderr and "Traceback" not in r.stderr


def test_an_unknown_or_repeated_variant_is_one_line_and_exit_2(tmp_path, tiny_model_dir):
    for variants in (["shipped", "bogus=1"], ["shipped", "shipped"]):
        r = subprocess.run([sys.executable, "-m", "bench.intake_gil", "--model-dir", str(tiny_model_dir), "--variants", *variants,
                            "--out", str(tmp_path / "x.json")],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert ("unknown bench switch 'bogus'" if "bogus=1" in variants else "repeats a variant") in r.stderr
        assert not (tmp_path / "x.json").exists()
