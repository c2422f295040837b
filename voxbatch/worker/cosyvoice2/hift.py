"""HiFT vocoder (CosyVoice2's `HiFTGenerator`): mel -> F0 -> harmonic source -> iSTFTNet waveform.

Reads top-down like the model: dimensions, then the F0 predictor, the NSF harmonic source, the
residual blocks, the generator (`decode`: mel + source -> waveform) and `inference` (all of it).
State-dict compatible with the official `hift.pt`; weight norm is folded into plain weights at load
(inference never needs g and v apart).

Batching: B mels of different lengths are right-padded to T_mel and carried with their lengths.
Every convolution sees zeros past a row's end, exactly as it would running alone, because the padded
region is zeroed after every layer; the STFT of the source and the iSTFT of the output are done per
row's own length (reflect padding at the row's real end, window envelope of its real frames). So a
batched row equals the same mel decoded alone.

Precision: the generator may run in bf16/fp16 (`load_hift(..., dtype=)`); the F0 predictor, the
F0 -> phase integration, the source and the STFT/iSTFT stay fp32, since the phase is a running sum
over every sample. F0 and the source phase are computed row by row (see `f0`, `SourceModule`), the
rest of the source with elementwise ops only (batched on CUDA), so a row's source does not depend on
its batch mates. On CUDA each masked conv's bias, mask and residual add are one Triton pass
(`masked_conv`, bit-identical), and cuDNN's default TF32 convolutions move fp32 output by ~1%: turn
TF32 off for parity checks.

Shapes: B batch, T_mel mel frames, T_wav = T_mel * 480 samples (24 kHz), T_spec = T_wav / hop + 1.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from voxbatch.worker.cosyvoice2 import cuda_graphs
from voxbatch.worker.cosyvoice2.conv_epilogue import conv_epilogue
from voxbatch.worker.cosyvoice2.derived import DerivedWeight
from voxbatch.worker.cosyvoice2.h2d import host_lengths, split_lengths, to_device
from voxbatch.worker.cosyvoice2.lazy_kernel import channels_last, interpreting
from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError, check_keys, empty_init, load_state_dict, read_config, section
from voxbatch.worker.engine import is_out_of_memory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiftDims:
    """Hyperparameters of the yaml `hift` section (defaults are the CosyVoice2-0.5B values)."""

    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1  # sine amplitude
    nsf_sigma: float = 0.003  # noise std in voiced regions
    nsf_voiced_threshold: float = 10.0  # Hz; below it a sample is unvoiced
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    n_fft: int = 16
    hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512
    f0_num_class: int = 1

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz): the upsampling times the iSTFT hop."""
        return math.prod(self.upsample_rates) * self.hop_len

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> HiftDims:
        h = section(config, "hift")
        f0 = section(config, "hift", "f0_predictor")
        istft = section(config, "hift", "istft_params")
        return cls(
            in_channels=int(h["in_channels"]),
            base_channels=int(h["base_channels"]),
            nb_harmonics=int(h["nb_harmonics"]),
            sampling_rate=int(h["sampling_rate"]),
            nsf_alpha=float(h["nsf_alpha"]),
            nsf_sigma=float(h["nsf_sigma"]),
            nsf_voiced_threshold=float(h["nsf_voiced_threshold"]),
            upsample_rates=tuple(int(u) for u in h["upsample_rates"]),
            upsample_kernel_sizes=tuple(int(k) for k in h["upsample_kernel_sizes"]),
            n_fft=int(istft["n_fft"]),
            hop_len=int(istft["hop_len"]),
            resblock_kernel_sizes=tuple(int(k) for k in h["resblock_kernel_sizes"]),
            resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in h["resblock_dilation_sizes"]),
            source_resblock_kernel_sizes=tuple(int(k) for k in h["source_resblock_kernel_sizes"]),
            source_resblock_dilation_sizes=tuple(
                tuple(int(d) for d in ds) for ds in h["source_resblock_dilation_sizes"]
            ),
            lrelu_slope=float(h["lrelu_slope"]),
            audio_limit=float(h["audio_limit"]),
            f0_cond_channels=int(f0["cond_channels"]),
            f0_num_class=int(f0.get("num_class", 1)),
        )


