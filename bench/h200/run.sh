#!/bin/bash
# Device run: wheels -> /tmp/site, then the GPU bench from .gpu/src. Args: passed to bench.gpu_engine.
set -o pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site whl/*.whl >/dev/null 2>&1 || { echo "pip install failed"; exit 3; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# pyproject.toml's entry points, as an installed voxbatch declares them: vLLM's engine-core process
# finds the model class through vllm.general_plugins (vllm_backend.plugin_installed); src/ itself
# travels as plain files on PYTHONPATH, which declare none.
python3 - src/pyproject.toml /tmp/site/voxbatch-0.0.dist-info <<'PY' || exit 3
import sys, tomllib, pathlib
eps = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]["entry-points"]
d = pathlib.Path(sys.argv[2]); d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: voxbatch\nVersion: 0.0\n")
(d / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in m.items()) for g, m in eps.items()))
PY
# vLLM's FlashAttention-3 library (make_kit.sh), where the image has no vLLM of its own.
if [ -f fa3.tar.xz ] && ! python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then
  mkdir -p /tmp/fa3 && tar xJf fa3.tar.xz -C /tmp/fa3 && export PYTHONPATH=$PYTHONPATH:/tmp/fa3
fi
cd src
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,utilization.gpu,memory.used --format=csv
python3 -c "import voxbatch.cli, voxbatch.worker.main, voxbatch.worker.tasks, pydantic_settings, soundfile, wetext, torch; print('imports ok', torch.__version__)" || exit 4
../bin/redis.sh --version || exit 5
# The fixture's flow.pt (45 MB) does not fit in the kit's call: a call of its own carries it and copies it
# to /root/keep/flow.pt (ignored paths in the repository did not survive the next call's carry), and
# every later call on that machine links it in, so the GPU tests of the flow and the whole engine run.
if [ -f /root/keep/flow.pt ] && [ ! -e ../shared/fixtures/cosyvoice2-tiny/flow.pt ]; then
  ln -s /root/keep/flow.pt ../shared/fixtures/cosyvoice2-tiny/flow.pt
fi
# GPU_TESTS="tests/a.py tests/b.py": those tests first, on this GPU (output in $OUT/gpu_tests.txt).
if [ -n "${GPU_TESTS:-}" ]; then
  # The whole output comes back (a failure's message too: tail -60 kept only the last one's); the log shows its end.
  timeout ${GPU_TESTS_TIMEOUT:-240} python3 -m pytest -q -rfEs -p no:cacheprovider $GPU_TESTS > "$OUT/gpu_tests.txt" 2>&1
  tail -60 "$OUT/gpu_tests.txt"
fi
# PYSPY=1: sample every Python thread of the bench and its worker processes (py-spy attached from
# outside, waits included) into $OUT/pyspy.txt (collapsed stacks per thread), to see where the CPU side
# spends the GPU's idle time. A py-spy that cannot attach leaves the bench running as it would alone.
# PYSPY_GIL=1 keeps only the samples of the thread holding the GIL (who keeps the launching threads waiting).
timeout ${BENCH_TIMEOUT:-540} python3 -m bench.gpu_engine --redis-server "$PWD/../bin/redis.sh" --out "$OUT" "$@" >"$OUT/log.txt" 2>&1 &
bench=$!
if [ -n "${PYSPY:-}" ]; then
  sleep 1
  py=$(pgrep -P "$bench" | head -1)
  /tmp/site/bin/py-spy record --pid "${py:-$bench}" --subprocesses --threads --idle --nonblocking --rate "${PYSPY_RATE:-50}" \
    ${PYSPY_GIL:+--gil} --format raw -o "$OUT/pyspy.txt" >"$OUT/pyspy.log" 2>&1 &
fi
tail --pid="$bench" -n +1 -f "$OUT/log.txt"
wait "$bench"
rc=$?
wait
echo "bench rc=$rc"
