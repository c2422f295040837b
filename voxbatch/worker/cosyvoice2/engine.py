"""The CosyVoice2 engine: text -> LLM speech tokens -> flow mel -> HiFT waveform, batched end to end.

    requests ──tokenize──> LlmRequest per mode ──LlmBackend.generate──> speech tokens, as each row stops
             ──length buckets──> flow (voice prompt tokens / mel / embedding) ──speed──> HiFT ──> audio

Sequences leave the LLM at different times; each finished one goes into a bucket of similar token
length, and a bucket runs through flow + HiFT as one padded batch as soon as it is full (or when the
LLM has nothing left), so the acoustic models work while the LLM still decodes the long rows and
padding stays below 1.41x (streaming.length_bucket). Both acoustic models are batch-invariant up to rounding (masks, per-row noise),
so a segment sounds the same whichever batch it lands in, though not bit for bit: GEMM and conv kernels
are picked per batch shape. The LLM samples with a per-request seed; whether its tokens survive another
batch depends on its dtype (Settings.llm_dtype).

How each mode builds the LLM input (as the official CosyVoice2 frontend does):
  zero_shot     text = prompt_text ++ text, prompt speech = the voice's speech tokens
  cross_lingual text = text,                prompt speech = none
  instruct2     text = instruct_text + "<|endofprompt|>" ++ text, prompt speech = none
The flow is always conditioned on the voice (prompt tokens, prompt mel, speaker embedding).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from voxbatch.models import SynthesisParams
from voxbatch.reuse import VOICE_TTL_S
from voxbatch.settings import Settings
from voxbatch.voice import VoiceProfile
from voxbatch.worker import timeline
from voxbatch.worker.cosyvoice2.flow import CausalFlow, MelBatch, PendingMel
from voxbatch.worker.cosyvoice2.forced_lengths import forced_speech_tokens
from voxbatch.worker.cosyvoice2.h2d import to_device
from voxbatch.worker.cosyvoice2.hift import HiFTGenerator
from voxbatch.worker.cosyvoice2.hub import resolve_model_dir
from voxbatch.worker.cosyvoice2.llm_backend import LlmBackend, LlmRequest
from voxbatch.tokenizer import CosyVoice2Tokenizer
from voxbatch.worker.engine import Engine, SynthesisRequest, SynthesisResult, is_out_of_memory
from voxbatch.worker.cosyvoice2.streaming import StreamingScheduler, length_bucket

log = logging.getLogger(__name__)

END_OF_PROMPT = "<|endofprompt|>"
MIN_TOKENS_PER_TEXT_TOKEN = 2  # official Qwen2LM min_len ratio
MAX_TOKENS_PER_TEXT_TOKEN = 20  # official Qwen2LM max_len ratio
WARMUP_TEXT = "Warm up the engine."


@dataclass(frozen=True)
class Placement:
    """Devices and dtypes of the three networks (GPU: bf16 LLM, fp16 flow, fp32 HiFT; CPU: all fp32)."""

    llm_device: str
    flow_device: str
    hift_device: str
    llm_dtype: torch.dtype
    flow_dtype: torch.dtype  # fp16 over bf16: mel max abs error 6e-3 vs 5e-2 (measured, flow.py)
    hift_dtype: torch.dtype

    @classmethod
    def from_settings(cls, settings: Settings) -> Placement:
        default = "cuda:0" if torch.cuda.is_available() else "cpu"
        llm = settings.llm_device or default
        flow = settings.flow_device or llm
        hift = settings.hift_device or flow

        def pick(device: str, gpu_dtype: torch.dtype) -> torch.dtype:
            return gpu_dtype if torch.device(device).type == "cuda" else torch.float32

        llm_gpu_dtype = torch.float32 if settings.llm_dtype == "float32" else torch.bfloat16
        return cls(llm, flow, hift, pick(llm, llm_gpu_dtype), pick(flow, torch.float16), pick(hift, HIFT_GPU_DTYPE))


# HiFT's generator dtype on a GPU (its F0 predictor and source stay fp32 whatever this is: hift.py).
# fp32 is what ships: the half-precision generators are tested to run and to stay near it on the tiny
# fixture (tests/test_cosyvoice2_hift.py::test_gpu: relative RMS < 0.05 in fp16, < 0.2 in bf16), but
# their audio has not been judged against real weights. fp16 measured faster: engine 331.5x (335.6,
# 331.5) vs 297.4x (297.4, 322.6) in fp32, A B B A, ahead in both pairs by 3% and 13%
# (bench/results/gpu_h200_hift16.json). Not changed until its audio is. Bench switch `hift_dtype`.
HIFT_GPU_DTYPE = torch.float32


# The rows `llm_rows` picks when Settings.engine_max_batch is unset.
GPU_ROWS = 256  # the fastest measured on an H200 (bench/results/gpu_h200_worker.json: rows=256)
CPU_ROWS = 16  # fp32 on a CPU: 256 rows of the 0.5B model would hold ~26 GB of KV cache, and decode slower
KV_CACHE_SHARE = 0.4  # most of the LLM GPU's free memory the torch backend's auto-sized KV cache takes


def llm_rows(placement: Placement, kv_bytes_per_row: int | None, free_bytes: int | None = None) -> int:
    """The engine's rows (requests decoded at once) when the settings leave them to the engine.

    GPU_ROWS with the LLM on a GPU, halved while the torch backend's KV cache (`kv_bytes_per_row` x
    rows, allocated up front) would take more than KV_CACHE_SHARE of the GPU's free memory, so a
    24 GB card gets 128 rows of the 0.5B model in bf16 and the rest stays for the decode graphs and
    flow/HiFT; vLLM (`kv_bytes_per_row` None) sizes its own cache within its memory share. CPU_ROWS on
    a CPU. `free_bytes` defaults to what the LLM's GPU has free now, before the engine loads."""
    device = torch.device(placement.llm_device)
    if device.type != "cuda":
        return CPU_ROWS
    rows = GPU_ROWS
    if kv_bytes_per_row is not None:
        free = torch.cuda.mem_get_info(device)[0] if free_bytes is None else free_bytes
        while rows > CPU_ROWS and rows * kv_bytes_per_row > KV_CACHE_SHARE * free:
            rows //= 2
    return rows


