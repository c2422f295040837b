"""CosyVoice2 at full size on one GPU: stage throughput, end to end through the worker pipeline, and
the official-style one-at-a-time baseline, in one run.

    python -m bench.gpu_engine                      # everything, placement single, on cuda:0
    python -m bench.gpu_engine --placement split    # LLM on cuda:0, flow/HiFT on cuda:1 (cuda:0 if only one GPU)
    python -m bench.gpu_engine --tiny --device cpu  # the fixture's sizes on a CPU: a quick check of every code path

Random weights at the official sizes (bench/gpu_models.py); every segment's length is forced from its
text (25 speech tokens per second of audio). Stages:
  accuracy   bf16/fp16 vs fp32 on the same inputs (LLM log-probs, flow mels, HiFT waveforms)
  llm        speech tokens/s vs batch size: our torch backend (the whole decode step as CUDA
             graphs) and vLLM if importable
  flow_hift  audio s per s vs batch size, length-bucketed batches
  e2e        engine -> bounded queue -> upload threads (encode + write to a local folder), double
             buffer on and off (off: output queue 1, one upload thread)
  baseline   one segment at a time, eager: LLM fp32 step loop, flow fp16 autocast, HiFT fp32
  profile    torch.profiler of one decode step, one flow batch and one HiFT batch
Peak GPU memory is recorded per stage. Prints a table; writes JSON + Markdown (--out).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import math
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

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
)
from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend
from voxbatch.worker.cosyvoice2.llm import Attention, apply_rope
from voxbatch.worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest
from voxbatch.worker.cosyvoice2.sampling import sample_tokens
from voxbatch.worker.engine import Engine, SynthesisRequest, SynthesisResult

REPO = Path(__file__).resolve().parents[1]
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
    }
    try:
        info["vllm"] = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        info["vllm"] = None
    return info


# -- decode attention with grouped query heads (an A/B option) ------------------------------------------


def _grouped_decode_forward(self: Attention, x, cos, sin, mask, cache=None, write_rows=None, write_pos=None, kv_len=0):
    """Decode (T == 1): the g = H / KVH query heads of one KV head become g query rows of one head, so
    SDPA reads each cached K/V once with a plain (non-GQA) kernel instead of expanding K/V g times."""
    if cache is None or write_pos is None:
        return Attention.forward(self, x, cos, sin, mask, cache=cache, write_rows=write_rows, write_pos=write_pos, kv_len=kv_len)
    B = x.shape[0]
    q = self.q_proj(x).view(B, 1, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, 1, hd)
    k = self.k_proj(x).view(B, 1, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KVH, 1, hd)
    v = self.v_proj(x).view(B, 1, self.n_kv_heads, self.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache_k, cache_v = cache
    rows = torch.arange(B, device=x.device)
    cache_k[rows, :, write_pos] = k[:, :, 0]
    cache_v[rows, :, write_pos] = v[:, :, 0]
    keys, values = cache_k[:B, :, :kv_len], cache_v[:B, :, :kv_len]  # (B, KVH, kv_len, hd)
    g = self.n_heads // self.n_kv_heads
    qg = q.reshape(B, self.n_kv_heads, g, self.head_dim)  # query head h = kvh * g + j uses KV head kvh
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)  # mask (B, 1, 1, kv_len) broadcasts
    return self.o_proj(out.reshape(B, 1, self.n_heads * self.head_dim))


def set_grouped_decode(model, on: bool) -> None:
    for layer in model.body.layers:
        attn = layer.self_attn
        if on:
            attn.forward = types.MethodType(_grouped_decode_forward, attn)
        elif "forward" in attn.__dict__:
            del attn.forward


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

# -- the engine the worker pipeline drives -----------------------------------------------------------------


class BenchEngine(Engine):
    """CosyVoice2 stages over the benchmark's random-weight model: LLM (continuous batching, longest
    texts first so the batch does not end on a long tail) -> length-bucketed flow/HiFT batches as soon
    as `flow_batch` sequences are finished.

    `overlap=True` runs flow/HiFT in a second thread on its own CUDA stream while the LLM keeps
    decoding: the decode step is latency-bound and leaves most of the GPU idle, the flow fills it."""

    name = "cosyvoice2-bench"
    sample_rate = SAMPLE_RATE

    def __init__(self, llm: LlmBackend, renderer: Renderer, prompt: VoicePrompt, text_vocab: int,
                 max_batch: int = 512, flow_batch: int = 64, overlap: bool = True):
        self.llm, self.renderer, self.prompt, self.text_vocab = llm, renderer, prompt, text_vocab
        self.max_batch, self.flow_batch, self.overlap = max_batch, flow_batch, overlap
        self.times: dict[str, float] = defaultdict(float)

    def warmup(self) -> None:
        pass  # warmed by the benchmark before timing

    def _render(self, items: list[tuple[SynthesisRequest, list[int]]]) -> list[SynthesisResult]:
        wavs = self.renderer([t for _, t in items], [r.seed for r, _ in items])
        return [SynthesisResult(req, wav) for (req, _), wav in zip(items, wavs)]

    def _decoded(self, batch: list[SynthesisRequest]) -> Iterator[tuple[SynthesisRequest, list[int]]]:
        """(request, speech tokens) as sequences finish; requests enter longest text first."""
        reqs = [llm_request(r.text, r.seed, self.prompt, self.text_vocab) for r in batch]
        order = sorted(range(len(reqs)), key=lambda i: -len(reqs[i].text_tokens))
        for res in self.llm.generate([reqs[i] for i in order]):
            yield batch[order[res.index]], res.tokens

    def synthesize(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        if self.overlap:
            yield from self._synthesize_overlapped(batch)
            return
        done: list[tuple[SynthesisRequest, list[int]]] = []
        t0 = time.perf_counter()
        for item in self._decoded(batch):
            done.append(item)
            if len(done) >= self.flow_batch:
                self.times["llm"] += time.perf_counter() - t0
                done.sort(key=lambda x: len(x[1]))
                chunk, done = done[: self.flow_batch], done[self.flow_batch :]
                yield from self._render(chunk)
                t0 = time.perf_counter()
        self.times["llm"] += time.perf_counter() - t0
        done.sort(key=lambda x: len(x[1]))
        for i in range(0, len(done), self.flow_batch):
            yield from self._render(done[i : i + self.flow_batch])

    def _render_loop(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        dev = self.renderer.device
        stream = torch.cuda.Stream(dev) if dev.startswith("cuda") else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            while (chunk := inbox.get()) is not None:
                try:
                    outbox.put(self._render(chunk))
                except Exception as e:  # noqa: BLE001 - handed to the engine thread, which raises it
                    outbox.put(e)

    def _synthesize_overlapped(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        inbox: queue.Queue = queue.Queue()
        outbox: queue.Queue = queue.Queue()
        worker = threading.Thread(target=self._render_loop, args=(inbox, outbox), name="flow-hift", daemon=True)
        worker.start()
        sent = received = 0

        def take(block: bool) -> Iterator[SynthesisResult]:
            nonlocal received
            while received < sent:
                try:
                    item = outbox.get(block=block)
                except queue.Empty:
                    return
                received += 1
                if isinstance(item, Exception):
                    raise item
                yield from item

        try:
            done: list[tuple[SynthesisRequest, list[int]]] = []
            t0 = time.perf_counter()
            for item in self._decoded(batch):
                done.append(item)
                if len(done) >= self.flow_batch:
                    done.sort(key=lambda x: len(x[1]))
                    inbox.put(done[: self.flow_batch])
                    done = done[self.flow_batch :]
                    sent += 1
                yield from take(block=False)
            self.times["llm"] += time.perf_counter() - t0
            done.sort(key=lambda x: len(x[1]))
            for i in range(0, len(done), self.flow_batch):
                inbox.put(done[i : i + self.flow_batch])
                sent += 1
            yield from take(block=True)
        finally:
            inbox.put(None)
            worker.join()


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
    """Mean and peak GPU utilisation per device while a run lasts, from `nvidia-smi -lms` (issue 7 asks
    for each device's utilisation per placement); `None` where nvidia-smi is absent (CPU runs)."""

    def __init__(self, interval_ms: int = 200):
        self.interval_ms = interval_ms
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "GpuUtilisation":
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()

    def summary(self) -> dict[str, dict[str, float]] | None:
        if self.proc is None:
            return None
        out, _ = self.proc.communicate(timeout=10)
        samples: dict[str, list[float]] = defaultdict(list)
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[1].replace(".", "", 1).isdigit():
                samples[f"gpu{parts[0]}"].append(float(parts[1]))
        return {gpu: {"mean_pct": round(sum(v) / len(v), 1), "max_pct": max(v), "samples": len(v)}
                for gpu, v in samples.items()}


def run_pipeline(engines: list[Engine], corpus: list[Segment], out_dir: Path, queue_size: int,
                 upload_threads: int, fmt: str, timeout_s: float = 300.0, forced_lengths: bool = False) -> dict:
    """The worker's real path (worker/pipeline.py) with a local folder for storage; one pipeline per engine
    (per-gpu placement), segments dealt round-robin. Wall time from start until every segment is stored.

    `forced_lengths`: one task per segment whose max_tokens is the segment's planned speech tokens, for
    an engine that reads the length from the request (the worker's CosyVoice2Engine; random weights
    never stop). BenchEngine forces the lengths itself, in tasks of 16."""
    from voxbatch.jobstate import MemoryJobStore
    from voxbatch.models import RenderTask, SynthesisParams, TaskSegment, segment_id
    from voxbatch.settings import Settings
    from voxbatch.storage import LocalStorage
    from voxbatch.worker.pipeline import Pipeline

    settings = Settings(output_queue_size=queue_size, upload_threads=upload_threads, output_format=fmt, max_attempts=1)
    storage = LocalStorage(out_dir)
    jobs = MemoryJobStore()
    job = f"bench-{int(time.time() * 1000)}"
    jobs.create(job, "bench", "bench", fmt, len(corpus), time.time())
    segs = [TaskSegment(id=segment_id(0, i), chapter=0, text=s.text, seed=1000 + i)
            for i, s in enumerate(corpus)]
    metrics = StoreTimes()
    pipes, handles = [], []
    for e_i, engine in enumerate(engines):
        mine = segs[e_i :: len(engines)]
        pipe = Pipeline(engine, storage, jobs, settings, on_job_complete=lambda _j: None, metrics=metrics)
        per_task = 1 if forced_lengths else 16
        for k in range(0, len(mine), per_task):
            params = SynthesisParams(max_tokens=corpus[e_i + k * len(engines)].speech_tokens) if forced_lengths else SynthesisParams()
            task = RenderTask(job_id=job, voice="bench", format=fmt, params=params, segments=mine[k : k + per_task])
            handles.append(pipe.submit(task))  # fills the intake before the engine starts
        pipes.append(pipe)
    for e in engines:
        for times in _stage_times(e):
            times.clear()
    with GpuUtilisation() as util:
        t0 = time.perf_counter()
        for p in pipes:
            p.start()
        deadline = t0 + timeout_s
        for h in handles:
            if not h.wait(max(0.0, deadline - time.perf_counter())):
                for p in pipes:
                    p.stop()
                raise TimeoutError(f"pipeline: segments still unfinished after {timeout_s} s")
        wall = time.perf_counter() - t0
    for p in pipes:
        p.stop()
    audio_s = metrics.audio_s
    status = jobs.status(job)
    stage = defaultdict(float)
    for e in engines:
        for times in _stage_times(e):
            for k, v in times.items():
                stage[k] += v
    return {
        "segments": len(corpus),
        "audio_s": round(audio_s, 1),
        "audio_s_planned": round(sum(s.audio_s for s in corpus), 1),
        "wall_s": round(wall, 3),
        "x_realtime": round(audio_s / wall, 1),
        "rtf": round(wall / audio_s, 5),
        "stored": metrics.stored,
        "failed": metrics.failed,
        "engine_waited_on_full_queue_s": round(sum(p.engine_waited_s for p in pipes), 3),
        "stage_s": {k: round(v, 3) for k, v in stage.items()},
        "encode_and_write_s_summed_over_threads": round(metrics.store_s, 3),
        "job_state": getattr(status, "state", None),
        "gpu_utilisation": util.summary(),
    }


def _stage_times(engine: Engine) -> list[dict[str, float]]:
    """Per-stage timers a bench engine keeps (the worker's CosyVoice2Engine keeps none)."""
    if isinstance(engine, BenchEngine):
        return [engine.times, engine.renderer.times]
    return []


# -- stages ---------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t_start = time.perf_counter()
        self.results: dict = {"stages": {}, "errors": {}}
        self.compiled_flow_fn = None  # set by flow_hift with --flow-compile
        self.tmp = Path(tempfile.mkdtemp(prefix="vb-gpu-bench-"))
        self.model_dir = write_model_dir(self.tmp / "model", tiny=args.tiny, fixture_yaml=args.fixture_yaml)
        dev = args.device
        self.llm_dev = dev
        self.flow_dev = dev
        if args.placement == "split":
            self.flow_dev = "cuda:1" if torch.cuda.device_count() > 1 else dev
        self.devices = sorted({self.llm_dev, self.flow_dev})
        low = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        flow_low = torch.float16 if dev.startswith("cuda") else torch.float32
        self.hift_low = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.hift_dtype] if dev.startswith("cuda") else torch.float32
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
            return
        print(f"== {name} (t={self.elapsed():.0f}s)", flush=True)
        reset_peak(self.devices)
        t = time.perf_counter()
        try:
            out = fn()
            out["peak_gpu_gib"] = peak_gib(self.devices)
            out["stage_wall_s"] = round(time.perf_counter() - t, 1)
            self.results["stages"][name] = out
        except Exception as e:  # noqa: BLE001 - one failing stage must not lose the others
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
        # The grouped decode attention computes the same function as the stock one.
        out["grouped_decode_attention_max_abs_logp"] = self._grouped_check()
        out["note"] = "random weights: errors show precision loss of the arithmetic, not of speech quality"
        return out

    @torch.inference_mode()
    def _grouped_check(self) -> float:
        b = TorchLlmBackend(self.llm, 4, self.max_seq, cuda_graphs=False, bucket_batches=False)
        reqs = [llm_request(s.text, i, self.prompt, self.text_vocab, n_tokens=4) for i, s in enumerate(self.corpus[:4])]
        rows = b._state(4)
        rows.fill([0, 1, 2, 3], reqs)
        tok = torch.tensor([5, 6, 7, 8], device=self.llm_dev)
        pos = rows.lengths.clone()
        stock = self.llm.decode_step(tok, pos, self.max_seq)
        rows.fill([0, 1, 2, 3], reqs)
        set_grouped_decode(self.llm, True)
        try:
            grouped = self.llm.decode_step(tok, pos, self.max_seq)
        finally:
            set_grouped_decode(self.llm, False)
        b.close()
        return round(float((stock - grouped).abs().max()), 5)

    # -- LLM ----------------------------------------------------------------------------------------------

    def _fixed_requests(self, n: int, tokens: int) -> list[LlmRequest]:
        return [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab, n_tokens=tokens)
                for i, s in enumerate((self.corpus * (n // len(self.corpus) + 1))[:n])]

    @staticmethod
    def _measure(backend: LlmBackend, reqs: list[LlmRequest]) -> dict:
        sync()
        t = time.perf_counter()
        n = 0
        first = None
        for r in backend.generate(reqs):
            n += len(r.tokens)
            first = first or time.perf_counter() - t
        sync()
        s = time.perf_counter() - t
        return {"requests": len(reqs), "tokens": n, "seconds": round(s, 4), "tokens_per_s": round(n / s, 1),
                "first_result_s": round(first or 0.0, 4)}

    def llm_stage(self) -> dict:
        a = self.args
        out: dict = {"fixed_tokens": a.llm_tokens, "note": "B requests of fixed length decoded in B cache rows"}
        rows = []
        main = ("graphs" if a.decode_attention == "stock" else "graphs+grouped-attn", a.decode_attention == "grouped")
        other = ("graphs+grouped-attn", True) if a.decode_attention == "stock" else ("graphs", False)
        for label, grouped in [main] + ([other] if a.ab_attention else []):
            set_grouped_decode(self.llm, grouped)
            for B in a.llm_batches:
                if label != main[0] and B not in (1, max(a.llm_batches)):
                    continue
                reset_peak([self.llm_dev])
                t = time.perf_counter()
                backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
                capture_s = time.perf_counter() - t
                backend_warm = self._fixed_requests(min(B, 4), 8)
                list(backend.generate(backend_warm))
                r = self._measure(backend, self._fixed_requests(B, a.llm_tokens))
                r.update(impl=label, batch=B, capture_s=round(capture_s, 2), peak_gpu_gib=peak_gib([self.llm_dev]))
                rows.append(r)
                print(f"  llm {label:20s} B={B:4d} {r['tokens_per_s']:10.1f} tok/s", flush=True)
                backend.close()
                del backend
            set_grouped_decode(self.llm, False)
        # Continuous batching over the whole mixed-length corpus, rows = the largest batch.
        set_grouped_decode(self.llm, main[1])
        B = max(a.llm_batches)
        backend = TorchLlmBackend(self.llm, B, self.max_seq, bucket_batches=False)
        reqs = [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab) for i, s in enumerate(self.corpus)]
        r = self._measure(backend, reqs)
        r.update(impl=f"{main[0]}, continuous, corpus in given order", batch=B)
        rows.append(r)
        print(f"  llm corpus continuous B={B} {r['tokens_per_s']:10.1f} tok/s", flush=True)
        backend.close()
        set_grouped_decode(self.llm, False)
        out["rows"] = rows
        return out

    def vllm_stage(self) -> dict:
        from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions

        save_llm(self.llm, self.model_dir)
        t = time.perf_counter()
        backend = VllmLlmBackend(self.model_dir, VllmOptions(gpu_memory_utilization=self.args.vllm_mem, max_model_len=self.max_seq,
                                                             max_num_seqs=max(self.args.llm_batches),
                                                             export_cache_dir=str(self.tmp / "vllm-export")))
        startup = time.perf_counter() - t
        rows = []
        try:
            list(backend.generate(self._fixed_requests(4, 8)))
            for B in self.args.llm_batches:
                r = self._measure(backend, self._fixed_requests(B, self.args.llm_tokens))
                r.update(impl="vllm", batch=B)
                rows.append(r)
                print(f"  llm vllm B={B:4d} {r['tokens_per_s']:10.1f} tok/s", flush=True)
            reqs = [llm_request(s.text, 1000 + i, self.prompt, self.text_vocab) for i, s in enumerate(self.corpus)]
            r = self._measure(backend, reqs)
            r.update(impl="vllm, continuous, corpus", batch=max(self.args.llm_batches))
            rows.append(r)
        finally:
            backend.close()
        return {"startup_s": round(startup, 1), "rows": rows, "gpu_memory_utilization": self.args.vllm_mem}

    # -- flow + HiFT -------------------------------------------------------------------------------------

    def flow_hift_stage(self) -> dict:
        a = self.args
        rows = []
        hifts = {a.hift_dtype: self.hift}
        if self.flow_dev.startswith("cuda") and a.hift_dtype != "fp32":
            hifts["fp32"] = build_hift(self.model_dir, self.flow_dev, torch.float32)
        by_len = sorted(self.corpus, key=lambda s: s.speech_tokens)
        for hname, hift in hifts.items():
            renderer = Renderer(self.flow, hift, self.prompt, self.flow_dev)
            renderer([[1] * 50], [0])  # warm-up
            for B in a.flow_batches:
                if hname != a.hift_dtype and B != max(a.flow_batches):
                    continue
                pick, batches = self._flow_batches(by_len, B)
                renderer.times.clear()
                reset_peak([self.flow_dev])
                audio = 0.0
                sync()
                t = time.perf_counter()
                for toks in batches:
                    wavs = renderer(toks, list(range(len(toks))))
                    audio += sum(len(w) for w in wavs) / SAMPLE_RATE
                sync()
                wall = time.perf_counter() - t
                rt = renderer.times
                rows.append({
                    "batch": B, "hift_dtype": hname, "segments": len(pick), "audio_s": round(audio, 1),
                    "flow_s": round(rt["flow"], 3), "hift_s": round(rt["hift"], 3), "d2h_s": round(rt["d2h"], 3),
                    "flow_x_realtime": round(audio / rt["flow"], 1), "hift_x_realtime": round(audio / rt["hift"], 1),
                    "flow_hift_x_realtime": round(audio / wall, 1), "peak_gpu_gib": peak_gib([self.flow_dev]),
                })
                print(f"  flow/hift B={B:3d} hift {hname}: flow {audio / rt['flow']:8.1f}x  hift {audio / rt['hift']:8.1f}x  "
                      f"both {audio / wall:8.1f}x realtime", flush=True)
        out = {"rows": rows, "flow_dtype": str(self.flow.dtype), "note": "audio s per wall s; prompt (8 s) included in every flow row as the model needs"}
        if a.flow_compile:
            out["compiled"] = self._flow_compiled_rows(by_len)
        return out

    def _flow_batches(self, by_len: list[Segment], B: int) -> tuple[list[Segment], list[list[list[int]]]]:
        """Length buckets: a spread of the corpus (every k-th by length), cut into B-sized runs of similar
        length; -> the segments picked, and each run's speech tokens."""
        a = self.args
        n = min(len(by_len), max(a.flow_min_segments, a.flow_batches_per_size * B))
        pick = by_len[:: max(1, len(by_len) // n)][:n]
        batches = [[[(j * 131 + k * 7) % self.speech_vocab for k in range(s.speech_tokens)] for j, s in enumerate(pick[i : i + B])]
                   for i in range(0, len(pick), B)]
        return pick, batches

    def _flow_compiled_rows(self, by_len: list[Segment]) -> dict:
        """The flow estimator through torch.compile (dynamic shapes) against eager, same batches."""
        B = max(self.args.flow_batches)
        renderer = Renderer(self.flow, self.hift, self.prompt, self.flow_dev)
        pick, batches = self._flow_batches(by_len, B)
        probe = batches[0][:4]
        eager_mel, _ = renderer.mels(probe)
        t0 = time.perf_counter()
        self.flow.decoder.compile_estimator()
        renderer.mels([[1] * 50]); renderer.mels(probe); sync()  # compile: B=1 and B>1 (dynamo specialises 1)
        compile_s = time.perf_counter() - t0
        compiled = self.flow.decoder.compiled_estimator
        compiled_mel, _ = renderer.mels(probe)
        res = {"compile_s": round(compile_s, 1), "mel_max_abs_vs_eager": float((compiled_mel - eager_mel).abs().max()),
               "mel_rel_l2_vs_eager": float((compiled_mel - eager_mel).norm() / eager_mel.norm())}
        for label, fn in (("compiled", compiled), ("eager", None)):
            self.flow.decoder.compiled_estimator = fn
            renderer.mels(probe); sync()
            t = time.perf_counter()
            frames = 0
            for b in batches:
                mel, lens = renderer.mels(b)
                frames += int(lens.sum())
            sync()
            wall = time.perf_counter() - t
            audio = frames * 480 / SAMPLE_RATE
            res[label] = {"batch": B, "segments": len(pick), "audio_s": round(audio, 1), "flow_s": round(wall, 3), "flow_x_realtime": round(audio / wall, 1)}
            print(f"  flow B={B} {label}: {audio / wall:8.1f}x realtime", flush=True)
        res["dynamo_unique_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        res["speedup"] = round(res["eager"]["flow_s"] / res["compiled"]["flow_s"], 3)
        self.compiled_flow_fn = compiled  # e2e's compiled-flow run reuses it (no second compile)
        return res

    # -- end to end ---------------------------------------------------------------------------------------------

    def _engine(self, llm, flow, hift, flow_dev) -> BenchEngine:
        backend = TorchLlmBackend(llm, self.args.e2e_rows, self.max_seq, bucket_batches=False)
        return BenchEngine(backend, Renderer(flow, hift, self.prompt, flow_dev), self.prompt, self.text_vocab,
                           max_batch=self.args.e2e_intake, flow_batch=self.args.e2e_flow_batch)

    def _e2e(self, flow, hift, flow_dev: str, corpus: list[Segment], configs: list[tuple]) -> dict:
        """configs: (label, output queue size, upload threads, overlap[, compiled flow])."""
        a = self.args
        set_grouped_decode(self.llm, a.decode_attention == "grouped")
        engine = self._engine(self.llm, flow, hift, flow_dev)
        runs = {}
        try:
            run_pipeline([engine], corpus[: min(8, len(corpus))], self.tmp / "warm", 64, 4, a.format)
            for label, qsize, threads, overlap, *compiled in configs:
                engine.overlap = overlap
                flow.decoder.compiled_estimator = self.compiled_flow_fn if compiled and compiled[0] else None
                reset_peak(sorted({self.llm_dev, flow_dev}))
                r = run_pipeline([engine], corpus, self.tmp / f"out-{label}", qsize, threads, a.format)
                r.update(output_queue_size=qsize, upload_threads=threads, format=a.format, overlap_llm_and_flow=overlap,
                         llm_device=self.llm_dev, flow_device=flow_dev, peak_gpu_gib=peak_gib(sorted({self.llm_dev, flow_dev})))
                if compiled and compiled[0]:
                    r["dynamo_unique_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
                runs[label] = r
                print(f"  e2e {label}: {r['x_realtime']:.1f}x realtime (RTF {r['rtf']}), wall {r['wall_s']}s, "
                      f"stages {r['stage_s']}, engine blocked {r['engine_waited_on_full_queue_s']}s", flush=True)
        finally:
            engine.llm.close()
            set_grouped_decode(self.llm, False)
        hift_dtype = str(hift.conv_pre.weight.dtype)
        return {"runs": runs, "engine": {"llm_rows": a.e2e_rows, "intake_batch": a.e2e_intake, "flow_batch": a.e2e_flow_batch,
                                         "llm": f"torch-graphs bf16, {a.decode_attention} decode attention", "flow": str(flow.dtype), "hift": hift_dtype,
                                         "request_order": "longest text first"}}

    def e2e_stage(self) -> dict:
        a = self.args
        return self._e2e(self.flow, self.hift, self.flow_dev, self.corpus,
                         [("double_buffer_on", 64, a.upload_threads, a.overlap), ("double_buffer_off", 1, 1, a.overlap)]
                         + ([("double_buffer_on_sequential", 64, a.upload_threads, False)] if a.overlap else [])
                         + ([("double_buffer_on_sequential_flow_compiled", 64, a.upload_threads, False, True)]
                            if self.compiled_flow_fn is not None else []))

    def e2e_engine_stage(self) -> dict:
        """The worker's own CosyVoice2Engine (worker/cosyvoice2/engine.py: tokenizer, LLM request
        composition, its scheduler and flow buckets, voice preparation) on the benchmark's modules,
        through the same pipeline: what `voxbatch worker` does on this GPU, against BenchEngine's
        longest-first scheduling above. Each segment is one task with max_tokens = its planned speech
        tokens (random weights never stop); the intake holds `--e2e-intake` segments, as a worker
        holds task_concurrency x batch_size."""
        from voxbatch.voice import VoiceProfile
        from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine
        from voxbatch.tokenizer import CosyVoice2Tokenizer

        a = self.args
        tokenizer = CosyVoice2Tokenizer.from_model_dir(self.model_dir)
        profile = VoiceProfile(
            name="bench", prompt_text=PROMPT_TRANSCRIPT, prompt_speech_tokens=np.array(self.prompt.speech_tokens),
            speaker_embedding=self.prompt.embedding.numpy(), prompt_mel=self.prompt.mel.numpy(),
        )
        runs = {}
        for rows in sorted(set(a.engine_rows), reverse=True):
            backend = TorchLlmBackend(self.llm, rows, self.max_seq)
            engine = CosyVoice2Engine(tokenizer, backend, self.flow, self.hift, lambda _name: profile,
                                      self.speech_vocab, max_batch=rows, flow_batch=a.e2e_flow_batch)
            try:
                engine.warmup()
                run_pipeline([engine], self.corpus[:8], self.tmp / f"warm-engine-{rows}", 64, 4, a.format, forced_lengths=True)
                for label, compiled in [("eager_flow", False)] + ([("compiled_flow", True)] if self.compiled_flow_fn else []):
                    self.flow.decoder.compiled_estimator = self.compiled_flow_fn if compiled else None
                    reset_peak(sorted({self.llm_dev, self.flow_dev}))
                    r = run_pipeline([engine], self.corpus, self.tmp / f"out-engine-{rows}-{label}", 64, a.upload_threads,
                                     a.format, forced_lengths=True)
                    r.update(llm_rows=rows, engine_max_batch=rows, flow_batch=a.e2e_flow_batch, flow_compiled=compiled,
                             output_queue_size=64, upload_threads=a.upload_threads, peak_gpu_gib=peak_gib(sorted({self.llm_dev, self.flow_dev})))
                    runs[f"worker_engine_rows{rows}_{label}"] = r
                    print(f"  e2e worker engine rows={rows} {label}: {r['x_realtime']:.1f}x realtime (RTF {r['rtf']}), "
                          f"wall {r['wall_s']}s, stored {r['stored']}, failed {r['failed']}", flush=True)
            finally:
                self.flow.decoder.compiled_estimator = None
                backend.close()
        return {"runs": runs, "note": "worker/cosyvoice2/engine.py CosyVoice2Engine, torch LLM backend (CUDA graphs), "
                                      "one task per segment, intake = LLM rows"}

    def e2e_split_stage(self) -> dict:
        """Issue 7's split placement: LLM on the first GPU, flow + HiFT on the second. With one GPU both sit
        on it, which checks the code path only (no speed claim)."""
        dev = "cuda:1" if torch.cuda.device_count() > 1 else self.llm_dev
        if dev == self.flow_dev:
            flow, hift = self.flow, self.hift
        else:
            flow, hift = build_flow(self.model_dir, dev, torch.float16), build_hift(self.model_dir, dev, self.hift_low)
        out = self._e2e(flow, hift, dev, self.corpus[: self.args.split_segments], [("split", 64, self.args.upload_threads, self.args.overlap)])
        out["note"] = ("two GPUs: a real split" if dev != self.llm_dev
                       else "one GPU: LLM and flow/HiFT both on it; checks the split code path only, no speed claim")
        return out

    def per_gpu_stage(self) -> dict:
        n = torch.cuda.device_count()
        if n < 2:
            return {"not_run": f"per-gpu placement needs 2+ GPUs; this machine has {n}"}
        engines = []
        for i in range(n):
            dev = f"cuda:{i}"
            llm = build_llm(self.model_dir, dev, torch.bfloat16)
            set_grouped_decode(llm, self.args.decode_attention == "grouped")
            engines.append(self._engine(llm, build_flow(self.model_dir, dev, torch.float16),
                                        build_hift(self.model_dir, dev, self.hift_low), dev))
        run_pipeline(engines, self.corpus[: 8 * n], self.tmp / "warm-pg", 64, 4, self.args.format)
        r = run_pipeline(engines, self.corpus, self.tmp / "out-pg", 64, self.args.upload_threads, self.args.format)
        r.update(gpus=n, mode="one engine per GPU, threads in one process")
        return {"runs": {"per_gpu": r}}

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
        for label, grouped in (("decode_step_stock_attn", False), ("decode_step_grouped_attn", True)):
            set_grouped_decode(self.llm, grouped)
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
            out[label] = self._top(prof, f"{label} B={B} kv=512, 5 steps eager")
            backend.close()
            set_grouped_decode(self.llm, False)
        fb = max(self.args.flow_batches)
        by_len = sorted(self.corpus, key=lambda s: s.speech_tokens)
        chunk = by_len[len(by_len) // 2 : len(by_len) // 2 + fb]
        toks = [[(j * 131 + k * 7) % self.speech_vocab for k in range(s.speech_tokens)] for j, s in enumerate(chunk)]
        renderer = Renderer(self.flow, self.hift, self.prompt, self.flow_dev)
        renderer(toks[:2], [0, 1])
        with torch.inference_mode():
            with profile(activities=acts) as prof:
                mel, lens = renderer.mels(toks)
                sync()
            out["flow"] = self._top(prof, f"flow B={len(chunk)} (~{chunk[0].audio_s:.1f} s each)")
            with profile(activities=acts) as prof:
                renderer.wavs(mel, lens, list(range(len(chunk))))
                sync()
            out["hift"] = self._top(prof, f"hift B={len(chunk)}")
        lines = []
        for k, v in out.items():
            lines.append(f"### {k}: {v['what']}\n{v['table']}\n")
            del v["table"]
        (self.args.out / f"{self.args.name}_profile.txt").write_text("\n".join(lines))
        return out

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


def _util(summary: dict | None) -> str:
    return ", ".join(f"{gpu} {u['mean_pct']}" for gpu, u in sorted(summary.items())) if summary else "-"


def table(results: dict) -> str:
    st = results["stages"]
    env = results["environment"]
    lines = [f"# GPU engine benchmark ({results['when']})", "",
             f"GPU {', '.join(env['gpus']) or 'none'}; torch {env['torch']} (CUDA {env['cuda_runtime']}); vLLM {env.get('vllm')}; "
             f"placement {results['settings']['placement']}; model: CosyVoice2-0.5B sizes, random weights", ""]
    c = results.get("corpus", {})
    if c:
        lines += [f"corpus: {c['segments']} segments ({c['zh']} zh, {c['en']} en), {c['audio_s_total']} s of audio "
                  f"(min/mean/max {c['audio_s_min_mean_max']} s), {c['speech_tokens_total']} speech tokens; "
                  f"prompt {c['prompt']['speech_tokens']} speech tokens / {c['prompt']['mel_frames']} mel frames", ""]
    llm_rows = st.get("llm", {}).get("rows", []) + st.get("vllm", {}).get("rows", [])
    if llm_rows:
        lines += ["## LLM stage: speech tokens/s", "", "| backend | batch | requests | tokens | s | tokens/s | peak GiB |", "|---|---|---|---|---|---|---|"]
        for r in llm_rows:
            lines.append(f"| {r['impl']} | {r['batch']} | {r['requests']} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']:,.0f} | {r.get('peak_gpu_gib', '')} |")
        if "vllm" in st and "startup_s" in st["vllm"]:
            lines.append(f"\nvLLM engine start-up {st['vllm']['startup_s']} s")
        lines.append("")
    fh = st.get("flow_hift", {}).get("rows", [])
    if fh:
        lines += ["## flow + HiFT: audio seconds per second", "", "| batch | HiFT dtype | segments | audio s | flow x RT | HiFT x RT | both x RT | peak GiB |", "|---|---|---|---|---|---|---|---|"]
        for r in fh:
            lines.append(f"| {r['batch']} | {r['hift_dtype']} | {r['segments']} | {r['audio_s']} | {r['flow_x_realtime']} | {r['hift_x_realtime']} | {r['flow_hift_x_realtime']} | {r['peak_gpu_gib']} |")
        comp = st["flow_hift"].get("compiled")
        if comp:
            lines.append(f"\nflow estimator through torch.compile (batch {comp['compiled']['batch']}, {comp['compiled']['segments']} segments): "
                         f"{comp['compiled']['flow_x_realtime']}x vs eager {comp['eager']['flow_x_realtime']}x real time "
                         f"(speed-up {comp['speedup']}); compile {comp['compile_s']} s; mel vs eager max abs {comp['mel_max_abs_vs_eager']:.2e}, "
                         f"rel L2 {comp['mel_rel_l2_vs_eager']:.2e}")
        lines.append("")
    e2e = dict(st.get("e2e", {}).get("runs", {}))
    e2e.update(st.get("e2e_engine", {}).get("runs", {}))
    e2e.update(st.get("e2e_split", {}).get("runs", {}))
    e2e.update(st.get("per_gpu", {}).get("runs", {}))
    base = st.get("baseline")
    if e2e or base:
        lines += ["## End to end (engine -> bounded queue -> encode + write)", "",
                  "| run | segments | audio s | wall s | x real time | RTF | LLM s | flow s | HiFT s | encode+write s (all threads) | engine blocked s | peak GiB | GPU util % (mean per device) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, r in e2e.items():
            s = r["stage_s"]
            ov = "LLM || flow/HiFT" if r.get("overlap_llm_and_flow") else "sequential"
            lines.append(f"| {k} (queue {r.get('output_queue_size')}, {r.get('upload_threads')} upload threads, {ov}) | {r['segments']} | {r['audio_s']} | {r['wall_s']} | "
                         f"{r['x_realtime']} | {r['rtf']} | {s.get('llm', 0)} | {s.get('flow', 0)} | {s.get('hift', 0)} | "
                         f"{r['encode_and_write_s_summed_over_threads']} | {r['engine_waited_on_full_queue_s']} | {r.get('peak_gpu_gib', '')} | "
                         f"{_util(r.get('gpu_utilisation'))} |")
        if base and "wall_s" in base:
            lines.append(f"| baseline: one at a time, LLM fp32 step loop, flow fp16 autocast, HiFT fp32 | {base['segments']} | {base['audio_s']} | "
                         f"{base['wall_s']} | {base['x_realtime']} | {base['rtf']} | {base['llm_s']} | {base['flow_s']} | {base['hift_s']} | - | - | {base.get('peak_gpu_gib')} | - |")
        on = e2e.get("double_buffer_on")
        if on and base and "x_realtime" in base:
            lines.append(f"\nbatched (double buffer on) vs baseline: {on['x_realtime'] / base['x_realtime']:.1f}x faster")
        lines.append("")
    pg = st.get("per_gpu", {})
    if "not_run" in pg:
        lines.append(f"per-gpu placement: not run ({pg['not_run']})\n")
    acc = st.get("accuracy")
    if acc:
        lines += ["## Precision vs fp32 (same inputs)", "", "```", json.dumps({k: v for k, v in acc.items() if k not in ("peak_gpu_gib", "stage_wall_s")}, indent=1), "```", ""]
    if results["errors"]:
        lines += ["## Errors", ""] + [f"- {k}: {v.splitlines()[0]}" for k, v in results["errors"].items()] + [""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--placement", choices=["single", "split", "per-gpu"], default="single")
    ap.add_argument("--stages", nargs="+", default=["accuracy", "llm", "flow_hift", "e2e", "e2e_engine", "e2e_split", "baseline", "profile", "vllm"])
    ap.add_argument("--segments", type=int, default=500)
    ap.add_argument("--max-s", type=float, default=15.0, help="longest segment, seconds of audio")
    ap.add_argument("--llm-batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--llm-tokens", type=int, default=250, help="fixed output length in the batch sweep (10 s of audio)")
    ap.add_argument("--ab-attention", action="store_true", help="also sweep the other decode attention (batch 1 and the largest)")
    ap.add_argument("--flow-batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--flow-batches-per-size", type=int, default=2)
    ap.add_argument("--flow-min-segments", type=int, default=16)
    ap.add_argument("--hift-dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                    help="HiFT generator dtype (F0 and source stay fp32); bf16 measured no faster on the H200")
    ap.add_argument("--decode-attention", choices=["stock", "grouped"], default="stock",
                    help="e2e decode attention: stock SDPA with GQA (cuDNN) or query heads grouped per KV head")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="e2e: flow/HiFT in a second thread on its own CUDA stream while the LLM decodes")
    ap.add_argument("--flow-compile", action="store_true",
                    help="flow_hift: also run the estimator through torch.compile (A/B vs eager); e2e then adds a compiled-flow run")
    ap.add_argument("--e2e-rows", type=int, default=256, help="LLM cache rows in the engine")
    ap.add_argument("--engine-rows", type=int, nargs="+", default=[256, 64],
                    help="e2e_engine: LLM rows (= segments the worker's engine holds) to run")
    ap.add_argument("--e2e-intake", type=int, default=512, help="segments the engine takes from its intake at once")
    ap.add_argument("--e2e-flow-batch", type=int, default=64)
    ap.add_argument("--upload-threads", type=int, default=8)
    ap.add_argument("--format", default="flac", choices=["wav", "flac", "ogg"])
    ap.add_argument("--baseline-segments", type=int, default=10)
    ap.add_argument("--split-segments", type=int, default=64)
    ap.add_argument("--vllm-mem", type=float, default=0.3)
    ap.add_argument("--budget-s", type=float, default=520, help="skip stages that would start after this many seconds")
    ap.add_argument("--tiny", action="store_true", help="the test fixture's sizes (CPU smoke run)")
    ap.add_argument("--fixture-yaml", type=Path, default=REPO.parent / "shared" / "fixtures" / "cosyvoice2-tiny" / "cosyvoice2.yaml")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", default="gpu_engine")
    args = ap.parse_args()
    if args.placement == "per-gpu":
        args.stages = [s if s != "e2e" else "per_gpu" for s in args.stages]

    torch.manual_seed(0)
    bench = Bench(args)
    r = bench.results
    r["when"] = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    r["environment"] = environment(args)
    r["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    r["command"] = "python -m bench.gpu_engine " + " ".join(sys.argv[1:])
    print(json.dumps({"corpus": r["corpus"], "model": r["model"]}, indent=1), flush=True)
    bench.stage("accuracy", bench.accuracy)
    bench.stage("llm", bench.llm_stage)
    bench.stage("flow_hift", bench.flow_hift_stage)
    bench.stage("e2e", bench.e2e_stage)
    bench.stage("e2e_engine", bench.e2e_engine_stage)
    bench.stage("e2e_split", bench.e2e_split_stage)
    bench.stage("per_gpu", bench.per_gpu_stage)
    bench.stage("baseline", bench.baseline_stage)
    bench.stage("profile", bench.profile_stage)
    bench.stage("vllm", bench.vllm_stage)
    if args.placement != "per-gpu":
        r["stages"]["per_gpu"] = {"not_run": "placement per-gpu not selected" if torch.cuda.device_count() > 1
                                  else f"per-gpu placement needs 2+ GPUs; this machine has {torch.cuda.device_count()}"}
    r["total_wall_s"] = round(bench.elapsed(), 1)
    bench.save()
    text = table(r)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    print("\n" + text, flush=True)


if __name__ == "__main__":
    main()
