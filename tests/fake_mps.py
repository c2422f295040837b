"""A stand-in for nvidia-cuda-mps-control (no MPS on a CPU machine) for the tests of what starts one."""

from __future__ import annotations

from pathlib import Path

# Appends how it was called (its arguments, the MPS folders and CUDA_VISIBLE_DEVICES in its environment,
# what it read on stdin) to RECORD.
SCRIPT = """#!/bin/sh
if [ "$1" = "-d" ]; then got=; else got=$(cat); fi
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY visible=${CUDA_VISIBLE_DEVICES-unset} stdin=$got" >> RECORD
"""


def install(tmp_path: Path) -> tuple[Path, Path]:
    """(folder holding the stand-in, to put first on PATH; the file its calls are recorded in)."""
    record = tmp_path / "mps_calls.txt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(SCRIPT.replace("RECORD", str(record)))
    control.chmod(0o755)
    return bin_dir, record

