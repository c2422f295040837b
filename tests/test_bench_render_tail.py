"""bench/render_tail.py runs end to end on a small book: `voxbatch render` A B A with a bench switch
set in the render process, each run's phases recorded, and the .m4b written in every run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_render_tail_bench_runs_a_b_a_and_records_the_phases(tmp_path):
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg not on PATH (Debian: apt-get install -y ffmpeg)")
    out = tmp_path / "render_tail.json"
    proc = subprocess.run([sys.executable, "-m", "bench.render_tail", "--hours", "0.05", "--chapters", "2",
                           "--x-realtime", "2000", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [r["run"] for r in result["runs"]] == ["A", "B: book_stream=0", "A again"]
    assert [r["switches"] for r in result["runs"]] == [{}, {"book_stream": "0"}, {}]
    for r in result["runs"]:
        assert r["state"] == "completed" and r["book_m4b"] and r["segments"] == result["runs"][0]["segments"] > 0
        assert r["assembly_tail_s"] >= 0 and r["wall_s"] >= r["rendering_s"]
    assert result["commit"] and out.with_suffix(".md").is_file()