def length_mask(lengths: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """(B,) valid lengths -> (B, 1, max_len) mask, 1 inside a row, 0 in its padding."""
    steps = torch.arange(max_len, device=lengths.device)
    return (steps[None, :] < lengths[:, None]).to(dtype)[:, None, :]


# ---------------------------------------------------------------------------------------------
# F0 predictor: 5 convolutions (k=3) with ELU, a linear classifier, |.| -> Hz per mel frame.
# ---------------------------------------------------------------------------------------------


# HiFT.f0 runs each row zero-padded to a multiple of this many frames (1: at its own length). Why: the
# row loop calls the predictor's 5 convolutions per row, and cuDNN builds an execution plan for each
# convolution shape it has not met (PyTorch caches them per exact shape). At each row's own length
# nearly every row meets new shapes: in a B=128 HiFT batch 717 convolution calls took 246 ms of host
# time (343 us each) against 433 ms of GPU time for the whole batch (bench/results/
# gpu_h200_worker12b_profile.txt), and at a job's end, with the LLM done, batches of 11-40 rows took
# ~1 s each with the GPU at 12-44% (gpu_h200_worker19.json). At a multiple of 32 frames (HiFT batches'
# own quantum, engine.HIFT_FRAME_QUANTUM, so a row alone and in a batch run the same shape) a corpus
# meets a few dozen widths. Off: no faster. Worker on an H100, tasks of 16: 292.8x at 32 vs 302.7x /
# 291.2x at 1 (B/A 0.986; bench/results/gpu_h100_worker20.json). In `voxbatch render` py-spy found the
# F0 convolutions in ~1.5 s of a vocoder thread's samples (diagnostics/gpu_h100_render2_pyspy.txt),
# but they are HiFT's first launches after the flow's graph replays, so they are where the thread
# waits for the launch queue, not plan building. Bench switch `f0_quantum`.
F0_FRAME_QUANTUM = 1
# On CUDA, each row's F0 as a CUDA graph kept per padded width (rows zero-padded to a multiple of
# F0_GRAPH_QUANTUM frames, masked as F0_FRAME_QUANTUM pads them): a row costs its copy in, the replay and
# its copy out, instead of the predictor's ~20 op calls (5 cuDNN convolutions at ~340 us of host time
# each in gpu_h200_worker12b_profile.txt). Why it might pay: the GPU's dips in a job's vocoder-only
# tail sit where batches end, i.e. in HiFT, whose row-by-row F0 launches tiny kernels slower than the
# GPU runs them; when both vocoder threads are there at once (batches ending together), the GPU waits
# on their launches (bench/results/gpu_h200_worker23.json, A's raw utilisation against its log: 62% and
# 56% as a 74- and a 63-row batch ended together, 70% at another end). Each row still runs alone at its
# padded shape, so its F0 is the same bits in any batch (GPU test: graph and eager padded F0 equal).
# A capture that fails is logged once and turns this off. On: the worker on an H100, tasks of 16, A B A B A:
# 294.7x / 301.2x with it vs 295.6x / 290.1x / 290.1x without (B/A 1.021), GPU busy 91.1 / 90.6% vs
# 88.7 / 87.9 / 90.4% (bench/results/gpu_h100_f0graphs1.json; its GPU test passed there,
# gpu_h100_f0graphs1_gpu_tests.txt). Bench switch `f0_graphs`.
F0_ROW_GRAPHS = True
F0_GRAPH_QUANTUM = 32  # frames; the widths a corpus meets (its longest mel / this, ~50), each one graph
# With F0_ROW_GRAPHS, each row's harmonic phase (SourceModule.phase: its frame-rate integration and the
# upsampling to samples, ~12 op calls per row) in the same graph as its F0: it needs only the row's F0
# and its initial phases, so a row costs one more copy in and one out instead of those calls. Past the
# row's end the graph's F0 is zero, so the padded frames add nothing to the running phase and the
# upsampling's last half frame interpolates between two equal values, as it does clamped at the row's
# end: the phase is the eager one's (GPU test, passed on an H100: gpu_h100_phase1_gpu_tests.txt). On: the
# worker on an H100, tasks of 16, A B A B A: 281.5x / 280.8x with it vs 266.9x / 273.0x / 278.4x without
# (B/A 1.031, both B runs above every A; bench/results/gpu_h100_phase1.json). Bench switch `phase_graphs`.
PHASE_IN_ROW_GRAPH = True
# Memory: each (width, phase) graph keeps its outputs, the phase (1, H, width * 480) fp32 being ~17 KB a
# frame: for rows up to 15 s (~750 frames, 24 widths) ~160 MB per vocoder thread and GPU, but growing
# with the square of the longest row (~2.4 GB for rows up to 60 s). So a thread keeps at most
# ROW_GRAPH_BUDGET_BYTES of graph outputs, the least recently used graphs dropped first (their memory
# stays in the thread's graph pool, reused by the next captures).
ROW_GRAPH_BUDGET_BYTES = 512 << 20
_GRAPH_DEVICES = ("cuda",)  # where rows run as graphs (a CPU test opens CPU with an eager stand-in)
_f0_graphs_failed = False
_f0_per_thread = threading.local()  # per (thread, device): capture stream, memory pool, graphs by (width, phase)


class F0Predictor(nn.Module):
    """ConvRNNF0Predictor: mel (B, 80, T_mel) -> F0 in Hz (B, T_mel)."""

    def __init__(self, d: HiftDims):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [nn.Conv1d(d.in_channels if i == 0 else d.f0_cond_channels, d.f0_cond_channels, 3, padding=1)]
            layers += [nn.ELU()]
        self.condnet = nn.ModuleList(layers)  # official indices: convs at 0, 2, 4, 6, 8
        self.classifier = nn.Linear(d.f0_cond_channels, d.f0_num_class)

    def forward(self, mel: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = mel
        for layer in self.condnet:
            x = layer(x)
            if isinstance(layer, nn.Conv1d):
                x = x * mask
        f0 = self.classifier(x.transpose(1, 2)).squeeze(-1).abs()  # (B, T_mel, 1) -> (B, T_mel)
        return f0 * mask[:, 0]


class _LruGraphs:
    """Row graphs by key, at most `budget` bytes of their outputs (`nbytes`), the least recently used
    dropped first; the newest is kept whatever its size."""

    def __init__(self, budget: int):
        self.budget, self.nbytes = budget, 0
        self._graphs: OrderedDict[tuple[int, bool], Any] = OrderedDict()

    def get(self, key: tuple[int, bool]) -> Any:
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
        return g

    def put(self, key: tuple[int, bool], graph: Any) -> None:
        old = self._graphs.pop(key, None)
        self.nbytes += graph.nbytes - (old.nbytes if old is not None else 0)
        self._graphs[key] = graph
        while self.nbytes > self.budget and len(self._graphs) > 1:
            _, dropped = self._graphs.popitem(last=False)
            self.nbytes -= dropped.nbytes

    def __iter__(self):
        return iter(list(self._graphs))  # oldest first


class _RowGraph:
    """One row of `width` frames through HiFT's F0 predictor (and, `with_phase`, the source's harmonic
    phase) as a CUDA graph over buffers of its own: the row's mel goes into `mel` (zeros past its
    length), its length into `length`, its initial phases into `phase0`; `f0` and `phase` are the outputs."""

    def __init__(self, hift: HiFTGenerator, mel: torch.Tensor, width: int, with_phase: bool):
        self.hift = weakref.ref(hift)  # a freed model's graph is not used for another
        self.mel = mel.new_zeros(1, mel.shape[1], width)  # (1, 80, width)
        self.length = torch.zeros((), dtype=torch.long, device=mel.device)
        self.phase0 = torch.zeros(1, hift.d.nb_harmonics + 1, device=mel.device)  # (1, H)
        self.with_phase, self.up = with_phase, hift.d.samples_per_frame
        self.graph: torch.cuda.CUDAGraph | None = None  # captured by get()
        self.f0: torch.Tensor | None = None
        self.phase: torch.Tensor | None = None

    def _run(self, hift: HiFTGenerator) -> tuple[torch.Tensor, torch.Tensor | None]:
        steps = torch.arange(self.mel.shape[2], device=self.mel.device)
        mask = (steps < self.length).to(self.mel.dtype)[None, None, :]  # (1, 1, width)
        f0 = hift.f0_predictor(self.mel, mask)  # (1, width), zero past the row's length
        return f0, hift.m_source.phase(f0, self.phase0) if self.with_phase else None  # (1, H, width * up)

    def _outputs(self, hift: HiFTGenerator) -> None:
        self.f0, self.phase = self._run(hift)

    @property
    def nbytes(self) -> int:
        """What the graph keeps beyond the pool's shared intermediates: its inputs and outputs."""
        return sum(t.nbytes for t in (self.mel, self.phase0, self.f0, self.phase) if t is not None)

    def _replay(self) -> None:
        self.graph.replay()

    @classmethod
    def get(cls, hift: HiFTGenerator, mel: torch.Tensor, width: int, with_phase: bool) -> _RowGraph | None:
        """This thread's graph for `width` frames on mel's device, captured (after one eager run at that
        shape, which builds cuDNN's plans) on first use; None once a capture has failed (logged once)."""
        global _f0_graphs_failed
        slot = getattr(_f0_per_thread, str(mel.device), None)
        if slot is None:
            slot = {"stream": torch.cuda.Stream(mel.device), "pool": torch.cuda.graph_pool_handle(),
                    "graphs": _LruGraphs(ROW_GRAPH_BUDGET_BYTES)}
            setattr(_f0_per_thread, str(mel.device), slot)
        g = slot["graphs"].get((width, with_phase))
        if g is not None and g.hift() is hift:
            return g
        g = cls(hift, mel, width, with_phase)
        try:
            g._run(hift)
            g.graph = torch.cuda.CUDAGraph()
            cuda_graphs.capture(g.graph, slot["stream"], slot["pool"], lambda: g._outputs(hift))
        except Exception as e:  # noqa: BLE001 - the eager F0 still works
            if is_out_of_memory(e):  # this batch is too big for the memory free now, not graphs broken
                raise
            log.warning("F0 CUDA graph unavailable (%s: %s); F0 runs eagerly", type(e).__name__, e)
            _f0_graphs_failed = True
            return None
        with cuda_graphs.registry(mel.device):  # put() may release the oldest graphs
            slot["graphs"].put((width, with_phase), g)
        return g

    def __call__(self, row: torch.Tensor, phase0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """row (1, 80, n), n <= width (and phase0 (1, H) with_phase) -> F0 (1, n) and phase (H, n * up)
        or None, as the eager predictor and phase give them for the row padded to width."""
        n = row.shape[2]
        self.mel[:, :, :n].copy_(row)
        if n < self.mel.shape[2]:
            self.mel[:, :, n:].zero_()
        self.length.fill_(n)
        if self.with_phase:
            self.phase0.copy_(phase0)
        self._replay()
        phase = self.phase[0, :, : n * self.up] if self.with_phase else None
        return self.f0[:, :n], phase


# ---------------------------------------------------------------------------------------------
# NSF harmonic source (SineGen2 + SourceModuleHnNSF2, the 24 kHz variant).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceNoise:
    """The random draws of one source: initial harmonic phases and per-sample noise.

    `phase0` (B, H) uniform in [0, 1) (column 0 is ignored: the fundamental starts at phase 0);
    `noise` (B, T_wav, H) standard normal. H = nb_harmonics + 1.
    """

    phase0: torch.Tensor
    noise: torch.Tensor


def draw_source_noise(
    num_harmonics: int,
    wav_lengths: Sequence[int],
    generators: Sequence[torch.Generator] | None = None,
    device: torch.device | str = "cpu",
) -> SourceNoise:
    """Draw the source noise for B rows, padded to the longest.

    With `generators` (one per row) each row draws `rand(1, H)` then a (1, T_wav_b, H) normal from
    its own generator on that generator's device, so a row's source does not depend on its batch
    mates (on CUDA, CUDA generators are several times faster than CPU ones at B = 32). Without,
    the draws come from the global torch RNG in the official order for the whole batch:
    `rand(B, H)`, a (B, T_wav, H) normal, `randn(B, T_wav, 1)` (the last is the official, unused
    noise branch; drawn only so the RNG state afterwards matches the official code). Normals are
    drawn in the official memory layout (`_normal_time_major`).
    """
    B, T = len(wav_lengths), max(wav_lengths)
    if generators is None:
        phase0 = torch.rand(B, num_harmonics)
        noise = _normal_time_major(B, T, num_harmonics, None, torch.device("cpu"))
        torch.randn(B, T, 1)
        return SourceNoise(phase0.to(device), noise.to(device))
    if len(generators) != B:
        raise ValueError(f"draw_source_noise: {len(generators)} generators for {B} rows")
    phase0 = torch.zeros(B, num_harmonics, device=device)
    noise = torch.zeros(B, num_harmonics, T, device=device).transpose(1, 2)  # (B, T, H) laid out (B, H, T), as drawn
    for b, (n, g) in enumerate(zip(wav_lengths, generators)):
        if IN_PLACE_DRAWS and g.device.type == "cuda" and g.device == phase0.device:
            # Drawn straight into the batch's rows: CUDA's samplers give each element the number of
            # its place in iteration order (time fastest, then harmonic), which a row's view shares
            # with the dense tensor drawn alone, so the numbers are the same (GPU test) in 2 launches
            # instead of 6.
            phase0[b].uniform_(generator=g)
            noise[b, :n].normal_(generator=g)
            continue
        phase0[b] = torch.rand(1, num_harmonics, generator=g, device=g.device)[0].to(device)
        noise[b, :n] = _normal_time_major(1, n, num_harmonics, g, g.device)[0].to(device)
    return SourceNoise(phase0, noise)


def _normal_time_major(B: int, T: int, H: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(B, T, H) standard normal laid out in memory as (B, H, T).

    The official code draws `randn_like` of a transposed tensor; torch fills a non-contiguous tensor
    element by element in memory order with a different sampler than a contiguous `randn`, so only
    this layout reproduces its numbers from the same seed.
    """
    return torch.empty_strided((B, T, H), (H * T, 1, T), device=device).normal_(generator=generator)


# On CUDA the source's sample-rate half (sine, voicing, noise, the harmonic merge, tanh) runs once
# over the padded batch; only the phase (frame-rate integration, upsampling) stays row by row. Row by
# row, each of those ~10 passes over (T_wav, H) was a kernel launch of its own for every row: ~2,000
# fewer launches per 128-row batch, host time the vocoder threads and the LLM thread share (HiFT's
# device time barely moved, 533 -> 531 ms; engine 293.3x vs 276.6x row by row,
# bench/results/gpu_h200_worker9.json). Every op there is elementwise, and the merge over harmonics is
# a fixed chain of multiply-adds, not a matmul whose kernel would depend on the batch's shape, so a
# row's source is bit-identical in any batch.
# Read at every call; False keeps the row loop (CPU always: its vectorized sine rounds a row's tail
# by where the row falls in the batch), the benchmark's A/B (`source=0`).
BATCHED_SOURCE = True
_BATCHED_DEVICES = ("cuda",)  # where the batched form runs (a test opens CPU)
# Per-row CUDA noise drawn straight into the batch's rows (`draw_source_noise`): the same numbers in a
# third of the launches. Engine on the H200: 318.0x (318.0, 329.7) with it and the one-gather mel
# (engine.GATHER_TO_HIFT) vs 316.7x (316.7, 331.1) without either, A B B A
# (bench/results/gpu_h200_worker17.json): no difference beyond the noise, kept for costing nothing.
# That run also had F0 and the phase over the padded batch: they moved each row's source by ~2e-4
# against the row alone on CUDA (a cumulative phase of 1e4 rad keeps ~1e-3 rad of fp32 rounding), so
# the same mel no longer gave the same audio in another batch, for no measured gain; dropped.
# Bench switch `draws`.
IN_PLACE_DRAWS = True


def batched_source(device: torch.device) -> bool:
    """Whether the source's sample-rate half runs over the padded batch on `device` (BATCHED_SOURCE)."""
    return BATCHED_SOURCE and device.type in _BATCHED_DEVICES


class SourceModule(nn.Module):
    """F0 (B, T_mel) Hz -> excitation (B, 1, T_wav): 9 harmonic sines + noise, merged by linear+tanh.

    The phase is integrated at the frame rate and linearly interpolated to the sample rate (the
    official SineGen2), in fp32 whatever the module dtype. Each row's phase is made on its own
    length: the interpolation clamps at a row's real end. On a CPU the rest is row by row too:
    elementwise kernels (sin) round their vector tails differently at other lengths, and a 1e-8
    change in the source can become ~1e-5 in the waveform; on CUDA it is batched (BATCHED_SOURCE).
    """

    def __init__(self, d: HiftDims):
        super().__init__()
        self.d = d
        self.l_linear = nn.Linear(d.nb_harmonics + 1, 1)

    def phase(self, f0: torch.Tensor, phase0: torch.Tensor) -> torch.Tensor:
        """One row: f0 (1, T_mel) Hz, phase0 (1, H) -> harmonic phases (1, H, T_wav) in radians, fp32."""
        d, up = self.d, self.d.samples_per_frame
        harmonics = torch.arange(1, d.nb_harmonics + 2, device=f0.device, dtype=torch.float32)
        f0_wav = f0.float().repeat_interleave(up, dim=1)[:, :, None]  # (1, T_wav, 1), nearest upsampling
        cycles = (f0_wav * harmonics / d.sampling_rate) % 1  # (1, T_wav, H) cycles per sample
        phase0 = phase0.float().clone()
        phase0[:, 0] = 0  # the fundamental starts at phase 0
        cycles[:, 0, :] = cycles[:, 0, :] + phase0
        # Frame-rate integration, as the official code: linear downsampling takes each frame's
        # middle samples, the running sum times the samples per frame is the phase at each frame,
        # and linear upsampling brings it back to samples.
        per_frame = F.interpolate(cycles.transpose(1, 2), scale_factor=1 / up, mode="linear")  # (1, H, T_mel)
        phase = torch.cumsum(per_frame, dim=2) * 2 * math.pi
        return F.interpolate(phase * up, scale_factor=up, mode="linear")  # (1, H, T_wav)

    def sines(self, f0: torch.Tensor, phase0: torch.Tensor) -> torch.Tensor:
        """One row: f0 (1, T_mel) Hz, phase0 (1, H) -> harmonic sines (1, T_wav, H) * amplitude, fp32."""
        return torch.sin(self.phase(f0, phase0).transpose(1, 2)) * self.d.nsf_alpha

    def forward(
        self, f0: torch.Tensor, mel_lengths: torch.Tensor | Sequence[int], noise: SourceNoise, phase: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`phase` (B, H, T_wav of the longest row): each row's harmonic phase as `phase` makes it, where
        the caller has it already (HiFT's row graphs; the batched form only)."""
        B, T_mel = f0.shape
        host = host_lengths(mel_lengths, B, T_mel)
        if batched_source(f0.device):
            return self._batched(f0, host, noise, phase)
        d, up = self.d, self.d.samples_per_frame
        w, b = self.l_linear.weight.float(), self.l_linear.bias.float()
        source = torch.zeros(B, 1, T_mel * up, device=f0.device)
        for row, n in enumerate(host):
            f0_row = f0[row : row + 1, :n].float()  # (1, T_mel_b)
            sines = self.sines(f0_row, noise.phase0[row : row + 1])  # (1, T_wav_b, H)
            uv = (f0_row.repeat_interleave(up, dim=1)[:, :, None] > d.nsf_voiced_threshold).float()
            noise_amp = uv * d.nsf_sigma + (1 - uv) * d.nsf_alpha / 3
            excitation = sines * uv + noise_amp * noise.noise[row : row + 1, : n * up].float()
            source[row, :, : n * up] = torch.tanh(F.linear(excitation, w, b))[0].transpose(0, 1)  # (T_wav_b, 1) -> (1, T_wav_b)
        return source

    def _batched(self, f0: torch.Tensor, host: list[int], noise: SourceNoise, phase: torch.Tensor | None = None) -> torch.Tensor:
        """The forward with the sample-rate half over the whole batch, (B, H, T) channel-major so every
        pass reads contiguous rows; T is the longest row's samples, the source is padded with zeros
        to T_mel samples per frame."""
        d, up = self.d, self.d.samples_per_frame
        B, T_mel = f0.shape
        T = max(host, default=0) * up
        H = d.nb_harmonics + 1
        if phase is None:
            phase = torch.zeros(B, H, T, device=f0.device)
            for row, n in enumerate(host):
                if n:
                    phase[row, :, : n * up] = self.phase(f0[row : row + 1, :n].float(), noise.phase0[row : row + 1])[0]
        sines = torch.sin(phase) * d.nsf_alpha  # (B, H, T)
        uv = (f0[:, : T // up].float().repeat_interleave(up, dim=1) > d.nsf_voiced_threshold).float()[:, None]  # (B, 1, T)
        noise_amp = uv * d.nsf_sigma + (1 - uv) * d.nsf_alpha / 3
        excitation = sines * uv + noise_amp * noise.noise[:, :T].float().transpose(1, 2)  # (B, H, T)
        w, bias = self.l_linear.weight.float()[0], self.l_linear.bias.float()[0]  # (H,), ()
        merged = excitation[:, 0] * w[0]  # (B, T): the linear over harmonics as a fixed chain of elementwise ops
        for h in range(1, H):
            merged = merged + excitation[:, h] * w[h]
        valid = torch.arange(T, device=f0.device)[None, :] < to_device([n * up for n in host], torch.long, f0.device)[:, None]
        source = torch.where(valid, torch.tanh(merged + bias), 0.0)  # (B, T), zero past each row
        return F.pad(source, (0, T_mel * up - T))[:, None]  # (B, 1, T_mel * up)


# ---------------------------------------------------------------------------------------------
# Generator blocks.
# ---------------------------------------------------------------------------------------------


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, per channel (alpha stored linearly, not as a log).

    On CUDA the five elementwise passes (mul, sin, pow, mul, add) are one Triton kernel
    (`snake_kernel.fused_snake`): HiFT's 72 Snakes per call were a third of its GPU time, all of it
    memory traffic. `fused` False keeps the eager form (CPU, and the benchmark's A/B)."""

    fused = True

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))
        # (2, C) fp32: alpha and 1 / (alpha + 1e-9), made once for the kernel, not per call
        self._kernel_args = DerivedWeight(lambda a: torch.stack([a.float(), 1.0 / (a.float() + 1e-9)]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and (x.is_cuda or interpreting()):  # Triton's interpreter takes CPU tensors (tests)
            from voxbatch.worker.cosyvoice2.snake_kernel import fused_snake

            out = fused_snake(x, self.kernel_args())
            if out is not None:
                return out
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)

    def kernel_args(self) -> torch.Tensor:
        """(2, C) fp32 [alpha, 1 / (alpha + 1e-9)]: what the Snake and conv-epilogue kernels read."""
        return self._kernel_args(self.alpha)


# HiFT's masked convs with their bias, mask and residual add as one pass after the conv (Triton, CUDA,
# fp32: conv_epilogue.py; bit-identical to eager). Read at every call; False keeps eager (CPU always),
# the benchmark's A/B (`epilogue=0`).
FUSED_CONV_EPILOGUE = True
# A residual block's second Snake applied by its first conv's epilogue kernel (conv_epilogue's `snake`):
# the conv's masked output goes straight into the Snake in registers instead of being written by the
# epilogue and read back by the Snake kernel, bit for bit the two kernels' result. 36 of a decode's 72
# Snakes (their kernel: 13% of HiFT's device time, bench/results/gpu_h100_worker26_profile.txt).
# Bench switch `snake_epi`. Off: HiFT's batches 0.935 of the two-kernel form's time alone on an H100
# (gpu_h100_parts35.json; one of two timings lost in gpu_h100_s36_parts.json), and with `enc_sdpa` the
# worker 1.004 of the shipped one's speed, inside its spread (bench/results/gpu_h100_s36c_worker.json).
SNAKE_IN_EPILOGUE = False


# HiFT's decode with its activations channels-last: each (B, C, T) activation stored (B, T, C) and each
# convolution run as the same 2-D conv over (B, C, 1, T) with its weight stored channels-last (made once
# per weight; `conv1d_any_layout`), so cuDNN runs its NHWC kernels on them as they are (GPU test: the
# transposes counted in the profiler). Stored (B, C, T), cuDNN transposes every convolution's input to NHWC and its output back:
# 123 ms of a 128-row batch's 513 ms of HiFT device time on an H100 (nchwToNhwc/nhwcToNchw in
# bench/results/gpu_h100_worker26_profile.txt), besides the epilogue's and Snake's passes. The conv
# epilogue and Snake kernels take either layout with the same per-element arithmetic; the convolutions
# are cuDNN's NHWC kernels instead of its NCHW ones, so the waveform moves by their rounding (tests: the
# fixture's reference tolerance, and batched against single, on a GPU). On: HiFT's batches 0.79 of
# the NCHW form's time on an H100 in two runs (bench/results/gpu_h100_parts35.json, gpu_h100_s36_parts.json;
# GPU tests passed in the second). Read at every call; bench switch `hift_cl`.
CHANNELS_LAST = True
_CL_DEVICES = ("cuda",)  # where it runs (a CPU test opens CPU)


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """(B, C, T) -> the same values stored (B, T, C) (x itself where it already is)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _channels_last_here(x: torch.Tensor) -> bool:
    """Whether x is a channels-last activation of a CHANNELS_LAST decode (an input that merely arrives
    so strided, such as the engine's gathered mel, keeps the default path's kernels)."""
    return CHANNELS_LAST and x.device.type in _CL_DEVICES and channels_last(x) is True


def _weight_2d(w: torch.Tensor) -> torch.Tensor:
    """A 1-D conv's weight (O, I, k) as the (O, I, 1, k) weight of the same 2-D conv, stored channels-last."""
    return w.unsqueeze(2).contiguous(memory_format=torch.channels_last)


def conv1d_any_layout(conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """conv over x (B, C, T) with `bias` (the conv's own, or None for the epilogue to add). On a
    channels-last x of a CHANNELS_LAST decode it runs as the same 2-D conv over (B, C, 1, T), with the
    weight kept channels-last (made once per weight): torch makes a 3-D conv's input contiguous before
    it reaches cuDNN ("avoid going through NHWC for permuted 3d input"), so a 1-D conv would transpose
    it back; a 4-D channels-last input runs cuDNN's NHWC kernels as it is, and its output stays so."""
    transposed = isinstance(conv, nn.ConvTranspose1d)
    if not _channels_last_here(x):
        if transposed:
            return F.conv_transpose1d(x, conv.weight, bias, conv.stride, conv.padding, conv.output_padding, conv.groups,
                                      conv.dilation)
        return F.conv1d(x, conv.weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    derived = getattr(conv, "_channels_last_weight", None)
    if derived is None:
        derived = conv._channels_last_weight = DerivedWeight(_weight_2d)
    w, x2 = derived(conv.weight), x.unsqueeze(2)  # (B, C, 1, T), channels-last as x is
    (s,), (p,), (d,) = conv.stride, conv.padding, conv.dilation
    if transposed:
        (op,) = conv.output_padding
        y = F.conv_transpose2d(x2, w, bias, (1, s), (0, p), (0, op), conv.groups, (1, d))
    else:
        y = F.conv2d(x2, w, bias, (1, s), (0, p), (1, d), conv.groups)
    y = y.squeeze(2)
    # a backend that wrote it (B, C, T) anyway: one layout through a block, so the epilogue takes y with its skip
    return to_channels_last(y) if channels_last(y) is False else y


def masked_conv(conv: nn.Conv1d, x: torch.Tensor, mask: torch.Tensor, skip: torch.Tensor | None = None,
                then: "Snake | None" = None) -> torch.Tensor:
    """conv(x) * mask (B, C, T), plus `skip` where given (a residual block's x + ...), through the
    Snake `then` where given (in the epilogue kernel with SNAKE_IN_EPILOGUE)."""
    fusable = conv.bias is not None and conv.padding_mode == "zeros" and x.dtype == torch.float32
    if FUSED_CONV_EPILOGUE and fusable and (x.is_cuda or interpreting()):  # a CPU conv folds its bias in: eager there
        y = conv1d_any_layout(conv, x, None)
        in_epilogue = SNAKE_IN_EPILOGUE and then is not None and then.fused
        out = conv_epilogue(y, conv.bias, mask, skip, then.kernel_args() if in_epilogue else None)
        if out is not None:
            return out if then is None or in_epilogue else then(out)
        y = (y + conv.bias[None, :, None]) * mask  # = conv(x) * mask: torch adds a cuDNN conv's bias after the conv
    else:
        y = (conv1d_any_layout(conv, x, conv.bias) if _channels_last_here(x) and conv.padding_mode == "zeros" else conv(x)) * mask
    y = y if skip is None else skip + y
    return y if then is None else then(y)


class ResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations: per dilation, snake-conv-snake-conv + skip."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=dil, padding=dil * (kernel_size - 1) // 2)
            for dil in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            xt = masked_conv(conv1, act1(x), mask, then=act2)  # act2(conv1(...) * mask)
            x = masked_conv(conv2, xt, mask, skip=x)  # x + conv2(...) * mask
        return x


class HiFTGenerator(nn.Module):
    """Neural source filter + iSTFTNet: mel (B, 80, T_mel) -> waveform (B, T_mel * 480)."""

    def __init__(self, d: HiftDims):
        super().__init__()
        self.d = d
        C = d.base_channels
        self.f0_predictor = F0Predictor(d)
        self.m_source = SourceModule(d)
        self.conv_pre = nn.Conv1d(d.in_channels, C, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(C // 2**i, C // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(d.upsample_rates, d.upsample_kernel_sizes))
        )
        # The source enters at every upsampling stage: its STFT (n_fft + 2 channels at the final
        # frame rate) is strided down to that stage's rate.
        spec_ch = d.n_fft + 2
        down_rates = [math.prod(d.upsample_rates[i + 1 :]) for i in range(len(d.upsample_rates))]  # e.g. 15, 3, 1
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spec_ch, C // 2 ** (i + 1), 1) if r == 1 else nn.Conv1d(spec_ch, C // 2 ** (i + 1), 2 * r, r, padding=r // 2)
            for i, r in enumerate(down_rates)
        )
        self.source_resblocks = nn.ModuleList(
            ResBlock(C // 2 ** (i + 1), k, dil)
            for i, (k, dil) in enumerate(zip(d.source_resblock_kernel_sizes, d.source_resblock_dilation_sizes))
        )
        self.resblocks = nn.ModuleList(
            ResBlock(C // 2 ** (i + 1), k, dil)
            for i in range(len(d.upsample_rates))
            for k, dil in zip(d.resblock_kernel_sizes, d.resblock_dilation_sizes)
        )
        self.conv_post = nn.Conv1d(C // 2 ** len(d.upsample_rates), spec_ch, 7, padding=3)

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> HiFTGenerator:
        return load_hift(model_dir, device, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.conv_pre.weight.dtype

    def _window(self, device: torch.device) -> torch.Tensor:
        # Periodic Hann, computed in float64 like scipy's get_window, then fp32.
        return torch.hann_window(self.d.n_fft, periodic=True, dtype=torch.float64, device=device).float()

    # -- STFT of the source and iSTFT of the output, per row's own length (fp32) ----------------

    def _stft(self, source: torch.Tensor, wav_lengths: torch.Tensor) -> torch.Tensor:
        """source (B, 1, T_wav) -> [real; imag] (B, n_fft + 2, T_spec), centered, reflect-padded at
        each row's own end, zero for frames past a row's T_spec."""
        n_fft, hop, half = self.d.n_fft, self.d.hop_len, self.d.n_fft // 2
        x = source[:, 0].float()
        B, T_wav = x.shape
        pos = torch.arange(-half, T_wav + half, device=x.device)[None, :].expand(B, -1)  # (B, T_wav + n_fft)
        last = (wav_lengths - 1)[:, None]
        idx = torch.where(pos < 0, -pos, pos)
        idx = torch.where(idx > last, 2 * last - idx, idx).clamp(0, T_wav - 1)
        padded = x.gather(1, idx) * (pos <= last + half).float()
        spec = torch.stft(padded, n_fft, hop, n_fft, window=self._window(x.device), center=False, return_complex=True)
        spec = torch.cat([spec.real, spec.imag], dim=1)  # (B, n_fft/2 + 1, T_spec) x 2 -> (B, n_fft + 2, T_spec)
        return spec * length_mask(wav_lengths // hop + 1, spec.shape[2], spec.dtype)

    def _istft(self, magnitude: torch.Tensor, phase: torch.Tensor, spec_lengths: torch.Tensor) -> torch.Tensor:
        """(B, n_fft/2 + 1, T_spec) magnitude and phase -> (B, T_wav); overlap-add normalized by the
        squared-window envelope of each row's own frames (what torch.istft does for one row)."""
        n_fft, hop, half = self.d.n_fft, self.d.hop_len, self.d.n_fft // 2
        B, _, T_spec = magnitude.shape
        frame_mask = length_mask(spec_lengths, T_spec, torch.float32)  # (B, 1, T_spec)
        spec = torch.polar(magnitude.float().clamp(max=1e2), phase.float()) * frame_mask
        window = self._window(magnitude.device)
        frames = torch.fft.irfft(spec.transpose(1, 2), n=n_fft) * window  # (B, T_spec, n_fft)
        full = n_fft + hop * (T_spec - 1)
        out = F.fold(frames.transpose(1, 2), (1, full), (1, n_fft), stride=(1, hop))[:, 0, 0]  # (B, full)
        env_frames = (window.pow(2)[None, :, None] * frame_mask).expand(B, -1, -1)  # (B, n_fft, T_spec)
        env = F.fold(env_frames, (1, full), (1, n_fft), stride=(1, hop))[:, 0, 0]
        out = out / torch.where(env > 1e-11, env, torch.ones_like(env))
        return out[:, half : full - half]  # (B, hop * (T_spec - 1)) = (B, T_wav)

    # -- the model -------------------------------------------------------------------------------

    def f0(self, mel: torch.Tensor, mel_lengths: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """mel (B, 80, T_mel) -> F0 (B, T_mel) in Hz, zero past each row's length.

        Row by row on each row's own frames: F0 is integrated into the source phase over every
        sample, so the last-bit differences a batched convolution may pick (another kernel or
        blocking for another shape) would grow to ~1e-4 in the source; run alone, a row's F0 is
        bit-identical to its one-at-a-time F0. The predictor is small and at the frame rate.
        With F0_FRAME_QUANTUM > 1 a row runs zero-padded to a multiple of it (masked after each
        convolution, so the same F0 within rounding): its shape then recurs across rows and batches.
        """
        dtype = self.f0_predictor.classifier.weight.dtype  # fp32 as load_hift leaves it
        mel = mel.to(dtype)
        B, _, T_mel = mel.shape
        if self._row_graphs(mel):
            rows = self._graph_rows(mel, host_lengths(mel_lengths, B, T_mel))
            if rows is not None:
                return rows[0]
        if B == 1 and F0_FRAME_QUANTUM == 1:
            return self.f0_predictor(mel, length_mask(split_lengths(mel_lengths, B, T_mel, mel.device)[0], T_mel, dtype))
        f0 = mel.new_zeros(B, T_mel)
        for b, n in enumerate(host_lengths(mel_lengths, B, T_mel)):
            width = -(-n // F0_FRAME_QUANTUM) * F0_FRAME_QUANTUM
            row = mel[b : b + 1, :, :n]
            mask = row.new_ones(1, 1, width)
            if width > n:
                row = F.pad(row, (0, width - n))  # (1, 80, width), zeros past n
                mask[:, :, n:] = 0
            f0[b, :n] = self.f0_predictor(row, mask)[0, :n]
        return f0

    def _row_graphs(self, mel: torch.Tensor) -> bool:
        """Whether this call's rows go through their CUDA graphs (F0_ROW_GRAPHS)."""
        return F0_ROW_GRAPHS and mel.device.type in _GRAPH_DEVICES and not _f0_graphs_failed

    def _graph_rows(
        self, mel: torch.Tensor, host: list[int], phase0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """F0 (B, T_mel) of each row from its width's graph, and with `phase0` (B, H) its harmonic phase
        (B, H, T_wav of the longest row), zero past each row; None where a capture failed (graphs off)."""
        mel = mel.to(self.f0_predictor.classifier.weight.dtype)  # fp32 as load_hift leaves it, as f0() runs it
        B, _, T_mel = mel.shape
        up = self.d.samples_per_frame
        with torch.inference_mode():  # the graphs' buffers are inference tensors, written in place
            f0 = mel.new_zeros(B, T_mel)
            phase = None if phase0 is None else torch.zeros(B, phase0.shape[1], max(host, default=0) * up, device=mel.device)
            for b, n in enumerate(host):
                if not n:
                    continue
                graph = _RowGraph.get(self, mel, -(-n // F0_GRAPH_QUANTUM) * F0_GRAPH_QUANTUM, phase is not None)
                if graph is None:
                    return None
                f0[b, :n], row_phase = graph(mel[b : b + 1, :, :n], None if phase0 is None else phase0[b : b + 1])
                if phase is not None:
                    phase[b, :, : n * up] = row_phase
            return f0, phase

    def source(
        self,
        f0: torch.Tensor,
        mel_lengths: torch.Tensor | Sequence[int] | None = None,
        generators: Sequence[torch.Generator] | None = None,
        noise: SourceNoise | None = None,
    ) -> torch.Tensor:
        """F0 (B, T_mel) -> source (B, 1, T_wav) fp32. Randomness from `noise` if given, else from
        per-row `generators`, else from the global torch RNG in the official order."""
        host = host_lengths(mel_lengths, f0.shape[0], f0.shape[1])
        if noise is None:
            wav_lengths = [n * self.d.samples_per_frame for n in host]
            noise = draw_source_noise(self.d.nb_harmonics + 1, wav_lengths, generators, device=f0.device)
        return self.m_source(f0, host, noise)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, mel_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """mel (B, 80, T_mel) + source (B, 1, T_wav) -> waveform (B, T_wav) fp32 in [-limit, limit]."""
        d = self.d
        mel_lengths = self._lengths(mel, mel_lengths)
        B, _, T_mel = mel.shape
        wav_lengths = mel_lengths * d.samples_per_frame
        spec_lengths = wav_lengths // d.hop_len + 1
        layout = to_channels_last if CHANNELS_LAST and mel.device.type in _CL_DEVICES else (lambda t: t)
        s_spec = layout(self._stft(source, wav_lengths).to(self.dtype))  # (B, n_fft + 2, T_spec)

        mel_mask = length_mask(mel_lengths, T_mel, self.dtype)
        x = masked_conv(self.conv_pre, layout(mel.to(self.dtype) * mel_mask), mel_mask)  # (B, C, T_mel)
        lengths = mel_lengths
        n_up, n_k = len(self.ups), len(d.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = conv1d_any_layout(up, F.leaky_relu(x, d.lrelu_slope), up.bias)  # (B, C / 2^(i+1), T * rate)
            lengths = lengths * d.upsample_rates[i]
            if i == n_up - 1:
                x = layout(F.pad(x, (1, 0), mode="reflect"))  # one more frame to match the STFT frame count
                lengths = lengths + 1
            mask = length_mask(lengths, x.shape[2], self.dtype)
            x = x * mask
            si = masked_conv(self.source_downs[i], s_spec, mask)
            x = x + self.source_resblocks[i](si, mask)
            x = sum(self.resblocks[i * n_k + j](x, mask) for j in range(n_k)) / n_k
        x = conv1d_any_layout(self.conv_post, F.leaky_relu(x), self.conv_post.bias)  # default slope 0.01 here, as the official code
        half = d.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half].float())
        phase = torch.sin(x[:, half:].float())  # (B, n_fft/2 + 1, T_spec) each
        wav = self._istft(magnitude, phase, spec_lengths)
        wav = wav.clamp(-d.audio_limit, d.audio_limit)
        return wav * length_mask(wav_lengths, wav.shape[1], wav.dtype)[:, 0]

    @torch.inference_mode()
    def inference(
        self,
        mel: torch.Tensor,
        mel_lengths: torch.Tensor | Sequence[int] | None = None,
        generators: Sequence[torch.Generator] | None = None,
        cache_source: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B, 80, T_mel) -> (waveform (B, T_wav), source (B, 1, T_wav)).

        `mel_lengths` as a host list (what the engine has) keeps the whole call free of host syncs:
        the per-row F0 and source loops need the lengths on the host, and reading them back from a
        device tensor waits for everything queued before (the flow batch).

        `generators`: one torch.Generator per row (its seed makes the row reproducible alone or in any
        batch); None draws from the global RNG in the official order. `cache_source` (B, 1, n)
        overwrites the first n source samples (streaming: continue the previous chunk's source).
        """
        lengths, host = split_lengths(mel_lengths, mel.shape[0], mel.shape[2], mel.device)
        if PHASE_IN_ROW_GRAPH and self._row_graphs(mel) and batched_source(mel.device):
            # The draws first (F0 draws nothing, so each generator gives what it gave after F0): the
            # graphs need each row's initial phases.
            wav_lengths = [n * self.d.samples_per_frame for n in host]
            noise = draw_source_noise(self.d.nb_harmonics + 1, wav_lengths, generators, device=mel.device)
            rows = self._graph_rows(mel, host, noise.phase0)
            f0, phase = rows if rows is not None else (self.f0(mel, host), None)
            source = self.m_source(f0, host, noise, phase)
        else:
            source = self.source(self.f0(mel, host), host, generators)
        if cache_source is not None and cache_source.shape[2] > 0:
            source[:, :, : cache_source.shape[2]] = cache_source.float()
        return self.decode(mel, source, lengths), source

    @staticmethod
    def _lengths(mel: torch.Tensor, mel_lengths: torch.Tensor | None) -> torch.Tensor:
        if mel_lengths is None:
            return torch.full((mel.shape[0],), mel.shape[2], dtype=torch.long, device=mel.device)
        return mel_lengths.to(device=mel.device, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Checkpoint: official names are ours; weight norm (either layout) is folded into `.weight`.
# ---------------------------------------------------------------------------------------------

# (g, v) suffixes of the two weight-norm layouts torch has written: parametrizations (torch >= 2.1)
# and the older weight_norm hook.
WEIGHT_NORM_LAYOUTS = (
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
    (".weight_g", ".weight_v"),
)
OPTIONAL_PREFIX = "generator."
# F0 sets the pitch and is integrated into the source phase over every sample: the F0 predictor
# (small, at the frame rate) and the source merge stay fp32 whatever dtype the generator runs in
# (F0 from bf16 weights moves by several Hz).
FP32_MODULES = ("f0_predictor", "m_source")  # HiFiGan training checkpoints nest the generator under this


def fold_weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w = g * v / ||v||, the norm taken over every dim where g has size 1.

    The kept dim is where g is not 1: dim 0 for both layouts torch writes, which is the output
    channels of a Conv1d but the input channels of a ConvTranspose1d (weight (C_in, C_out, k)).
    Folded with torch's own weight-norm kernel (what the official parametrization calls every
    forward), so the folded weights equal the official ones bit for bit; a plain g * v / v.norm()
    rounds differently and moves F0, hence the integrated source phase, by ~1e-4.
    """
    if g.dim() == 0 or g.numel() == 1 and v.shape[0] != 1:
        dim = -1  # one scalar g: norm over the whole tensor
    else:
        kept = [i for i in range(v.dim()) if g.shape[i] != 1]
        dim = kept[0] if kept else 0
    return torch._weight_norm(v.float(), g.float(), dim).to(v.dtype)


def convert_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official hift.pt state dict (any layout, optional `generator.` prefix) -> our plain names."""
    if sd and all(k.startswith(OPTIONAL_PREFIX) for k in sd):
        sd = {k[len(OPTIONAL_PREFIX) :]: v for k, v in sd.items()}
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in sd.items():
        for g_suffix, v_suffix in WEIGHT_NORM_LAYOUTS:
            if key.endswith(g_suffix) or key.endswith(v_suffix):
                is_g = key.endswith(g_suffix)
                base = key[: -len(g_suffix if is_g else v_suffix)]
                pending.setdefault(base, {})[0 if is_g else 1] = value
                break
        else:
            out[key] = value
    for base, parts in pending.items():
        if len(parts) == 2:
            out[f"{base}.weight"] = fold_weight_norm(parts[0], parts[1])
        else:  # half a pair: report it under its own name so check_keys names it
            out[f"{base}.weight-norm-{'g' if 0 in parts else 'v'}-only"] = next(iter(parts.values()))
    return out


def load_hift(
    model_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> HiFTGenerator:
    """Build HiFT from `cosyvoice2.yaml` and load `hift.pt` strictly (or a given state dict)."""
    dims = HiftDims.from_config(read_config(model_dir))
    name = str(Path(model_dir) / "hift.pt")
    sd = convert_state_dict(state_dict if state_dict is not None else load_state_dict(model_dir, "hift.pt"))
    with empty_init():  # weights read on the host: folding the weight norm there keeps the numbers as they were
        model = HiFTGenerator(dims)
    check_keys(name, set(sd), set(model.state_dict()))
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:  # shape mismatches: the yaml and the checkpoint disagree
        raise ModelDirError(f"{name}: does not fit the yaml `hift` dims: {e}") from e
    model = model.to(device=device).eval()
    for child_name, child in model.named_children():
        if child_name not in FP32_MODULES:
            child.to(dtype)
    return model
