"""bench/pyspy_summary.py: a py-spy raw capture summarised per process and thread (run as a
subprocess: tests do not import bench)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RAW = [
    'process 10:"python -m bench.gpu_engine";thread (0x1): MainThread;main (bench/gpu_engine.py:1);stage (bench/gpu_engine.py:2) 6',
    'process 10:"python -m bench.gpu_engine";process 11:"python -m voxbatch.worker.main";thread (0x2): upload-3;run (p.py:5);encode (a.py:9) 3',
    'process 10:"python -m bench.gpu_engine";process 11:"python -m voxbatch.worker.main";thread (0x3): upload-7;run (p.py:5);store (p.py:6) 1',
    'process 10:"python -m bench.gpu_engine";process 11:"python -m voxbatch.worker.main";thread (0x4): flow-hift-0;run (p.py:5);vocode (e.py:1) 4',
    "not a stack line",
]


def test_samples_go_to_the_innermost_process_and_numbered_threads_fold(tmp_path):
    raw = tmp_path / "pyspy.txt"
    raw.write_text("\n".join(RAW) + "\n")
    out = subprocess.run([sys.executable, "-m", "bench.pyspy_summary", str(raw), "--title", "a capture"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# a capture\n\n")
    text = out.stdout.split("\n\n", 1)[1]
    worker, bench = text.split("== process 10")[0], text.split("== process 10")[1]
    assert worker.startswith("== process 11 (python -m voxbatch.worker.main): 8 samples")
    assert "       4  50.0%  upload-#\n" in worker  # upload-3 and upload-7 together
    assert "       4  50.0%  flow-hift-#\n" in worker
    assert "       8 100.0%  run" in worker  # inclusive, once per sample however deep
    assert "encode (a.py:9)" in worker and "%  main\n" not in worker and "%  main\n" in bench
    assert bench.startswith(" (python -m bench.gpu_engine): 6 samples")
