"""What a result file records about what it measured: the commit, the host CPU, and where the shared
fixture (the official-format checkpoint the CPU benches default to) lives."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO.parent / "shared" / "fixtures" / "cosyvoice2-tiny"  # ../shared beside the checkout


def commit() -> str:
    """The commit measured: bench/COMMIT where a copy without git carries it, else git (+ '-dirty')."""
    stamp = REPO / "bench" / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo), or "unknown" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"
