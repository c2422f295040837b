# syntax=docker/dockerfile:1
# voxbatch producer side, no CUDA and no torch: `voxbatch submit/status/cancel/retry/fetch/jobs`,
# `voxbatch assembler` (chapters, manifest, subtitles, .m4b) and the load exporter
# (`python -m voxbatch.worker.metrics`). The package is installed without extras; the engine is not in here.
FROM python:3.12-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# ffmpeg: the assembler encodes the .m4b book with it (without it the book is skipped).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ffmpeg \
 && rm -rf /var/lib/apt/lists/*

COPY . /src
RUN pip install /src \
 && python -c "import sys, voxbatch.cli, voxbatch.worker.metrics; assert 'torch' not in sys.modules" \
 && voxbatch --help > /dev/null

RUN useradd --create-home --uid 10001 voxbatch
USER voxbatch
WORKDIR /home/voxbatch

ENTRYPOINT ["voxbatch"]
CMD ["--help"]
