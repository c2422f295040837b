# syntax=docker/dockerfile:1
# voxbatch GPU worker: one worker process, `python -m voxbatch.worker.main` (CosyVoice2 engine, torch +
# vLLM backends), for one GPU. The orchestrator (Kubernetes, compose) restarts it; the multi-GPU
# launcher `voxbatch worker --gpus` is for bare-metal hosts and is not used in containers.
#
# Versions, and why:
# - vLLM 0.33.0 (PyPI) requires torch==2.14.0, and PyPI's torch 2.14.0 Linux wheels are CUDA 13 builds
#   (they depend on cuda-toolkit==13.0.3, cuDNN/NCCL -cu13). PyPI's CUDA 13 torch builds compile for
#   sm_75, sm_80, sm_86, sm_90, sm_100 and sm_120 (checked: torch 2.11.0+cu130's
#   torch.cuda.get_arch_list() on an H200 host, driver 580): Hopper (sm_90) and Blackwell (sm_100
#   datacenter, sm_120 RTX 50 / RTX PRO) natively, Ada (sm_89) through the binary-compatible sm_86
#   code. sm_120 needs CUDA >= 12.8 and torch >= 2.7. Pinned below; bump torch only to the version
#   the chosen vLLM release pins (`pip show vllm` -> Requires torch==...).
# - Base image: CUDA 13.0 runtime on Ubuntu 24.04, the same CUDA major and minor as the wheels. The
#   wheels bring their own CUDA runtime, cuBLAS, cuDNN and NCCL (so the image's patch level does not
#   matter); the base adds the NVIDIA container environment (NVIDIA_VISIBLE_DEVICES, driver
#   capabilities) and the compat package. Host driver: >= 580 (CUDA 13). For hosts stuck on a 570-series
#   driver, build with a CUDA 12.9 base *and* torch/vLLM wheels built for cu129 (same versions, from
#   the PyTorch and vLLM cu129 indexes) -- never mix a cu13 wheel with a 12.x driver.
# - Python 3.12 (Ubuntu 24.04's), with headers and gcc: Triton and torch.compile build small C
#   launchers at run time.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.14.0
ARG VLLM_VERSION=0.33.0

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv

# The heavy, slow-changing layer first, so code changes rebuild in seconds.
RUN printf 'torch==%s\nvllm==%s\n' "$TORCH_VERSION" "$VLLM_VERSION" > /opt/constraints.txt \
 && pip install -c /opt/constraints.txt "torch==${TORCH_VERSION}" "vllm==${VLLM_VERSION}"

COPY . /src
RUN pip install -c /opt/constraints.txt "/src[engine,vllm]" \
 && python -c "import voxbatch.cli, voxbatch.worker.main, voxbatch.worker.metrics"

# Unprivileged; HOME holds vLLM / torch.compile caches (mount a volume there to keep them warm).
RUN useradd --create-home --uid 10001 voxbatch
USER voxbatch
WORKDIR /home/voxbatch

# Prometheus metrics (VOXBATCH_METRICS_PORT).
EXPOSE 9100
# On SIGTERM the worker stops taking tasks, finishes those in flight and hands back the rest.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "voxbatch.worker.main"]
CMD []
