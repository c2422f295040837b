#!/bin/bash
# Device run: wheels -> /tmp/site, then the GPU bench from .gpu/src. Args: passed to bench.gpu_engine.
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl >/dev/null 2>&1 || { echo "pip install failed"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd src
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,utilization.gpu,memory.used --format=csv
python3 -c "import voxbatch.cli, voxbatch.worker.main, voxbatch.worker.tasks, pydantic_settings, soundfile, wetext, torch; print('imports ok', torch.__version__)" || exit 4
../bin/redis.sh --version || exit 5
timeout ${BENCH_TIMEOUT:-540} python3 -m bench.gpu_engine --redis-server "$PWD/../bin/redis.sh" --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
echo "bench rc=$?"
