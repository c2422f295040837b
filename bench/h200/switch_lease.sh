#!/bin/bash
# One device call that decides bench switches (bench/switches.py), for sessions that may get one call:
#   1. the GPU tests of the switches' arithmetic (failures named: run.sh's -rfE);
#   2. the parts stage: flow and HiFT over the corpus per SPEC, interleaved with the shipped form;
#   3. bench/h200/pick_parts.py: the specs whose both timings beat every shipped one and whose tests
#      passed;
#   4. the real worker, A (shipped) B (the winners) A, then one more job traced in the first worker
#      (--worker-trace), if the time left allows; else only the traced worker.
# Usage, from a device call carrying the kit (bash bench/h200/make_kit.sh):
#   bash .gpu/switch_lease.sh NAME SECONDS SPEC [SPEC ...]
# SECONDS is the call's own limit (the command stops its stages to fit it). What comes back stays within
# the device tool's 8 files: $OUT/NAME_parts.{json,md}, NAME_parts_gpu_tests.txt, NAME_worker.{json,md},
# NAME_worker_gpu_trace.txt and logs.tgz (the bench logs and the workers' logs).
set -o pipefail
name=$1 limit=$2
shift 2
kit=$(cd "$(dirname "$0")" && pwd)
out=$OUT
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
tests="tests/test_cosyvoice2_channels_last.py tests/test_cosyvoice2_conv_epilogue.py tests/test_cosyvoice2_hift.py
tests/test_cosyvoice2_norm.py::test_kernel_on_gpu tests/test_cosyvoice2_flow.py tests/test_cosyvoice2_llm.py
tests/test_cosyvoice2_rope_kernel.py -m gpu"
mkdir -p "$out/p" "$out/w"
# Stage 1-2: the tests (up to 100 s) and the parts stage (~150 s on an H100 for seven variants before
# each variant got an unmeasured pass of its own; ~9 s more a variant since).
OUT=$out/p GPU_TESTS=$tests GPU_TESTS_TIMEOUT=100 BENCH_TIMEOUT=$((limit / 2)) bash "$kit/run.sh" --stages parts \
  --worker-run task=16 --parts-ab "$@" --budget-s 100 --name "${name}_parts" | tail -30
spec=$(python3 "$kit/src/bench/h200/pick_parts.py" "$out/p" "${name}_parts")
grep -E "^(FAILED|ERROR)|passed|failed" "$out/p/gpu_tests.txt" | tail -12
left=$((limit - SECONDS - 40))
ab=()
if [ -n "$spec" ] && [ $left -gt 330 ]; then ab=(--worker-ab "$spec"); fi
echo "winners: [$spec]; ${left}s left; worker ${ab[*]:-without an A/B}"
if [ $left -gt 150 ]; then
  OUT=$out/w BENCH_TIMEOUT=$left bash "$kit/run.sh" --stages worker --worker-run task=16 --worker-task-sizes 16 \
    --worker-warm-segments 500 --worker-trace "${ab[@]}" --budget-s 60 --name "${name}_worker" | tail -12
fi
cd "$out" || exit 1
[ -f p/gpu_tests.txt ] && mv p/gpu_tests.txt "${name}_parts_gpu_tests.txt"
for f in p/"${name}"_parts.json p/"${name}"_parts.md w/"${name}"_worker.json w/"${name}"_worker.md w/"${name}"_worker_gpu_trace.txt; do
  [ -f "$f" ] && mv "$f" .
done
tar czf logs.tgz p w && rm -rf p w
ls -la "$out"
