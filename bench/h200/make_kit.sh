#!/usr/bin/env bash
# Builds the kit a device run of the GPU benchmark needs, in .gpu/ (gitignored): the packages the H200
# image lacks as cp312 wheels (wheels.txt), a redis-server with the libraries the image may lack, this
# checkout's sources and run.sh. Then a device call carries `.gpu` and runs
# `bash .gpu/run.sh --stages llm worker engine baseline ...` (the bench's own flags, see BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
kit=.gpu
# The sources travel without bench/results (6-7 MB the run never reads; the working tree beside the kit
# carries them once already and the call holds 64 MiB in all).
# This checkout's sources, their commit stamp (the copy has no .git) and the device-side scripts.
copy_sources() {
  rm -rf "$kit/src" && mkdir -p "$kit/src" && git archive HEAD | tar -x -C "$kit/src" --exclude=bench/results
  # ... but for the two results tests/test_engine_defaults.py reads as it is collected (GPU_TESTS= of it).
  git archive HEAD bench/results/gpu_h200_worker.json bench/results/gpu_h200_engine.json | tar -x -C "$kit/src"
  git rev-parse HEAD > "$kit/src/bench/COMMIT"  # the commit measured
  cp bench/h200/run.sh bench/h200/switch_lease.sh "$kit/"
}
# --src: only those (the rest of the kit already built).
if [ "${1:-}" = "--src" ]; then
  copy_sources
  exit 0
fi
mkdir -p "$kit/whl" "$kit/bin/lib" "$kit/src"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$kit/whl" -r bench/h200/wheels.txt
cp "$(command -v redis-server)" "$kit/bin/"
ldd "$(command -v redis-server)" | awk '/=> \//{print $3}' | grep -v -E 'libc\.so|libm\.so|ld-linux' \
  | xargs -r -I{} cp -L {} "$kit/bin/lib/"
printf '#!/bin/sh\nd=$(dirname "$0")\nLD_LIBRARY_PATH="$d/lib" exec "$d/redis-server" "$@"\n' > "$kit/bin/redis.sh"
chmod +x "$kit/bin/redis.sh"
# FlashAttention-3 as vLLM ships it (flash_varlen.py): vLLM 0.26.0 is the release built for the image's
# torch 2.11 / CUDA 13; only its FA3 op library travels (153 MB, ~8 MB xz-packed), laid out as vLLM's
# package folder, where flash_varlen.fa3_library looks. run.sh unpacks it where no vLLM is installed.
if [ ! -f "$kit/fa3.tar.xz" ]; then
  # The 290 MB wheel is fetched outside the kit (the kit travels whole in a 64 MiB call) and dropped.
  fa3tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$fa3tmp/wheel" vllm==0.26.0
  unzip -q "$fa3tmp"/wheel/vllm-0.26.0-*.whl 'vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so' -d "$fa3tmp"
  tar cf - -C "$fa3tmp" vllm | xz -9 -T4 > "$kit/fa3.tar.xz"
  rm -rf "$fa3tmp"
fi
copy_sources
# The fixture's small files the benchmark's official folder borrows (yaml, tokenizer, voice front-end ONNX),
# and what the HiFT and LLM GPU tests read (weights, references, prompts; ~9 MB): GPU_TESTS= of
# tests/test_cosyvoice2_hift.py then runs its fixture tests too (reference.md: the engine tests read the
# fixture's facts from it). flow.pt (45 MB) stays home: the kit must fit a device call, so tests of the
# flow or the whole engine on the fixture skip there unless a call of its own brings flow.pt (BENCHMARKS.md).
fix=../shared/fixtures/cosyvoice2-tiny
mkdir -p "$kit/shared/fixtures/cosyvoice2-tiny"
cp -r "$fix/cosyvoice2.yaml" "$fix"/*.onnx "$fix/CosyVoice-BlankEN" "$fix/hift.pt" "$fix/llm.pt" "$fix/reference.npz" \
  "$fix/reference.md" "$fix/reference_meta.json" "$fix"/prompt_*.wav "$kit/shared/fixtures/cosyvoice2-tiny/"
# A call carries the working tree (what git tracks or does not ignore) and the kit, 64 MiB in all; the tree
# grows with bench/results. Over that, the fixture's test weights stay home (the bench never reads them;
# the HiFT and LLM fixture tests then skip on the device), and past that the kit is too big to travel.
carry_kib() {
  local tree; tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
  echo $((tree + $(du -sk "$kit" | cut -f1)))
}
if [ "$(carry_kib)" -gt $((64 * 1024)) ]; then
  echo "kit: the working tree and the kit are over 64 MiB; the fixture's hift.pt, llm.pt and reference.npz stay home"
  rm -f "$kit/shared/fixtures/cosyvoice2-tiny/"{hift.pt,llm.pt,reference.npz}
fi
[ "$(carry_kib)" -le $((64 * 1024)) ] || { echo "kit: $(carry_kib) KiB with the working tree, over a call's 64 MiB"; exit 1; }
du -sh "$kit"
