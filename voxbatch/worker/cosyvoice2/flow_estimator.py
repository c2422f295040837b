"""The flow-matching vector field: a causal conditional 1-D U-Net (official `CausalConditionalDecoder`).

Input per frame: noisy mel x, encoder mean mu, speaker vector spks (broadcast over time) and the
prompt-mel condition, stacked on channels (4 x 80 = 320). One level of

    causal resnet (+ time embedding) -> transformer blocks -> causal conv

down, `num_mid_blocks` resnet+transformer mid blocks, one level up with the skip connection, a final
causal block and a 1x1 projection to 80 mel channels.

Every conv is causal (left padding only) and its input is zeroed outside the mask, and attention
masks padding keys, so a padded row yields exactly what the unpadded row would. Streaming uses a
static chunk mask (`static_chunk_size` frames) in every attention. Without it the mask only limits
each row's keys to its length, which FlashAttention's varlen call takes as per-row key counts on
CUDA (`VARLEN_ATTENTION`, flash_varlen.py).

Inside, activations are time-major (B, T, C) from input to output: the transformer blocks, the
LayerNorms and the convs (as matmuls, `CausalConv1d`) all read contiguous rows, with no transposes
between blocks; the (B, C, T) interface of the official decoder is kept at the boundary.
On CUDA each LayerNorm is one Triton kernel (`norm_kernel`), the Mish and mask that follow it in
the causal blocks fused in (`FUSED_NORM`), and the FFN's GELU rides in its first matmul's epilogue
(`GELU_EPILOGUE`).

Module and parameter names mirror the official ones (Matcha-TTS blocks) so `flow.pt` loads
unchanged; parameter-free slots of the official `nn.Sequential`s are `nn.Identity` placeholders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError
from voxbatch.worker.cosyvoice2.derived import DerivedWeight, stacked
from voxbatch.worker.cosyvoice2.flash_varlen import PaddedRows, padded_attention
from voxbatch.worker.cosyvoice2.flow_encoder import attention_mask
from voxbatch.worker.cosyvoice2.norm_kernel import fused_layer_norm


CONV_TAIL = 2  # zero frames appended to every row: at least kernel_size - 1 of the k=3 causal convs

# The LayerNorms (and CausalBlock1D's LayerNorm -> Mish -> mask) as one Triton kernel on CUDA
# (`norm_kernel`): PyTorch's LayerNorm was 17.5% of the flow's GPU time on the H200
# (bench/results/gpu_h200_engine_profile.txt); engine 239.6x vs 230.1x eager (gpu_h200_ab1.json).
# Read at forward time; False keeps the eager form (as CPU does), the benchmark's A/B.
FUSED_NORM = True

# Non-streaming attention on CUDA in fp16/bf16 as one FlashAttention varlen call with per-row key
# counts (flash_varlen.py) instead of SDPA with a boolean mask: engine 239.6x vs 205.8x on the H200
# (bench/results/gpu_h200_ab1.json). False keeps SDPA (the benchmark's A/B, `varlen=0`). Read at every call.
VARLEN_ATTENTION = True

# The FFN's first projection and its GELU as one cuBLASLt matmul with a GELU epilogue
# (`torch._addmm_activation`) on CUDA in fp16/bf16, instead of the matmul and a GELU kernel that
# reads and writes the (B, T', 4c) activation again (8.2% of the flow's device time,
# bench/results/gpu_h200_worker8_profile.txt). The epilogue is GELU's tanh form: it differs from the
# exact (erf) GELU by at most 5e-4, under half an fp16 step at the values where it is largest; the
# test on the GPU holds it to the eager estimator's distance from fp32. Read at every call; False
# keeps the eager form (CPU always), the benchmark's A/B (`gelu=0`).
GELU_EPILOGUE = True
# The transformer blocks' residual stream without its biases (`TransformerStack`): each block's
# attention output projection and FFN down-projection accumulate into the stream in place
# (`addmm_`, cuBLAS's beta=1 form), their biases summed once per weight into one shift per block that
# the next LayerNorm kernel adds as it reads the stream (`fused_layer_norm(shift=)`), and the stack's
# output made whole and masked in two passes at its end. That replaces the two residual adds of every
# block (1,120 of the 1,268 `vectorized_elementwise_kernel` calls per 128-row flow batch, 133 ms of its
# 1.84 s on an H100, bench/results/gpu_h100_worker26_profile.txt) and, the output being masked, the
# mask multiplies of the resnets and convs that read it. The sums are rounded in another order than
# eager's (the tests hold it to eager within their tolerances). Bench switch `resid`. On: with `temb`
# the flow batch 0.945 of eager's time on an H100 (bench/results/gpu_h100_s36_parts.json; GPU tests
# passed there), and the worker 1.076 / 1.092 with the five stop-33 switches (gpu_h100_worker35ab*.json).
DEFERRED_BIAS = True
# A resnet's time embedding added inside its first block's LayerNorm kernel, before the mask
# ((mish(LN(conv(x))) + mlp(t)[b]) * mask, `fused_layer_norm(row_add=)`), so its second block reads
# an input already masked: the broadcast add and the mask multiply of every resnet (28 of a U-Net pass's
# elementwise kernels) go. The sum is rounded once instead of twice. Bench switch `temb`; on (measured with
# `resid`, above).
TIME_EMBEDDING_IN_NORM = True
_EPILOGUE_DEVICES = ("cuda",)  # where the epilogue runs (a test opens CPU, whose kernel is the exact GELU)
_EPILOGUE_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class EstimatorDims:
    in_channels: int  # 320 = x, mu, spks, cond stacked
    out_channels: int  # 80 mel bins
    channels: int  # U-Net width (official list of one entry)
    attention_head_dim: int
    num_heads: int
    n_blocks: int  # transformer blocks per level
    num_mid_blocks: int
    static_chunk_size: int  # streaming chunk, in mel frames
    num_decoding_left_chunks: int  # <0: all left chunks

    @classmethod
    def from_config(cls, estimator_cfg: dict[str, Any]) -> EstimatorDims:
        channels = list(estimator_cfg["channels"])
        if len(channels) != 1:
            raise ModelDirError(
                f"cosyvoice2.yaml: flow.decoder.estimator.channels = {channels}; only one U-Net level is implemented"
            )
        if estimator_cfg.get("act_fn", "gelu") != "gelu":
            raise ModelDirError(f"cosyvoice2.yaml: estimator act_fn {estimator_cfg['act_fn']!r} is not implemented")
        return cls(
            in_channels=int(estimator_cfg["in_channels"]),
            out_channels=int(estimator_cfg["out_channels"]),
            channels=int(channels[0]),
            attention_head_dim=int(estimator_cfg["attention_head_dim"]),
            num_heads=int(estimator_cfg["num_heads"]),
            n_blocks=int(estimator_cfg["n_blocks"]),
            num_mid_blocks=int(estimator_cfg["num_mid_blocks"]),
            static_chunk_size=int(estimator_cfg.get("static_chunk_size", 0)),
            num_decoding_left_chunks=int(estimator_cfg.get("num_decoding_left_chunks", -1)),
        )


# ---------------------------------------------------------------------------------------------
# LayerNorm, fused on CUDA


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor, mask: torch.Tensor | None = None,
               shift: torch.Tensor | None = None, row_add: torch.Tensor | None = None) -> torch.Tensor:
    """norm(x) over the last dim of x (B, T, C); with mask (B, T, 1), mish(norm(x)) * mask; with
    shift (C,), norm(x + shift); with row_add (B, C) (and a mask), (mish(norm(x)) + row_add[b]) * mask."""
    if FUSED_NORM:  # None on CPU, and wherever else the kernel cannot run
        out = fused_layer_norm(x, norm.weight, norm.bias, norm.eps, mask, shift, row_add)
        if out is not None:
            return out
    y = norm(x if shift is None else x + shift)
    if mask is None:
        return y
    return F.mish(y) * mask if row_add is None else (F.mish(y) + row_add[:, None, :]) * mask


# ---------------------------------------------------------------------------------------------
# Time embedding


def timestep_sinusoids(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """(B,) flow time in [0, 1] -> (B, dim) [sin | cos], computed in fp32 (1000*t is too big for fp16)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    arg = scale * t.float()[:, None] * freq[None, :]
    return torch.cat([arg.sin(), arg.cos()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.linear_1 = nn.Linear(d_in, d)
        self.linear_2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


# ---------------------------------------------------------------------------------------------
# Causal conv blocks, time-major: tensors (B, T, C), masks (B, T, 1)


class CausalConv1d(nn.Conv1d):
    """A causal conv (left context only) run as K matmuls over the rows flattened to (B*T, C_in).

    y[t] = b + sum_k W_k x[t - (K-1) + k]. Shifting the flattened rows reaches into the previous
    row's last K-1 frames, so the caller guarantees those are zero (every row ends in at least
    K-1 masked frames and the input is masked): then each row sees zeros left of its start, as
    the causal left padding gives. The matmuls read the activations in place; the channel-major
    layout with cuDNN convs spent its time in transposes and LayerNorm copies around each conv
    (1.15x slower flow on the H200, bench/results/h200_probe2.json)."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int):
        super().__init__(c_in, c_out, kernel_size)
        self._taps = DerivedWeight(lambda w: w.permute(2, 0, 1).contiguous())  # (K, C_out, C_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, C_in) -> (B, T, C_out)."""
        B, T, C = x.shape
        K, N = self.kernel_size[0], B * T
        taps = self._taps(self.weight)  # (K, C_out, C_in)
        flat = x.reshape(N, C)
        y = F.linear(flat, taps[K - 1], self.bias)  # (N, C_out): the tap on x[t]
        # Tap k reads x[t - s], s = K-1-k: output rows [s, N) take input rows [0, N - s), and the first s
        # rows take nothing (the zeros a left pad would give), so no padded copy of x is made. In place
        # (no copy of y per tap) unless autocast made y fp16 from fp32 taps (the fp32 baseline): then out
        # of place, where autocast casts. The same matmul either way.
        in_place = y.dtype == taps.dtype and not torch.is_autocast_enabled(y.device.type)
        for k in range(K - 1):
            s = K - 1 - k
            if s >= N:
                continue
            if in_place:
                y[s:].addmm_(flat[: N - s], taps[k].t())
            else:
                y = torch.cat([y[:s], torch.addmm(y[s:], flat[: N - s], taps[k].t())])
        return y.view(B, T, -1)


class CausalBlock1D(nn.Module):
    """causal conv k=3 -> LayerNorm(channels) -> Mish, input and output masked."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        # official layout: [conv, transpose, layernorm, transpose, mish]
        self.block = nn.ModuleList([CausalConv1d(c_in, c_out, 3), nn.Identity(), nn.LayerNorm(c_out)])

    def forward(self, x: torch.Tensor, mask: torch.Tensor, masked: bool = False,
                row_add: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, C_in), mask (B, T, 1) -> (B, T, C_out); `masked`: x is already zero outside the
        mask; `row_add` (B, C_out): added to each row's output before the mask."""
        return layer_norm(self.block[2], self.block[0](x if masked else x * mask), mask, row_add=row_add)


class CausalResnetBlock1D(nn.Module):
    def __init__(self, c_in: int, c_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, c_out))
        self.block1 = CausalBlock1D(c_in, c_out)
        self.block2 = CausalBlock1D(c_out, c_out)
        self.res_conv = nn.Conv1d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, t_emb: torch.Tensor, masked: bool = False,
                defer_bias: bool = False) -> torch.Tensor:
        """x (B, T, C_in), mask (B, T, 1), t_emb (B, 4c) -> (B, T, C_out); `masked`: x is already
        zero outside the mask; `defer_bias`: the 1x1 conv's bias left out, for the transformer stack
        that reads the output to add (`TransformerStack`'s `pending`)."""
        x = x if masked else x * mask  # read by block1 and the 1x1 conv
        if TIME_EMBEDDING_IN_NORM:
            h = self.block2(self.block1(x, mask, masked=True, row_add=self.mlp(t_emb).contiguous()), mask, masked=True)
        else:
            h = self.block1(x, mask, masked=True) + self.mlp(t_emb)[:, None, :]  # (B, T, C) + (B, 1, C)
            h = self.block2(h, mask)
        if defer_bias:  # h is block2's own output: accumulate the 1x1 conv into it (cuBLAS's beta=1)
            h.view(-1, h.size(-1)).addmm_(x.reshape(-1, x.size(-1)), self.res_conv.weight[:, :, 0].t())
            return h
        return h + F.linear(x, self.res_conv.weight[:, :, 0], self.res_conv.bias)  # 1x1 conv


