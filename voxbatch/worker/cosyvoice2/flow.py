"""CosyVoice2 flow: speech tokens -> mel (official `CausalMaskedDiffWithXvec` inference), batched.

    tokens = prompt_tokens ++ tokens                                  (B, T_tok)
    h = encoder(input_embedding(tokens))                              (B, T_mel, D), T_mel = 2 T_tok
    mu = encoder_proj(h)                                              (B, 80, T_mel)
    spks = spk_embed_affine_layer(l2_normalize(embedding))            (B, 80)
    cond = prompt mel in the first T_pm frames, zeros after          (B, 80, T_mel)
    mel = Euler ODE from fixed noise, 10 steps on t = 1 - cos(pi/2 s), classifier-free guidance
          v = 1.7 * v(x | mu, spks, cond) - 0.7 * v(x | 0, 0, 0)
    output = mel[:, :, T_pm:]

Batching: rows of different token and prompt lengths run as one padded batch. The result of each
row equals a one-row call: masks everywhere (see flow_encoder / flow_estimator), the fixed noise is
sliced from frame 0 for every row exactly as a single call slices it, and both CFG branches of all
rows go through the estimator as one batch of 2B.

Precision: the modules run in the dtype they were loaded in (fp32 on CPU; bf16/fp16 on GPU); the ODE
state x, its noise and the Euler updates stay fp32. Note: fp32 on CUDA runs cuDNN convolutions in
TF32 by PyTorch's default (`torch.backends.cudnn.allow_tf32`), which moves mels by ~4e-3; the caller
owns that global switch. Measured on an H200 against the fp32 CPU reference: fp16 max abs 6e-3,
bf16 max abs 5e-2 (mels span about +-5).
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from voxbatch.worker import timeline
from voxbatch.worker.cosyvoice2 import cuda_graphs
from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError, check_keys, empty_init, load_state_dict, read_config, section
from voxbatch.worker.cosyvoice2.flow_encoder import EncoderDims, UpsampleConformerEncoder, length_mask
from voxbatch.worker.cosyvoice2.flow_estimator import CausalConditionalDecoder, EstimatorDims
from voxbatch.worker.cosyvoice2.h2d import split_lengths, to_device
from voxbatch.worker.engine import is_out_of_memory

log = logging.getLogger(__name__)

# The ODE's 10 estimator calls on one batch have one shape. Eager, each launches ~1,250 kernels, and the
# host work of launching them, shared through the GIL with the other vocoder thread and the LLM thread,
# bounds small batches (gpu_h200_worker10_worker.log: a 1-row batch took 1.27 s beside another batch).
# So on CUDA the first step runs eagerly (it builds every lazy kernel, plan and workspace), the second
# is captured as a CUDA graph, and steps 2..10 replay it: one step's launches instead of nine. The
# graph is the batch's own (its shapes), made again for every batch; a vocoder thread's graphs share
# one memory pool, so a batch reuses the last one's memory. Replays run the captured kernels on the
# same inputs: the mel is the eager one's (GPU test). Any capture failure is logged once and the flow
# stays eager from then on. Engine on the H200: 312.7x (312.7, 318.3) with vs 306.9x (306.9, 313.1)
# without, runs in A B B A order (bench/results/gpu_h200_worker12.json): ahead in both pairs, by less
# than the run-to-run spread. (Later measurements read that 1-row batch's 1.27 s as mostly the GPU's
# backpressure beside a big batch, not its Python: see STEP_GRAPH_CACHE.)
EULER_STEP_GRAPHS = True  # bench switch `graphs`
_graphs_failed = False
# Once a vocoder thread has run a batch (its cuBLAS/cuDNN handles and workspaces exist), later batches
# capture the step before running any of it and replay it for all ten steps: the eager first step's
# ~1,250 op calls go too. Each op call from Python lets go of the GIL and takes it back; with other
# threads holding it (uploads, intake, the other vocoder thread) taking it back costs up to the switch
# interval, and the GIL probe saw 0.5-0.9 ms per wake-up while a 23-row last batch took 0.89 s of host
# time with the GPU at 2-3% (bench/results/gpu_h200_worker13.json, _worker.log). A failed capture of
# this kind is logged once and turns only this off (the eager first step comes back). Off: it measured
# no faster, engine 303.2x (303.2, 318.6) with vs 320.3x (320.7, 320.3) without, runs in A B B A order
# (bench/results/gpu_h200_worker14.json); its GPU tests pass. Bench switch `cf`.
EULER_CAPTURE_FIRST = False
_capture_first_failed = False
_per_thread = threading.local()  # capture stream and memory pool per (thread, device); the last graph
# Step graphs kept per batch shape (B, T) and replayed for every later batch of that shape: a batch then
# costs the host 10 replays and a few copies instead of an eager step (~1,250 launches) and a capture
# (as many again) of its own. The attention takes its key counts from the mask on the device (flash
# varlen, `seqused_k`), so one graph serves any lengths at its shape; the ODE's frames are padded up to
# GRAPH_FRAME_QUANTUM (masked frames, as a longer batch mate's padding) so that shapes recur. Each
# cached graph owns its input buffers (x and the branches, copied in per batch); all of a thread's
# graphs share its memory pool, which holds one step's intermediates, since they replay one after
# another on the thread's stream. Non-streaming, on CUDA. Off: engine 316.2x (316.2, 317.0) with vs
# 314.7x (314.7, 331.7) without, A B B A, peak GPU memory 30.7 vs 28.7 GiB, and each batch's host
# share unchanged at 99% in the worker (bench/results/gpu_h200_worker18.json): a vocoder thread's
# host time is the GPU's backpressure (its launch queue full while another batch holds the SMs), not
# its Python, on that host; GPU tests passed (gpu_h200_worker18_gpu_tests.txt). Bench switch `gcache`.
# Rows are padded too (GRAPH_ROW_QUANTUM, copies of the batch's last row, dropped after): the worker's
# batch sizes vary from job to job with the pipeline's timing (tail batches [20, 5, 47, 74, 63, 48, 22]
# and [21, 5, 47, 75, 65, 39, 22] in two jobs of bench/results/gpu_h100_s36c_worker.json), so exact
# row counts rarely recur. The timeline counts each batch as `flow_graph_hit` or `flow_graph_capture`.
# Still off: in the worker on an H100 it kept the GPU busier (94.7 / 93.0% vs 92.2 / 91.2 / 89.2%) but
# ran slower, 312.1x / 316.4x vs 344.4x / 330.4x / 326.4x (B/A 0.942), with 5 and 3 hits of 13 batches:
# the padded rows and frames are work the GPU does for nothing (bench/results/gpu_h100_s36d_worker.json,
# A B A B A; its GPU test passed, gpu_h100_s36d_gpu_tests.txt).
STEP_GRAPH_CACHE = False
GRAPH_FRAME_QUANTUM = 32  # mel frames; padding per batch < this (<5% at the corpus' ~700-frame rows)
GRAPH_ROW_QUANTUM = 8  # rows; 1 keeps the batch's own row count
# Batches of more rows than this take the per-batch graph instead of the cache. Why: padding cost the
# big batches most of what s36d lost (75 -> 80 rows, 50 -> 56), while the gaps the cache is for come
# from small ones, whose eager first step is too short to cover their capture's host time; a small
# batch's padding is a few rows. Not kept: `gcache=1,gcache_max=32` ran the worker at 0.961 of the
# shipped speed on an H200, 304.5x / 306.4x vs 323.6x / 318.8x / 311.4x, A B A B A
# (bench/results/gpu_h200_s37_worker.json). Bench switch `gcache_max`, with `gcache=1`.
GRAPH_CACHE_MAX_ROWS = 1 << 30
GRAPH_CACHE_SIZE = 24  # graphs kept per vocoder thread and device, least recently used dropped first

# Fixed by the official code, not the yaml.
N_TIMESTEPS = 10
NOISE_SEED = 0
NOISE_FRAMES = 15000  # 50 * 300: the longest mel (prompt included) one call can produce


@dataclass(frozen=True)
class FlowDims:
    vocab_size: int
    input_size: int  # token embedding width (512)
    output_size: int  # mel bins (80)
    spk_embed_dim: int  # speaker embedding width (192)
    token_mel_ratio: int
    pre_lookahead_len: int
    inference_cfg_rate: float
    encoder: EncoderDims
    estimator: EstimatorDims

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> FlowDims:
        flow = section(config, "flow")
        cfm = section(config, "flow", "decoder", "cfm_params", "content")
        if cfm.get("t_scheduler") != "cosine" or cfm.get("solver") != "euler":
            raise ModelDirError(f"cosyvoice2.yaml: only the cosine/euler CFM is implemented, got {cfm}")
        return cls(
            vocab_size=int(flow["vocab_size"]),
            input_size=int(flow["input_size"]),
            output_size=int(flow["output_size"]),
            spk_embed_dim=int(flow["spk_embed_dim"]),
            token_mel_ratio=int(flow["token_mel_ratio"]),
            pre_lookahead_len=int(flow["pre_lookahead_len"]),
            inference_cfg_rate=float(cfm["inference_cfg_rate"]),
            encoder=EncoderDims.from_config(flow),
            estimator=EstimatorDims.from_config(section(config, "flow", "decoder", "estimator")),
        )


def fixed_noise(device: torch.device | str = "cpu") -> torch.Tensor:
    """The official start noise, `manual_seed(0); randn(1, 80, 15000)`, from a private generator."""
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, 80, NOISE_FRAMES, generator=gen).to(device)


def cosine_t_span(n_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(n_steps + 1,) times 1 - cos(pi/2 * s) for s evenly spaced in [0, 1]."""
    s = torch.linspace(0, 1, n_steps + 1, device=device, dtype=torch.float32)
    return 1 - torch.cos(s * 0.5 * math.pi)