def cap_gpu_memory(placement: Placement, gib: float | None) -> int | None:
    """Hold torch's allocations on each of the placement's GPUs within `gib` (Settings.engine_gpu_memory_gib);
    the bytes the LLM's GPU then has free for the engine (what `llm_rows` sizes the rows from), or None
    where nothing is capped (no cap, or the LLM not on a GPU)."""
    if gib is None:
        return None
    free = None
    for name in dict.fromkeys((placement.llm_device, placement.flow_device, placement.hift_device)):
        device = torch.device(name)
        if device.type != "cuda":
            continue
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device)
        if name == placement.llm_device:
            free = min(torch.cuda.mem_get_info(device)[0], max(0, int(gib * 2**30) - torch.cuda.memory_reserved(device)))
    return free


@contextlib.contextmanager
def loading_within(gib: float | None):
    """An engine that runs out of device memory while it loads under Settings.engine_gpu_memory_gib: a
    ValueError naming the setting (bad input: the cap is below what the model needs), not torch's error."""
    try:
        yield
    except Exception as e:
        if gib is not None and is_out_of_memory(e):
            raise ValueError(f"VOXBATCH_ENGINE_GPU_MEMORY_GIB={gib:g} is too little GPU memory to load the engine "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
        raise


# HiFT batches are padded to a multiple of this many mel frames (rows carry their lengths, so padding
# changes no output). cuDNN builds an execution plan for each new convolution shape and PyTorch keeps
# them per exact shape: at the width of each batch's longest row nearly every HiFT batch meets new
# shapes for its ~60 convs, at multiples of 32 frames a corpus meets a few dozen widths. Engine on
# the H200: 239.6x vs 229.3x with hift_quantum=1 (bench/results/gpu_h200_ab1.json).
HIFT_FRAME_QUANTUM = 32

# The flow's padded batch goes to HiFT realigned in one gather (MelBatch.left_aligned) where no row
# changes speed, instead of a slice, a transpose and a copy per row: the same values. Measured with
# hift.IN_PLACE_DRAWS (see there): no difference beyond the noise, kept for costing nothing. Bench switch `gather`.
GATHER_TO_HIFT = True

# Segments are tokenized and their LLM input composed as they enter the intake, on the Celery task's
# thread (`CosyVoice2Engine.prepare`), not when the LLM thread takes them: on the H200 the LLM thread
# took 0.16 s to admit a job's first 48 segments and 0.21 s for the next 208, with no decode step
# launched meanwhile (bench/results/gpu_h200_worker19_worker.log), and py-spy found the tokenizer in
# 8-10% of its samples at a job's start (bench/results/diagnostics/). Worker on an H100, tasks of 16:
# the LLM thread's admission 19 and 30 ms a job with it vs 73 ms without, and the rate the same within
# the noise, 302.7x / 291.2x with vs 293.4x without (bench/results/gpu_h100_worker20.json). Bench switch `prepare`.
PREPARE_AT_ENQUEUE = True

# A task's segments are prepared together (`prepare_many`): their texts tokenized in one `encode_batch`,
# which lets go of the GIL, where one `encode` a segment holds it (~120 us for a 300-character segment
# on a 2-core AMD EPYC). Why: at a job's start its tasks come in together while the LLM thread places its
# first rows, and the LLM thread's first placement took 146 ms of wall time for 28 ms of its own CPU
# (bench/results/gpu_h100_s45a_worker.json, timeline). Off: one `prepare` a segment. Bench switch `together`.
PREPARE_TOGETHER = True

# A batch's audio rows are copied out of its pinned staging buffer (`HostCopy`), which then goes back to
# torch's pinned-memory cache at once, instead of each row going on as a view of it. Why: a view keeps
# the whole buffer pinned until the batch's last row is stored, so while uploads were pending each new
# batch found no free block of its size and pinned a new one (cudaHostAlloc, a page-locking driver call
# of up to 256 MB): 13 such calls in a job, 158 ms in all, one of 98 ms, with the vocoder thread held in
# its launch meanwhile (timeline `pinned_alloc`, bench/results/gpu_h100_s45b.json, tasks of 16). The
# copy is a memcpy of the batch's audio on the host. Off: slower. Worker on an H100, tasks of 16, A B A B A:
# 325.7x / 329.3x with vs 325.8x / 334.4x / 335.7x without (B/A 0.987), 12 and 4 pinned allocations a job
# against 9, 8 and 15: not fewer beyond the spread (bench/results/gpu_h100_s45c.json). Bench switch `rows_copied`.
ROWS_COPIED = False

# HiFT runs a batch in parts of at most this many rows x padded mel frames (0: the batch whole). Why:
# HiFT's activations are fp32 at 6,000 frames a second of audio x 64 channels at its last stage, so a
# 128-row batch of 15 s rows holds tensors of ~3 GB each there, and the worker's device memory (nvidia-smi,
# every process) reached 62-79 GiB of an 80 GB H100 over a job (bench/results/gpu_h100_s45c.json,
# gpu_h100_s45d.json); a flush of the allocator's cache (103 frees, each a wait for the whole device)
# came with the slowest job of gpu_h100_s45b.json. Parts run one after the other on the thread's stream,
# so the caching allocator hands one part's blocks to the next. Rows are independent in HiFT and each
# keeps its own generator, so a row's audio is what any batch gives it (a smaller batch's kernels round
# otherwise: within the engine tests' batch bounds). Worker on an H100, tasks of 16, A B1 B2 A: 32768
# 331.1x vs 329.7x / 328.8x without (B/A 1.006, ahead of both), the card's memory at most 58.6 GiB vs
# 66.3 / 70.5 GiB; 16384 327.3x (0.994), 51.2 GiB (bench/results/gpu_h100_s45e.json). A batch of the
# bench corpus' typical rows (128 x ~350 frames) runs in two parts. Bench switch `hift_frames`.
HIFT_FRAMES_PER_CALL = 32768


def hift_parts(rows: int, frames: int, budget: int | None = None) -> list[tuple[int, int]]:
    """[start, end) row ranges of a (rows, 80, frames) HiFT batch: as few parts as keep rows x frames
    within `budget` (None: HIFT_FRAMES_PER_CALL; 0: one part), of near-equal row counts, one row at least."""
    budget = HIFT_FRAMES_PER_CALL if budget is None else budget
    if budget <= 0 or rows <= 1:
        return [(0, rows)]
    n = max(1, min(rows, -(-rows * frames // budget)))  # ceil: the fewest parts within the budget (a row at least)
    cuts = [rows * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


FLOW_ROWS_MAX = 128  # the fastest flow + HiFT batch measured on an H200 (128 over 64: bench/results/h200_probe1.json)


def flow_rows(llm_rows: int) -> int:
    """Rows of one flow + HiFT batch when the settings leave it to the engine: half the LLM's rows,
    at most FLOW_ROWS_MAX. Half, so finished sequences fill a bucket while the other half decodes,
    and so a GPU with fewer rows (less memory) also gets smaller flow activations."""
    return max(1, min(FLOW_ROWS_MAX, llm_rows // 2))


@dataclass(frozen=True, eq=False)
class PreparedVoice:
    """A voice profile as the engine uses it: text ids for the LLM, tensors on the flow device."""

    name: str
    prompt_text_tokens: list[int]  # (T_ptext,) Qwen ids of the transcript
    prompt_speech_tokens: list[int]  # (T_p,) speech tokens of the prompt
    flow_tokens: torch.Tensor  # (T_p,) long
    prompt_mel: torch.Tensor  # (T_pm, 80) fp32, T_pm = 2 T_p
    embedding: torch.Tensor  # (192,) fp32


class VoiceCache:
    """LRU of prepared voices; a miss loads the profile through `load` (storage) once. Entries expire
    after `ttl_s` (the same window as the reuse digests), so a voice re-created under its name is
    not rendered from its old profile while the cache key already names the new one."""

    def __init__(self, load: Callable[[str], VoiceProfile], prepare: Callable[[VoiceProfile], PreparedVoice],
                 size: int = 32, ttl_s: float = VOICE_TTL_S):
        self._load, self._prepare, self._size, self._ttl_s = load, prepare, size, ttl_s
        self._voices: OrderedDict[str, tuple[PreparedVoice, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> PreparedVoice:
        now = time.monotonic()
        with self._lock:
            hit = self._voices.get(name)
            if hit is not None and now - hit[1] < self._ttl_s:
                self._voices.move_to_end(name)
                return hit[0]
        voice = self._prepare(self._load(name))
        with self._lock:
            self._voices[name] = (voice, now)
            self._voices.move_to_end(name)
            while len(self._voices) > self._size:
                self._voices.popitem(last=False)
        return voice


@dataclass(frozen=True, eq=False)
class _Prepared:
    """`CosyVoice2Engine.prepare`'s work, kept on the request: the LLM input as composed for `voice`."""

    voice: PreparedVoice
    llm: LlmRequest


@dataclass
class _Item:
    """One request on its way through the engine."""

    request: SynthesisRequest
    voice: PreparedVoice
    llm: LlmRequest
    tokens: list[int] | None = None  # speech tokens once the LLM is done with it


def _pad(rows: list[torch.Tensor], lengths: list[int], quantum: int = 1) -> torch.Tensor:
    """Right-pad (T_i, ...) tensors into (B, max T rounded up to `quantum`, ...) with zeros (B=1, T=0
    rows give width 0)."""
    width = -(-max(lengths) // quantum) * quantum if lengths else 0
    out = rows[0].new_zeros((len(rows), width, *rows[0].shape[1:]))
    for i, (row, n) in enumerate(zip(rows, lengths)):
        out[i, :n] = row[:n]
    return out


def _voice_batch(voices: list[PreparedVoice]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The voices' flow prompts as padded batches: tokens (B, T_p), mel (B, T_pm, 80), embedding
    (B, 192). One voice for the whole batch (the usual case) is broadcast, not copied row by row."""
    first = voices[0]
    if all(v is first for v in voices):
        B = len(voices)
        return (first.flow_tokens[None].expand(B, -1), first.prompt_mel[None].expand(B, -1, -1),
                first.embedding[None].expand(B, -1))
    pad = torch.nn.utils.rnn.pad_sequence
    return (pad([v.flow_tokens for v in voices], batch_first=True), pad([v.prompt_mel for v in voices], batch_first=True),
            torch.stack([v.embedding for v in voices]))


def time_scale(mel: torch.Tensor, speed: float) -> torch.Tensor:
    """(80, T_mel) -> (80, int(T_mel / speed)) by linear interpolation (speed > 1 is faster speech)."""
    if speed == 1.0:
        return mel
    frames = max(int(mel.shape[1] / speed), 1)
    return F.interpolate(mel[None], size=frames, mode="linear")[0]


class HostCopy:
    """A device tensor's copy to pinned host memory, queued on the current stream: `numpy()` waits for
    it (and so for this stream's work before it: flow/HiFT), never for the LLM decoding on another.
    Queued and waited for apart, a vocoder thread can queue its next batch in between
    (streaming.VOCODER_LOOKAHEAD)."""

    def __init__(self, t: torch.Tensor):
        self.ready: torch.cuda.Event | None = None
        self.pinned = t.device.type == "cuda"  # staged in pinned memory (else `host` is the tensor itself)
        if not self.pinned:
            self.host: torch.Tensor | None = t
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(t.device))

    def numpy(self) -> np.ndarray:
        if self.host is None:
            raise RuntimeError("this copy's host buffer was already released")
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.numpy()

    def release(self) -> None:
        """Drop the host buffer: a pinned one goes back to torch's pinned cache once no array views it."""
        self.host = None


class VocodedBatch:
    """A flow/HiFT batch whose GPU work is all queued (`CosyVoice2Engine.vocode_launch`); `results()`
    waits for its audio to reach the host and cuts it into its rows."""

    def __init__(self, items: list, wav: HostCopy, mel_lens: list[int], samples_per_frame: int):
        self.items, self.wav, self.mel_lens, self.spf = items, wav, mel_lens, samples_per_frame

    def arrays(self) -> list[np.ndarray]:
        """Each row's samples, once: with ROWS_COPIED a pinned staging buffer is copied out of and released."""
        wav = self.wav.numpy()
        if not (ROWS_COPIED and self.wav.pinned):
            return [np.ascontiguousarray(wav[i, : n * self.spf]) for i, n in enumerate(self.mel_lens)]
        rows = [wav[i, : n * self.spf].copy() for i, n in enumerate(self.mel_lens)]
        del wav
        self.wav.release()
        return rows

    def results(self) -> list[SynthesisResult]:
        return [SynthesisResult(item.request, audio) for item, audio in zip(self.items, self.arrays())]


_cudnn_lock = threading.Lock()
_cudnn_users = 0  # vocoder calls inside deterministic_cudnn now
_cudnn_before = False  # the flag before the first of them set it


@contextlib.contextmanager
def deterministic_cudnn() -> Iterator[None]:
    """cuDNN limited to deterministic algorithms while flow and HiFT run, restored after.

    HiFT's transposed convolutions run cuDNN backward-data kernels, some of which accumulate with
    atomics: on an H200 the same mel and seed gave different audio run to run (the LLM and flow were
    bit-stable). The flag is process-wide while set, so it is set only around vocoder calls, on the
    threads that run flow and HiFT (the LLM's attention and matmuls do not use cuDNN), never for the
    whole process from a constructor. Calls may overlap (streaming.VOCODER_THREADS): the first sets
    it, the last one out restores it. It covers the flow too: with two vocoder threads one thread's
    flow convolutions would otherwise run with or without it depending on the other's timing."""
    global _cudnn_users, _cudnn_before
    with _cudnn_lock:
        if _cudnn_users == 0:
            _cudnn_before = torch.backends.cudnn.deterministic
            torch.backends.cudnn.deterministic = True
        _cudnn_users += 1
    try:
        yield
    finally:
        with _cudnn_lock:
            _cudnn_users -= 1
            if _cudnn_users == 0:
                torch.backends.cudnn.deterministic = _cudnn_before


class CosyVoice2Engine(Engine):
    name = "cosyvoice2"

    def __init__(
        self,
        tokenizer: CosyVoice2Tokenizer,
        llm: LlmBackend,
        flow: CausalFlow,
        hift: HiFTGenerator,
        load_voice: Callable[[str], VoiceProfile],
        speech_token_size: int,
        max_batch: int = 64,  # requests `synthesize` takes at once (the LLM decodes them together)
        flow_batch: int = 16,  # most rows in one flow + HiFT batch
        voice_cache_size: int = 32,
        forced_lengths: bool = False,  # benchmark only (Settings.engine_forced_lengths)
        vocoder_threads: int | None = None,  # flow/HiFT threads of `serve`; None: streaming picks by device
    ):
        self.tokenizer, self.llm, self.flow, self.hift = tokenizer, llm, flow, hift
        self.max_batch, self.flow_batch, self.vocoder_threads = max_batch, flow_batch, vocoder_threads
        self.forced_lengths = forced_lengths
        self.speech_token_size = speech_token_size
        self.sample_rate = hift.d.sampling_rate
        self.samples_per_token = flow.dims.token_mel_ratio * hift.d.samples_per_frame  # 960 at 24 kHz
        self.end_of_prompt = tokenizer.token_id(END_OF_PROMPT)
        self.voices = VoiceCache(load_voice, self.prepare_voice, voice_cache_size)
        # Set by from_model_dir: the model's files and placement make up the fingerprint.
        self.model_dir: Path | None = None
        self.placement: Placement | None = None
        self._fingerprint: str | None = None

    # -- building ----------------------------------------------------------------------------------

    @classmethod
    def from_settings(cls, settings: Settings) -> CosyVoice2Engine:
        """Resolve the model dir (or download), load all parts on their devices, voices from storage."""
        from voxbatch.storage import open_storage
        from voxbatch.voice import load_voice

        model_dir = resolve_model_dir(settings.model_dir)
        storage = open_storage(settings)
        with loading_within(settings.engine_gpu_memory_gib):
            return cls.from_model_dir(
                model_dir,
                load_voice=lambda name: load_voice(storage, name),
                placement=Placement.from_settings(settings),
                llm_backend=settings.llm_backend,
                max_batch=settings.engine_max_batch,  # None: llm_rows picks
                flow_batch=settings.engine_flow_batch,  # None: flow_rows picks
                settings=settings.model_copy(update={"model_dir": str(model_dir)}),
            )

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        load_voice: Callable[[str], VoiceProfile],
        placement: Placement | None = None,
        llm_backend: str = "torch",
        max_batch: int | None = None,  # LLM rows; None: `llm_rows` picks for the placement
        flow_batch: int | None = None,  # rows of one flow + HiFT batch; None: `flow_rows` of the LLM's rows
        settings: Settings | None = None,  # the vllm backend reads its options from settings
    ) -> CosyVoice2Engine:
        from voxbatch.worker.cosyvoice2.llm import LlmDims
        from voxbatch.worker.cosyvoice2.torch_backend import MAX_SEQ

        model_dir = resolve_model_dir(model_dir)
        p = placement or Placement.from_settings(Settings(model_dir=str(model_dir)))
        tokenizer = CosyVoice2Tokenizer.from_model_dir(model_dir)
        dims = LlmDims.from_model_dir(model_dir)
        if llm_backend not in ("torch", "vllm"):
            raise ValueError(f"unknown llm_backend {llm_backend!r} (torch or vllm)")
        free = cap_gpu_memory(p, settings.engine_gpu_memory_gib if settings is not None else None)
        if max_batch is None:
            max_batch = llm_rows(p, dims.kv_cache_bytes(1, MAX_SEQ, p.llm_dtype) if llm_backend == "torch" else None, free)
        if flow_batch is None:
            flow_batch = flow_rows(max_batch)
        if llm_backend == "torch":
            from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

            llm: LlmBackend = TorchLlmBackend.from_model_dir(model_dir, device=p.llm_device, dtype=p.llm_dtype, max_batch=max_batch)
        else:
            from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend

            base = settings or Settings(model_dir=str(model_dir))
            llm = VllmLlmBackend.from_settings(base.model_copy(update={"engine_max_batch": max_batch}))
        flow = CausalFlow.from_model_dir(model_dir, device=p.flow_device, dtype=p.flow_dtype)
        hift = HiFTGenerator.from_model_dir(model_dir, device=p.hift_device, dtype=p.hift_dtype)
        log.info("cosyvoice2 engine: %s; llm=%s on %s (%d rows), flow on %s, hift on %s", model_dir, llm.name, p.llm_device,
                 max_batch, p.flow_device, p.hift_device)
        engine = cls(tokenizer, llm, flow, hift, load_voice, dims.speech_token_size, max_batch=max_batch, flow_batch=flow_batch,
                     forced_lengths=bool(settings is not None and settings.engine_forced_lengths),
                     vocoder_threads=settings.engine_vocoder_threads if settings is not None else None)
        engine.model_dir = Path(model_dir)
        engine.placement = p
        return engine

    def fingerprint(self) -> str:
        """Model files plus what changes the numbers (LLM backend, dtypes): a segment rendered in bf16
        is not reused for an fp32 worker. Hashing the files takes seconds, so it is done once."""
        if self._fingerprint is None:
            from voxbatch.model_files import model_digest

            digest = model_digest(self.model_dir) if self.model_dir is not None else f"unsaved-{id(self)}"
            p = self.placement
            dtypes = "/".join(str(d) for d in (p.llm_dtype, p.flow_dtype, p.hift_dtype)) if p else "?"
            forced = "/forced-lengths" if self.forced_lengths else ""  # benchmark audio never mixes with real
            self._fingerprint = f"cosyvoice2/{digest}/{self.llm.name}/{dtypes}{forced}"
        return self._fingerprint

    # -- voices ------------------------------------------------------------------------------------

    def prepare_voice(self, profile: VoiceProfile) -> PreparedVoice:
        tokens = profile.prompt_speech_tokens.astype(np.int64)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.speech_token_size):
            raise ValueError(
                f"voice {profile.name!r}: speech token {int(tokens.max())} outside this model's {self.speech_token_size} "
                "tokens (made with another model? re-create it with `voxbatch voice add`)"
            )
        if profile.sample_rate != self.sample_rate:
            raise ValueError(f"voice {profile.name!r}: prompt mel at {profile.sample_rate} Hz, the model runs at {self.sample_rate} Hz")
        device = self.flow.encoder_proj.weight.device
        return PreparedVoice(
            name=profile.name,
            prompt_text_tokens=self.tokenizer.encode(profile.prompt_text) if profile.prompt_text else [],
            prompt_speech_tokens=tokens.tolist(),
            flow_tokens=torch.from_numpy(tokens).to(device),
            prompt_mel=torch.from_numpy(profile.prompt_mel).to(device),
            embedding=torch.from_numpy(profile.speaker_embedding).to(device),
        )

    def empty_voice(self) -> PreparedVoice:
        """No prompt at all (warm-up, or speech with the model's own default speaker)."""
        device = self.flow.encoder_proj.weight.device
        return PreparedVoice(
            name="",
            prompt_text_tokens=[],
            prompt_speech_tokens=[],
            flow_tokens=torch.zeros(0, dtype=torch.long, device=device),
            prompt_mel=torch.zeros(0, 80, device=device),
            embedding=torch.zeros(192, device=device),
        )

    # -- the LLM request of one segment -------------------------------------------------------------

    def llm_request(self, request: SynthesisRequest, voice: PreparedVoice, text: list[int] | None = None) -> LlmRequest:
        """Tokenize (unless `text`: the request's text, tokenized already) and compose the LLM input for
        the request's mode; length bounds from the text."""
        p: SynthesisParams = request.params
        if text is None:
            text = self.tokenizer.encode(request.text)
        if not text:
            raise ValueError("text has no tokens")
        if p.mode == "zero_shot":
            prefix, prompt_speech = voice.prompt_text_tokens, voice.prompt_speech_tokens
        elif p.mode == "cross_lingual":
            prefix, prompt_speech = [], []
        elif p.mode == "instruct2":
            instruct = p.instruct_text or ""
            if END_OF_PROMPT not in instruct:
                instruct += END_OF_PROMPT
            prefix, prompt_speech = self.tokenizer.encode(instruct), []
        else:
            raise ValueError(f"unknown mode {p.mode!r}")
        max_tokens = MAX_TOKENS_PER_TEXT_TOKEN * len(text)
        if self.forced_lengths:
            max_tokens = forced_speech_tokens(request.text)
        if p.max_tokens is not None:
            max_tokens = min(max_tokens, p.max_tokens)
        # The one place max_tokens meets the backend's capacity: `max_seq` is the torch backend's KV
        # cache length and the vllm backend's max_model_len; either rejects a request past it.
        max_seq = self.llm.max_seq
        prompt_len = len(prefix) + len(text) + len(prompt_speech) + 2  # sos + text + task_id + speech
        if prompt_len + max_tokens > max_seq:
            if prompt_len >= max_seq:
                raise ValueError(f"prompt of {prompt_len} tokens does not fit the LLM's {max_seq} positions")
            max_tokens = max_seq - prompt_len
        return LlmRequest(
            text_tokens=list(prefix) + text,
            prompt_speech_tokens=list(prompt_speech),
            min_tokens=max_tokens if self.forced_lengths else min(MIN_TOKENS_PER_TEXT_TOKEN * len(text), max_tokens),
            max_tokens=max_tokens,
            seed=request.seed,
            top_p=p.top_p,
            top_k=p.top_k,
            win_size=p.win_size,
            tau_r=p.tau_r,
        )

    # -- synthesis ---------------------------------------------------------------------------------

    def warmup(self) -> None:
        """One short request with no voice prompt (no stored voice needed) through every part; then the
        LLM backend's own warm-up (the torch backend captures its CUDA graphs for every row count), so
        no task pays for it."""
        request = SynthesisRequest("warmup", WARMUP_TEXT, "", 0, SynthesisParams(max_tokens=50))
        voice = self.empty_voice()
        for result in self._run([_Item(request, voice, self.llm_request(request, voice))]):
            if result.error:
                raise RuntimeError(f"cosyvoice2 warm-up failed: {result.error}")
        self.warm_graphs()

    def warm_graphs(self) -> None:
        self.llm.warmup()

    def close(self) -> None:
        self.llm.close()

    def serve(self, intake, emit, stop, observe=None, admit=None) -> None:
        """The worker's loop: one streaming scheduler (streaming.py) over the LLM backend's continuous
        batching and flow/HiFT threads on their own CUDA streams; the Pipeline contract of `Engine.serve`."""
        StreamingScheduler(self, intake, emit, stop, observe, admit).run()

    def prepare(self, request: SynthesisRequest) -> SynthesisRequest:
        """The request with its LLM input composed (`Engine.prepare`: on the task's thread, so the LLM
        thread only takes it). Raises what `item` would (a missing voice, an empty text): the caller
        queues the request unprepared and the LLM thread fails that segment in `item`, as before."""
        if not PREPARE_AT_ENQUEUE:
            return request
        voice = self.voices.get(request.voice)
        return replace(request, prepared=_Prepared(voice, self.llm_request(request, voice)))

    def prepare_many(self, requests: list[SynthesisRequest]) -> list[SynthesisRequest]:
        """`prepare` of a task's requests, their texts tokenized in one call (`encode_many`), which lets
        go of the GIL the LLM thread needs for its first placements while a job's tasks come in."""
        if not PREPARE_TOGETHER:
            return super().prepare_many(requests)
        if not PREPARE_AT_ENQUEUE or not requests:
            return list(requests)
        texts = self.tokenizer.encode_many([r.text for r in requests])
        by_name: dict[str, PreparedVoice | None] = {}  # each voice looked up once (None: it cannot be had now)
        out = []
        for request, text in zip(requests, texts):
            if request.voice not in by_name:
                try:
                    by_name[request.voice] = self.voices.get(request.voice)
                except Exception:  # noqa: BLE001 - see Engine.prepare: the LLM thread meets it again and reports it
                    by_name[request.voice] = None
            voice = by_name[request.voice]
            try:
                out.append(request if voice is None else replace(request, prepared=_Prepared(voice, self.llm_request(request, voice, text))))
            except Exception:  # noqa: BLE001 - as above (an empty text, a prompt too long)
                out.append(request)
        return out

    def item(self, request: SynthesisRequest) -> _Item:
        """A request made ready for the LLM (voice prepared, input composed); raises LookupError or
        ValueError for a missing/bad voice or text, which fails that segment only. What `prepare`
        made is used while its voice is still the one the cache holds under that name."""
        voice = self.voices.get(request.voice)
        prepared = request.prepared
        if isinstance(prepared, _Prepared) and prepared.voice is voice:
            return _Item(request, voice, prepared.llm)
        return _Item(request, voice, self.llm_request(request, voice))

    def synthesize(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        items: list[_Item] = []
        for request in batch:
            try:
                items.append(self.item(request))
            except (LookupError, ValueError) as e:  # a missing/bad voice or text fails that segment only
                yield SynthesisResult(request, None, f"{type(e).__name__}: {e}")
        yield from self._run(items)

    def _run(self, items: list[_Item]) -> Iterator[SynthesisResult]:
        if not items:
            return
        buckets: dict[int, list[_Item]] = {}
        for result in self.llm.generate([item.llm for item in items]):
            item = items[result.index]
            if not result.tokens:
                yield SynthesisResult(item.request, None, "the LLM stopped before any speech token")
                continue
            item.tokens = result.tokens
            bucket = buckets.setdefault(length_bucket(len(result.tokens)), [])
            bucket.append(item)
            if len(bucket) >= self.flow_batch:
                yield from self.vocode(buckets.pop(length_bucket(len(result.tokens))))
        for key in sorted(buckets, reverse=True):
            yield from self.vocode(buckets[key])

    def vocode(self, items: list[_Item], queued: Callable[[], None] | None = None) -> Iterator[SynthesisResult]:
        """Finished speech tokens -> audio: one flow batch, per-row speed, one HiFT batch; `queued` is
        called once all of the batch's GPU work is queued, before the copy to the host waits for it."""
        yield from self.vocode_launch(items, queued).results()

    def vocode_begin(self, items: list[_Item]) -> PendingMel:
        """`vocode_launch`'s flow up to the ODE's steps (the encoder queued, the step graph captured);
        `finish()` on it queues the steps, and `vocode_launch(items, begun=it)` the rest. A vocoder
        thread begins its next batch here while its current batch's steps run (VOCODER_PIPELINE)."""
        started = time.perf_counter()
        with deterministic_cudnn():
            pending = self.mel_batch([item.tokens or [] for item in items], [item.voice for item in items], ahead=True)
        timeline.event("vocode_begin_ms", round(1000 * (time.perf_counter() - started)))
        return pending

    def vocode_launch(self, items: list[_Item], queued: Callable[[], None] | None = None,
                      begun: PendingMel | None = None) -> VocodedBatch:
        """`vocode` up to the copy to the host: every GPU call of the batch queued on the current
        stream, nothing waited for; the returned batch's `results()` waits. `begun`: the batch's
        `vocode_begin`, its steps queued or not yet."""
        started = time.perf_counter()
        then = queued

        def queued() -> None:  # every GPU call of the batch is queued; the host copy waits for them next
            timeline.event("vocode_host_ms", round(1000 * (time.perf_counter() - started)))
            if then is not None:
                then()

        speeds = [item.request.params.speed for item in items]
        seeds = [item.request.seed for item in items]
        with deterministic_cudnn():
            if begun is None:
                batch = self.mel_batch([item.tokens or [] for item in items], [item.voice for item in items])
            else:
                batch = begun.finish()
            timeline.event("vocode_flow_host_ms", round(1000 * (time.perf_counter() - started)))  # the flow's part queued
            if GATHER_TO_HIFT and all(s == 1.0 for s in speeds):  # the flow's batch to HiFT, realigned in one gather
                mel, mel_lens = batch.left_aligned(HIFT_FRAME_QUANTUM, self.hift.conv_pre.weight.device)
            else:
                mel, mel_lens = self._scaled(batch.rows(), speeds)
            wav = self._waves_launch(mel, mel_lens, seeds, queued)
        return VocodedBatch(items, wav, mel_lens, self.hift.d.samples_per_frame)

    def mels(self, tokens: list[list[int]], voices: list[PreparedVoice]) -> list[torch.Tensor]:
        """One flow batch: B token sequences (each with its voice) -> B mels (80, T_mel_i), on the flow device."""
        return self.mel_batch(tokens, voices).rows()

    def mel_batch(self, tokens: list[list[int]], voices: list[PreparedVoice], ahead: bool = False) -> MelBatch | PendingMel:
        """`mels` as the flow leaves them: one padded batch (B, 80, T) with each row's frames (`ahead`:
        up to the ODE's steps, `CausalFlow.inference_batch`)."""
        flow_dev = self.flow.encoder_proj.weight.device
        tok_lens = [len(t) for t in tokens]
        tok = np.zeros((len(tokens), max(tok_lens, default=0)), dtype=np.int64)  # (B, T_tok), built without torch calls
        for i, t in enumerate(tokens):
            tok[i, : len(t)] = t
        p_lens = [v.flow_tokens.shape[0] for v in voices]
        pm_lens = [v.prompt_mel.shape[0] for v in voices]
        prompt_tok, prompt_mel, embedding = _voice_batch(voices)  # (B, T_p), (B, T_pm, 80), (B, 192)
        with torch.inference_mode():  # lengths as host lists: the flow call waits on nothing queued on the GPU
            return self.flow.inference_batch(to_device(tok, torch.long, flow_dev), tok_lens, prompt_tok, p_lens,
                                             prompt_mel, pm_lens, embedding, ahead=ahead)

    def waves(self, mels: list[torch.Tensor], speeds: list[float], seeds: list[int],
              queued: Callable[[], None] | None = None) -> list[np.ndarray]:
        """One HiFT batch: B mels -> B waveforms on the host (per-row speed, per-row noise seed);
        `queued` is called once HiFT's GPU work is queued, before the copy to the host waits for it."""
        mel, mel_lens = self._scaled(mels, speeds)
        wav = self._waves_launch(mel, mel_lens, seeds, queued)
        return VocodedBatch([], wav, mel_lens, self.hift.d.samples_per_frame).arrays()

    def _scaled(self, mels: list[torch.Tensor], speeds: list[float]) -> tuple[torch.Tensor, list[int]]:
        """B mels (80, T_i), each time-scaled by its speed, as one padded batch (B, 80, T_mel) on
        HiFT's device with the rows' lengths."""
        hift_dev = self.hift.conv_pre.weight.device
        with torch.inference_mode():
            mels = [time_scale(m, s).to(hift_dev) for m, s in zip(mels, speeds)]
            mel_lens = [m.shape[1] for m in mels]
            return _pad([m.transpose(0, 1) for m in mels], mel_lens, HIFT_FRAME_QUANTUM).transpose(1, 2), mel_lens

    def _waves_launch(self, mel: torch.Tensor, mel_lens: list[int], seeds: list[int],
                      queued: Callable[[], None] | None = None) -> HostCopy:
        """HiFT over a padded batch (B, 80, T_mel) on its device, rows' lengths on the host: the
        waveforms (B, T_wav) fp32 on their way to the host, nothing waited for."""
        with torch.inference_mode():
            generators = [torch.Generator(device=mel.device).manual_seed(s) for s in seeds]
            parts = [self.hift.inference(mel[a:b], mel_lens[a:b], generators[a:b])[0]  # (b - a, T_wav); host lengths: no sync
                     for a, b in hift_parts(len(mel_lens), mel.shape[2])]
            wav = (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
            if queued is not None:
                queued()
            return HostCopy(wav)
