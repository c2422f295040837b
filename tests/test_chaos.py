"""The chaos benchmark at CI size: one 300-segment job on real Redis (shipped AOF settings), real
SeaweedFS and two `voxbatch worker` processes, while workers are SIGKILLed, Redis is SIGKILLed and
restarted, and storage is stopped. bench/chaos.py runs as a subprocess (tests do not import bench/);
the full-size result is bench/results/chaos_10k.json."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from voxbatch import testing_services as services

pytestmark = pytest.mark.integration


def test_chaos_small(redis_server, seaweed, tmp_path):  # the fixtures: skip (or fail under CI) without the services
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "bench.chaos", "--segments", "300", "--workers", "2", "--kills", "2",
           "--redis-restarts", "1", "--outages", "1", "--outage-s", "5", "--min-gap-s", "3",
           "--env", "VOXBATCH_VISIBILITY_TIMEOUT_S=15", "--env", "VOXBATCH_TASK_HEARTBEAT_S=3",
           "--env", "VOXBATCH_SWEEP_INTERVAL_S=5", "--timeout-s", "600", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=services.REPO, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert (r["stored_once"], r["lost"], r["duplicated"], r["failed"], r["identical_to_clean"]) == (300, 0, 0, 0, 300), (
        r, proc.stderr[-4000:])
    assert r["state"] == "completed" and r["completed_by_itself"]
    assert sorted(f["kind"] for f in r["faults"]) == ["kill", "kill", "redis_restart", "storage_outage"]
    assert all(f["stall_s"] < 60 for f in r["faults"]), r["faults"]  # back within the visibility timeout and then some
    assert proc.returncode == 0