# ---------------------------------------------------------------------------------------------
# Transformer block (all tensors (B, T, C))


@dataclass(frozen=True)
class AttentionMask:
    """The keys each query may attend to, in the two forms the attention paths read."""

    dense: torch.Tensor  # (B, T'|1, T') bool: SDPA's mask, (B, 1, T') without chunks
    rows: PaddedRows | None  # without chunks: the same mask as key counts per row (flash varlen)


class SelfAttention(nn.Module):
    """Multi-head self-attention over (B, T', C) rows.

    Non-streaming, the mask is a pure key-padding mask, and on CUDA in fp16/bf16 the attention is one
    FlashAttention varlen call over the padded rows, each limited to its own keys (`padded_attention`:
    no mask tensor, no padded key blocks, no gather or host sync; padding frames' queries still run,
    with the output SDPA gives them, which nothing reads). Elsewhere, or where flash fails (logged
    once), SDPA with the boolean mask, unchanged.
    """

    def __init__(self, d: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(d, inner, bias=False)
        self.to_k = nn.Linear(d, inner, bias=False)
        self.to_v = nn.Linear(d, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, d)])
        self._qkv = stacked()  # to_q, to_k, to_v as one (3 inner, d) matrix: one matmul instead of three

    def forward(self, x: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """x (B, T', C) -> (B, T', C)."""
        return self.to_out[0](self.heads_out(x, mask))

    def heads_out(self, x: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """x (B, T', C) -> the heads' outputs side by side (B, T', H * d_h), before `to_out`."""
        B, T, _ = x.shape
        qkv = F.linear(x, self._qkv(self.to_q.weight, self.to_k.weight, self.to_v.weight)).view(B, T, 3, self.heads, self.head_dim)
        out = padded_attention(qkv, mask.rows) if VARLEN_ATTENTION and mask.rows is not None else None  # (B, T, H, d_h)
        if out is None:
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, d_h) each
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense[:, None]).transpose(1, 2)  # mask (B, 1, T|1, T)
        return out.reshape(B, T, self.heads * self.head_dim)