def euler_schedule(t_span: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each Euler step's time and step size, (1,) fp32 each, with the official solver's arithmetic
    (t += dt, dt = t_span[k+1] - t, not t_span's differences): all of one shape, so a captured step
    takes any of them as its inputs."""
    n_steps = t_span.numel() - 1
    times, steps = [], []
    t, dt = t_span[0:1], (t_span[1] - t_span[0]).reshape(1)
    for step in range(1, n_steps + 1):
        times.append(t)
        steps.append(dt)
        t = t + dt
        if step < n_steps:
            dt = t_span[step + 1] - t
    return times, steps


class PendingOde:
    """An ODE begun (`ConditionalFlowMatching.start`): `finish()` queues its steps, once, and gives the mel."""

    def __init__(self, rest: Callable[[], torch.Tensor]):
        self._rest: Callable[[], torch.Tensor] | None = rest
        self._mel: torch.Tensor | None = None
        # The steps run under the grad modes the ODE began in (the engine begins it in inference mode).
        self._modes = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def finish(self) -> torch.Tensor:
        if self._rest is not None:
            rest, self._rest = self._rest, None
            inference, grad = self._modes
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._mel = rest()
        return self._mel


class ConditionalFlowMatching(nn.Module):
    """Euler solver with classifier-free guidance around the U-Net estimator."""

    def __init__(self, estimator: EstimatorDims, cfg_rate: float):
        super().__init__()
        self.cfg_rate = cfg_rate
        self.estimator = CausalConditionalDecoder(estimator)
        self.noise: torch.Tensor | None = None  # (1, 80, 15000) fp32, set by CausalFlow.from_model_dir / init_noise

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """`start(...)` (its arguments) run to the end: mel (B, 80, T_mel) fp32."""
        return self.start(*args, **kwargs).finish()

    def start(
        self,
        mu: torch.Tensor,
        mask: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        n_steps: int = N_TIMESTEPS,
        streaming: bool = False,
        ahead: bool = False,
    ) -> PendingOde:
        """mu, cond (B, 80, T_mel); mask (B, 1, T_mel); spks (B, 80) -> the ODE up to its step graph: its
        state made and, on CUDA, its step captured; the returned `PendingOde.finish()` queues the steps
        and gives the mel (B, 80, T_mel) fp32.

        `ahead`: the caller queues other work on this stream before `finish` (a vocoder thread begins
        its next batch while its current batch's steps run, streaming.VOCODER_PIPELINE). A warm thread
        then captures the step before running any of it, so that starting queues no step: ~1,250 eager
        launches behind a full launch queue would hold the thread until the GPU had nearly run the work
        ahead of them, and the capture would again come where nothing of this thread is queued."""
        B, C, T = mu.shape
        cached = STEP_GRAPH_CACHE and B <= GRAPH_CACHE_MAX_ROWS and not streaming and n_steps > 1 and _capturable(mu)
        T_out, T = T, (-(-T // GRAPH_FRAME_QUANTUM) * GRAPH_FRAME_QUANTUM if cached else T)
        if self.noise is None or self.noise.size(2) < T:
            raise ValueError(f"flow: {T} mel frames requested; the fixed noise covers {NOISE_FRAMES}")
        if T > T_out:  # masked frames up to the quantum: a cached graph's shape
            mu, mask, cond = (F.pad(a, (0, T - T_out)) for a in (mu, mask, cond))
        B_out, B = B, (-(-B // GRAPH_ROW_QUANTUM) * GRAPH_ROW_QUANTUM if cached else B)
        if B > B_out:  # rows up to the quantum: copies of the last row, computed and dropped
            mu, mask, cond, spks = (torch.cat([a, a[-1:].expand(B - B_out, *a.shape[1:])]) for a in (mu, mask, cond, spks))
        x = self.noise[:, :, :T].to(mu.device, torch.float32).expand(B, -1, -1)  # (B, 80, T), same slice per row
        t_span = cosine_t_span(n_steps, mu.device)
        # The guided (rows :B) and unconditional (rows B:) branches as one batch of 2B.
        mask_in = torch.cat([mask, mask])
        mu_in = torch.cat([mu, torch.zeros_like(mu)])
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)])
        times, steps = euler_schedule(t_span)
        branches = (mask_in, mu_in, spks_in, cond_in)
        if cached:
            return PendingOde(lambda: _CachedStep.run(self, x, branches, times, steps)[:B_out, :, :T_out])
        x = x.clone()  # the ODE state, updated in place: (B, 80, T) fp32
        graph, first = None, 0
        began = time.perf_counter()
        if ((EULER_CAPTURE_FIRST or ahead) and not _capture_first_failed and n_steps > 1 and _capturable(x)
                and _StepGraph.warm(x.device)):
            graph = _StepGraph.capture(self, x, times[0], steps[0], branches, streaming, first=True)
        if graph is None and n_steps > 2 and _capturable(x):
            self._step(x, times[0], steps[0], branches, streaming)  # builds lazy kernels, plans and workspaces
            first = 1
            began = time.perf_counter()
            graph = _StepGraph.capture(self, x, times[0], steps[0], branches, streaming)
        if graph is not None:
            timeline.event("flow_capture_ms", round(1000 * (time.perf_counter() - began)))
            timeline.event("flow_graph_capture", B)

        def rest() -> torch.Tensor:
            for k in range(first, n_steps):
                if graph is not None:
                    graph.replay(times[k], steps[k])
                else:
                    self._step(x, times[k], steps[k], branches, streaming)
            return x[:, :, :T_out]

        return PendingOde(rest)

    def _step(self, x: torch.Tensor, t: torch.Tensor, dt: torch.Tensor, branches: tuple, streaming: bool) -> None:
        """One Euler step in place: x += dt * ((1 + r) v(x | mu, spks, cond) - r v(x | 0, 0, 0)), both
        branches as one batch of 2B; t and dt (1,) fp32."""
        B = x.size(0)
        mask_in, mu_in, spks_in, cond_in = branches
        v = self.estimator(torch.cat([x, x]), mask_in, mu_in, t.expand(2 * B), spks_in, cond_in, streaming=streaming).float()
        v_cond, v_uncond = v[:B], v[B:]
        x.add_(dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond))


def _capturable(x: torch.Tensor) -> bool:
    return EULER_STEP_GRAPHS and not _graphs_failed and x.is_cuda


def _slot(device: torch.device) -> dict:
    """This thread's capture stream, memory pool, last two per-batch graphs and cached graphs on `device`."""
    slot = getattr(_per_thread, str(device), None)
    if slot is None:
        slot = {"stream": torch.cuda.Stream(device), "pool": torch.cuda.graph_pool_handle(), "last": None,
                "prev": None, "cache": OrderedDict()}
        setattr(_per_thread, str(device), slot)
    return slot


class _StepGraph:
    """One batch's Euler step as a CUDA graph over the batch's own tensors (x and the branches stay
    where they are; t and dt are copied into the graph's inputs before each replay)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, t: torch.Tensor, dt: torch.Tensor):
        self.graph, self.t, self.dt = graph, t, dt

    @staticmethod
    def warm(device: torch.device) -> bool:
        """Whether this thread has captured a step on `device` before (it ran a batch eagerly first)."""
        return getattr(_per_thread, str(device), None) is not None

    @classmethod
    def capture(cls, cfm: ConditionalFlowMatching, x: torch.Tensor, t: torch.Tensor, dt: torch.Tensor,
                branches: tuple, streaming: bool, first: bool = False, keep: bool = True) -> _StepGraph | None:
        """Captured on this thread's side stream (a capture may not run on the legacy default stream),
        in thread-local mode (the other threads' CUDA calls go on), into this thread's pool; None,
        with the failure logged once and graphs off from then on, where it cannot be captured (only
        capturing `first`, before any eager step, off where that was the capture that failed)."""
        global _graphs_failed, _capture_first_failed
        slot = _slot(x.device)
        t_in, dt_in = t.clone(), dt.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            cuda_graphs.capture(graph, slot["stream"], slot["pool"], lambda: cfm._step(x, t_in, dt_in, branches, streaming))
        except Exception as e:  # noqa: BLE001 - the eager steps still work
            if is_out_of_memory(e):  # this batch is too big for the memory free now, not graphs broken
                raise
            if first:
                log.warning("flow step CUDA graph before an eager step failed (%s: %s); each batch's first step "
                            "runs eagerly again", type(e).__name__, e)
                _capture_first_failed = True
                return None
            log.warning("flow step CUDA graph unavailable (%s: %s); the flow runs eagerly", type(e).__name__, e)
            _graphs_failed = True
            return None
        if keep:
            with cuda_graphs.registry(x.device):  # releasing a graph changes torch's set of graphs
                # The graph before the previous one is released only now: a finished batch's. The previous
                # one's replays may still be queued (VOCODER_PIPELINE begins a batch while the last one's
                # steps run); its thread has waited for the audio of the one before.
                slot["prev"], slot["last"] = slot["last"], graph
        return cls(graph, t_in, dt_in)

    def replay(self, t: torch.Tensor, dt: torch.Tensor) -> None:
        self.t.copy_(t)
        self.dt.copy_(dt)
        self.graph.replay()


class _CachedStep:
    """A step graph kept for its batch shape (STEP_GRAPH_CACHE), over input buffers of its own."""

    def __init__(self, cfm: ConditionalFlowMatching, graph: _StepGraph, x: torch.Tensor, branches: tuple[torch.Tensor, ...]):
        self.cfm = weakref.ref(cfm)  # the key holds id(cfm), which a later module may get once this one is freed
        self.graph, self.x, self.branches = graph, x, branches

    @classmethod
    def run(cls, cfm: ConditionalFlowMatching, x0: torch.Tensor, branches: tuple, times: list, steps: list) -> torch.Tensor:
        """The ODE from x0 (B, 80, T) through this thread's graph for the shape, captured (after an
        eager first step, on the graph's own buffers) when there is none yet; eagerly where no graph
        can be captured (graphs go off, logged once by `_StepGraph.capture`)."""
        slot = _slot(x0.device)
        key = (id(cfm), tuple(x0.shape), *(tuple(b.shape) + (b.dtype,) for b in branches))
        entry = slot["cache"].get(key)
        if entry is not None and entry.cfm() is not cfm:  # a freed module's graph (its weights are gone)
            with cuda_graphs.registry(x0.device):
                del slot["cache"][key]
            entry = None
        if entry is None:
            x, own = x0.clone(), tuple(b.clone() for b in branches)
            cfm._step(x, times[0], steps[0], own, False)  # builds lazy kernels, plans and workspaces first
            graph = _StepGraph.capture(cfm, x, times[0], steps[0], own, False, keep=False)
            timeline.event("flow_graph_capture", x0.size(0))
            if graph is None:  # graphs are off now: the rest of this ODE eagerly
                for k in range(1, len(times)):
                    cfm._step(x, times[k], steps[k], own, False)
                return x
            entry = cls(cfm, graph, x, own)
            with cuda_graphs.registry(x0.device):
                slot["cache"][key] = entry
                while len(slot["cache"]) > GRAPH_CACHE_SIZE:
                    slot["cache"].popitem(last=False)
            first = 1
        else:
            slot["cache"].move_to_end(key)
            timeline.event("flow_graph_hit", x0.size(0))
            entry.x.copy_(x0)
            for mine, given in zip(entry.branches, branches):
                mine.copy_(given)
            first = 0
        for k in range(first, len(times)):
            entry.graph.replay(times[k], steps[k])
        return entry.x.clone()  # the buffer is the next batch's of this shape


class CausalFlow(nn.Module):
    """State-dict compatible with the official `CausalMaskedDiffWithXvec` (flow.pt)."""

    def __init__(self, dims: FlowDims):
        super().__init__()
        self.dims = dims
        self.input_embedding = nn.Embedding(dims.vocab_size, dims.input_size)
        self.spk_embed_affine_layer = nn.Linear(dims.spk_embed_dim, dims.output_size)
        self.encoder = UpsampleConformerEncoder(dims.encoder)
        self.encoder_proj = nn.Linear(dims.encoder.output_size, dims.output_size)
        self.decoder = ConditionalFlowMatching(dims.estimator, dims.inference_cfg_rate)

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> CausalFlow:
        """Build from `cosyvoice2.yaml` + `flow.pt` (strict keys; errors name the file and the keys)."""
        dims = FlowDims.from_config(read_config(model_dir))
        with empty_init():
            model = cls(dims)
        state = load_state_dict(model_dir, "flow.pt", device)  # read onto the device, cast there
        check_keys(str(Path(model_dir) / "flow.pt"), set(state), set(model.state_dict()))
        model.load_state_dict(state, strict=True, assign=True)
        model = model.to(device=device, dtype=dtype).eval()
        model.decoder.noise = fixed_noise(device)
        return model

    # -- pieces ---------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder_proj.weight.dtype

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        """(B, 192) speaker embedding -> (B, 80), after L2 normalization."""
        return self.spk_embed_affine_layer(F.normalize(embedding.to(self.dtype), dim=1))

    def encode(
        self, tokens: torch.Tensor, token_lens: torch.Tensor, streaming: bool = False, finalize: bool = True,
        host_lens: list[int] | None = None,  # token_lens on the host, if the caller has them
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens (B, T_tok) padded, prompt included -> mu (B, 80, T_mel), mel lengths (B,)."""
        valid = length_mask(token_lens, tokens.size(1))[..., None]  # (B, T_tok, 1)
        x = self.input_embedding(tokens.clamp(min=0)) * valid.to(self.dtype)  # (B, T_tok, D)
        h, mel_lens = self.encoder(x, token_lens, streaming=streaming, finalize=finalize, host_lens=host_lens)
        mu = self.encoder_proj(h) * length_mask(mel_lens, h.size(1))[..., None].to(h.dtype)  # (B, T_mel, 80)
        return mu.transpose(1, 2), mel_lens

    # -- inference ------------------------------------------------------------------------------

    def inference(self, *args, **kwargs) -> list[torch.Tensor]:
        """B segments -> B mels (80, T_mel_i) fp32, prompt frames removed: `inference_batch`'s rows."""
        return self.inference_batch(*args, **kwargs).rows()

    @torch.inference_mode()
    def inference_batch(
        self,
        tokens: torch.Tensor,
        token_lens: torch.Tensor | Sequence[int],
        prompt_tokens: torch.Tensor,
        prompt_lens: torch.Tensor | Sequence[int],
        prompt_feat: torch.Tensor,
        prompt_feat_lens: torch.Tensor | Sequence[int],
        embedding: torch.Tensor,
        streaming: bool = False,
        finalize: bool = True,
        ahead: bool = False,
    ) -> MelBatch | PendingMel:
        """B segments -> their mels as one padded batch (MelBatch: fp32, prompt frames still in it).

        tokens (B, T_tok), prompt_tokens (B, T_p), prompt_feat (B, T_pm, 80): padded, with lengths
        (B,) each; embedding (B, 192). `finalize=False` is one non-final streaming call: the last
        `pre_lookahead_len` tokens of each row are look-ahead context and produce no frames.

        Lengths given as host lists (the engine's way) keep the call free of host syncs: the widths,
        checks and each row's frames need them on the host, and reading them back from the device
        waits for everything queued before (at the end, the whole decoder).

        `ahead=True` stops before the ODE's steps (`ConditionalFlowMatching.start`'s `ahead`): a
        PendingMel, whose `finish()` queues them and gives the MelBatch.
        """
        device = self.encoder_proj.weight.device
        B = tokens.shape[0]
        tokens, prompt_tokens = tokens.to(device).long(), prompt_tokens.to(device).long()
        token_lens, tok_host = split_lengths(token_lens, B, tokens.shape[1], device)
        prompt_lens, p_host = split_lengths(prompt_lens, B, prompt_tokens.shape[1], device)
        prompt_feat_lens, pf_host = split_lengths(prompt_feat_lens, B, prompt_feat.shape[1], device)

        all_host = [p + t for p, t in zip(p_host, tok_host)]
        all_tokens, all_lens = _concat_padded(prompt_tokens, prompt_lens, tokens, token_lens, max(all_host, default=0))  # (B, T_p + T_tok)
        mu, mel_lens = self.encode(all_tokens, all_lens, streaming=streaming, finalize=finalize, host_lens=all_host)
        B, _, T = mu.shape
        mel_host = self.encoder.mel_lengths(all_host, finalize)
        if any(pf > m for pf, m in zip(pf_host, mel_host)):
            raise ValueError("flow: a prompt mel is longer than its row's mel output")

        frame_ok = length_mask(mel_lens, T)  # (B, T)
        prompt_ok = length_mask(prompt_feat_lens, T)  # (B, T)
        feat = prompt_feat.to(device, self.dtype)[:, :T]
        feat = F.pad(feat, (0, 0, 0, T - feat.size(1)))  # (B, T, 80)
        cond = (feat * prompt_ok[..., None].to(feat.dtype)).transpose(1, 2)  # (B, 80, T)
        mask = frame_ok[:, None].to(self.dtype)  # (B, 1, T)

        ode = self.decoder.start(mu, mask, self.speaker(embedding.to(device)), cond, streaming=streaming, ahead=ahead)
        pending = PendingMel(ode, pf_host, mel_host)
        return pending if ahead else pending.finish()


class PendingMel:
    """A flow batch up to its ODE's steps (`CausalFlow.inference_batch(ahead=True)`)."""

    def __init__(self, ode: PendingOde, starts: list[int], ends: list[int]):
        self.ode, self.starts, self.ends = ode, starts, ends

    def finish(self) -> MelBatch:
        """Queue the ODE's steps (once) -> the batch's MelBatch."""
        return MelBatch(self.ode.finish(), self.starts, self.ends)


@dataclass(frozen=True)
class MelBatch:
    """One flow batch's mels where the flow left them: `mel` (B, 80, T) fp32, prompt frames first;
    row i's output is mel[i, :, starts[i]:ends[i]]."""

    mel: torch.Tensor
    starts: list[int]
    ends: list[int]

    def rows(self) -> list[torch.Tensor]:
        """B mels (80, T_mel_i), views of the batch."""
        return [self.mel[i, :, a:b] for i, (a, b) in enumerate(zip(self.starts, self.ends))]

    def left_aligned(self, quantum: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """Each row's output moved to frame 0, zeros after, width rounded up to `quantum` frames:
        (B, 80, W) on `device` and the lengths. The same values as padding `rows()` one by one, in
        one gather instead of a slice and a copy per row."""
        lens = [b - a for a, b in zip(self.starts, self.ends)]
        width = -(-max(lens, default=0) // quantum) * quantum
        B, C, T = self.mel.shape
        starts, n = to_device([self.starts, lens], torch.long, self.mel.device)  # (B,) each, one copy
        frames = torch.arange(width, device=self.mel.device)[None, :]  # (1, W)
        src = (starts[:, None] + frames).clamp(max=max(T - 1, 0))  # (B, W)
        valid = frames < n[:, None]  # (B, W)
        out = torch.where(valid[:, None, :], self.mel.gather(2, src[:, None, :].expand(B, C, width)), 0.0)
        return out.to(device), lens


def _concat_padded(
    a: torch.Tensor, a_lens: torch.Tensor, b: torch.Tensor, b_lens: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row a[:a_len] ++ b[:b_len], right-padded with 0: (B, width), lengths (B,). `width`: the
    longest a_len + b_len where the caller knows it on the host (else read back from the device)."""
    B, T_a = a.shape
    T = T_a + b.size(1)
    pos = torch.arange(T, device=a.device)[None, :].expand(B, T)  # (B, T)
    in_a = pos < a_lens[:, None]
    from_a = a.gather(1, pos.clamp(max=T_a - 1)) if T_a > 0 else torch.zeros_like(pos)
    b_pos = (pos - a_lens[:, None]).clamp(min=0, max=max(b.size(1) - 1, 0))
    from_b = b.gather(1, b_pos) if b.size(1) > 0 else torch.zeros_like(pos)
    lens = a_lens + b_lens
    out = torch.where(in_a, from_a, from_b) * length_mask(lens, T)
    return out[:, : int(lens.max()) if width is None else width], lens
