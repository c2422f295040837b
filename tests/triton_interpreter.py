"""Triton kernel tests without a GPU: a test file's `interpreted` tests, run under Triton's interpreter.

Triton reads TRITON_INTERPRET when it is imported, so those tests cannot run in the main pytest
process (which may already have imported Triton with it unset). A file marks them `@interpreted`
(they skip in the main process) and names them with "interpreted"; its own
`test_under_triton_interpreter` calls `run_interpreted(__file__)`, which runs them in a child pytest
started with TRITON_INTERPRET=1, where the kernels take CPU tensors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_under_triton_interpreter's child pytest")


def run_interpreted(test_file: str, timeout_s: float = 900) -> None:
    """The `interpreted` tests of test_file in a child pytest with TRITON_INTERPRET=1; fails with its output."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is the child run")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "interpreted"]
    r = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
