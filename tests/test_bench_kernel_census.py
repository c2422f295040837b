"""bench/kernel_census.py on the fixture's sizes: it runs (under Triton's interpreter, in its own process),
every variant counts every call, and each fusion removes launches from the call it fuses and from no other."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_census_counts_what_each_fusion_removes(tmp_path, tiny_model_dir):
    pytest.importorskip("triton")
    out = tmp_path / "census.json"
    r = subprocess.run([sys.executable, "-m", "bench.kernel_census", "--tiny", "--ab", "resid=0", "snake_epi=1", "rope=1",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["commit"]) >= 40 and result["hardware"]["triton_interpreter"] is True
    v = result["variants"]
    assert set(v) == {"shipped", "resid=0", "snake_epi=1", "rope=1"}
    calls = {"estimator", "encoder", "HiFT decode", "decode step"}
    assert all(set(runs) == calls and all(c["launches"] > 0 for c in runs.values()) for runs in v.values())
    # Each switch changes its own call's launch count only: on, fewer (snake_epi, rope: off by default);
    # resid=0 turns the shipped deferred biases off (on since stop 36), more.
    changed = {"resid=0": ("estimator", 1), "snake_epi=1": ("HiFT decode", -1), "rope=1": ("decode step", -1)}
    for spec, (call, sign) in changed.items():
        for name in calls:
            got, shipped = v[spec][name]["launches"], v["shipped"][name]["launches"]
            assert (got - shipped) * sign > 0 if name == call else got == shipped, (spec, name, got, shipped)
    assert v["shipped"]["estimator"]["triton"] > 0  # the fused LayerNorm ran (interpreted), not its eager form
    assert out.with_suffix(".md").read_text().count("| shipped |") == 1