class _GeluProj(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> gelu(proj(x)) (..., d_out)."""
        if GELU_EPILOGUE and x.device.type in _EPILOGUE_DEVICES and x.dtype in _EPILOGUE_DTYPES:
            flat = x.reshape(-1, x.shape[-1])  # (N, d_in), a view of the LayerNorm's contiguous output
            y = torch._addmm_activation(self.proj.bias, flat, self.proj.weight.t(), use_gelu=True)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, d: int, mult: int = 4):
        super().__init__()
        # official layout: [GELU(proj), dropout, linear]
        self.net = nn.ModuleList([_GeluProj(d, d * mult), nn.Identity(), nn.Linear(d * mult, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn1 = SelfAttention(d, heads, head_dim)
        self.norm3 = nn.LayerNorm(d)
        self.ff = FeedForward(d)

    def forward(self, x: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        x = x + self.attn1(layer_norm(self.norm1, x), mask)
        return x + self.ff(layer_norm(self.norm3, x))

    def biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `accumulate` leaves out of the stream: the attention's and the FFN's output biases."""
        return self.attn1.to_out[0].bias, self.ff.net[2].bias

    def accumulate(self, s: torch.Tensor, mask: AttentionMask, shift_attn: torch.Tensor, shift_ff: torch.Tensor) -> None:
        """`forward` on the residual stream s (B, T', C), in place and without `biases()`. On entry
        s = x - shift_attn (x what `forward` takes, shift_attn the biases the blocks before left out);
        on return s = forward(x) - (shift_ff + b_ff), the next block's shift_attn, where
        shift_ff = shift_attn + b_attn."""
        flat = s.view(-1, s.size(-1))  # (B*T', C)
        heads = self.attn1.heads_out(layer_norm(self.norm1, s, shift=shift_attn), mask)  # (B, T', H*d_h)
        flat.addmm_(heads.reshape(flat.size(0), -1), self.attn1.to_out[0].weight.t())
        hidden = self.ff.net[0](layer_norm(self.norm3, s, shift=shift_ff))  # (B, T', 4C)
        flat.addmm_(hidden.reshape(flat.size(0), -1), self.ff.net[2].weight.t())


def _cumulative(first: torch.Tensor | None, *biases: torch.Tensor) -> torch.Tensor:
    """`first` (C,) or None (zeros) and n biases (C,) -> (n + 1, C): row i the sum of `first` and the
    first i biases, summed in fp32, in the biases' dtype."""
    first = torch.zeros_like(biases[0]) if first is None else first
    return torch.stack([first, *biases]).float().cumsum(0).to(biases[0].dtype)


class TransformerStack(nn.ModuleList):
    """The transformer blocks of one U-Net level (an `nn.ModuleList`, so the official names load)."""

    def __init__(self, blocks: list[TransformerBlock]):
        super().__init__(blocks)
        self._shifts = DerivedWeight(_cumulative)  # (2n + 1, C): the biases before each half-block, then all

    def defers(self, h: torch.Tensor) -> bool:
        """Whether `forward` runs h as a stream with deferred biases (DEFERRED_BIAS, no autocast or
        autograd): then the resnet before may hand over its last bias as `pending`."""
        return DEFERRED_BIAS and len(self) > 0 and not torch.is_autocast_enabled(h.device.type) and not torch.is_grad_enabled()

    def forward(self, h: torch.Tensor, mask: AttentionMask, m: torch.Tensor,
                pending: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """h (B, T', C), m (B, T', 1) -> (output, whether it is already zero outside m). `pending` (C,):
        a bias h still lacks (only where `defers(h)`).

        With DEFERRED_BIAS, h is the stream: written in place (callers hand over a tensor nothing
        else reads), its biases added once at the end, masked."""
        if not self.defers(h):
            if pending is not None:
                raise ValueError("transformer stack: a pending bias only where the stack defers biases")
            for block in self:
                h = block(h, mask)
            return h, False
        shifts = self._shifts(pending, *(b for block in self for b in block.biases()))  # row 0: the pending bias
        if shifts.dtype != h.dtype:
            raise TypeError(f"transformer stack: activations in {h.dtype}, weights in {shifts.dtype}")
        for i, block in enumerate(self):
            block.accumulate(h, mask, shifts[2 * i], shifts[2 * i + 1])
        return h.add_(shifts[-1]).mul_(m), True


# ---------------------------------------------------------------------------------------------
# The U-Net


class CausalConditionalDecoder(nn.Module):
    def __init__(self, dims: EstimatorDims):
        super().__init__()
        self.dims = dims
        c, time_dim = dims.channels, dims.channels * 4
        self.time_mlp = TimestepEmbedding(dims.in_channels, time_dim)

        def blocks() -> TransformerStack:
            return TransformerStack(
                [TransformerBlock(c, dims.num_heads, dims.attention_head_dim) for _ in range(dims.n_blocks)]
            )

        self.down_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(dims.in_channels, c, time_dim), blocks(), CausalConv1d(c, c, 3)])]
        )
        self.mid_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(c, c, time_dim), blocks()]) for _ in range(dims.num_mid_blocks)]
        )
        self.up_blocks = nn.ModuleList(
            [nn.ModuleList([CausalResnetBlock1D(2 * c, c, time_dim), blocks(), CausalConv1d(c, c, 3)])]
        )
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, dims.out_channels, 1)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool = False,
    ) -> torch.Tensor:
        """x, mu, cond (B, 80, T_mel); mask (B, 1, T_mel) 0/1; t (B,); spks (B, 80) -> (B, 80, T_mel).

        Runs in the module's dtype; the mask must be a prefix mask (valid frames first).
        """
        dtype = self.final_proj.weight.dtype
        t_emb = self.time_mlp(timestep_sinusoids(t, self.dims.in_channels).to(dtype))  # (B, 4c)
        T = x.size(2)
        lens = mask[:, 0].sum(dim=1, dtype=torch.int64)  # (B,), counted exactly (a bf16 sum rounds past 256, fp16 past 2048)
        # Time-major from here: (B, T', C) with T' = T + 2 frames of zeros at the end of every row, so
        # the causal convs can run over the flattened rows (CausalConv1d).
        h = torch.cat([x, mu, spks[:, :, None].expand(-1, -1, T), cond], dim=1).to(dtype)  # (B, 320, T)
        h = F.pad(h.transpose(1, 2), (0, 0, 0, CONV_TAIL))  # (B, T', 320)
        m = F.pad(mask.to(dtype).transpose(1, 2), (0, 0, 0, CONV_TAIL))  # (B, T', 1)
        chunk = self.dims.static_chunk_size if streaming else 0
        attn_mask = AttentionMask(
            attention_mask(lens, T + CONV_TAIL, chunk, self.dims.num_decoding_left_chunks),  # (B, T'|1, T')
            PaddedRows.of(lens, T + CONV_TAIL) if chunk == 0 else None,
        )

        # `masked`: h is already zero outside m (a TransformerStack's output), so its readers skip the multiply.
        skips, masked = [], False
        def level(resnet: CausalResnetBlock1D, layers: TransformerStack, h: torch.Tensor, masked: bool):
            """A resnet and its transformer stack; with deferred biases the resnet's last one goes
            to the stack as `pending`."""
            defer = layers.defers(h)
            out = resnet(h, m, t_emb, masked, defer_bias=defer)
            return layers(out, attn_mask, m, pending=resnet.res_conv.bias if defer else None)

        for resnet, layers, down in self.down_blocks:
            h, masked = level(resnet, layers, h, masked)
            skips.append((h, masked))
            h, masked = down(h if masked else h * m), False
        for resnet, layers in self.mid_blocks:
            h, masked = level(resnet, layers, h, masked)
        for resnet, layers, up in self.up_blocks:
            skip, skip_masked = skips.pop()
            h = torch.cat([h[:, : skip.size(1)], skip], dim=2)  # (B, T', 2c)
            h, masked = level(resnet, layers, h, masked and skip_masked)
            h = up(h if masked else h * m)
        h = self.final_block(h, m)  # mish(LN(.)) * m: already zero outside m
        out = F.linear(h, self.final_proj.weight[:, :, 0], self.final_proj.bias) * m  # (B, T', 80)
        return out[:, :T].transpose(1, 2)  # (B, 80, T)
