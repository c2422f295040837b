"""The flow's token encoder: an upsampling conformer (official `UpsampleConformerEncoder`).

Speech tokens (25 Hz) become mel-rate hidden states (50 Hz):

    embed (linear + layernorm, x * sqrt(D)) -> pre-lookahead conv (sees 3 future tokens)
    -> conformer blocks (rel-pos self-attention + feed-forward) -> 2x nearest upsample + causal conv
    -> up_embed -> 4 conformer blocks -> after_norm

Batched with padding: every row behaves exactly as if it were run alone. The two places where a
row could see its neighbours' padding are handled explicitly: the lookahead conv (its right context
is zeroed beyond each row's length, as a single call would pad it) and attention (padding keys are
masked). The upsample conv is causal, so valid frames never read padded ones.

Streaming ("one non-final chunk"): the caller's last `pre_lookahead_len` tokens are right context for
the lookahead conv only; they produce no output frames. Attention uses static chunk masks (chunk of
`static_chunk_size` tokens before upsampling, `static_chunk_size * stride` frames after).

Module and parameter names mirror the official ones so `flow.pt` loads unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError

# Hard-coded by the official UpsampleConformerEncoder whatever the yaml says.
NUM_UP_BLOCKS = 4

# The rel-pos attention without chunks as one SDPA call: the position term (q+v)p, scaled, with the
# padding keys at -inf, is its additive mask, and the content term (q+u)k, the softmax and the values
# run inside the fused kernel. The eager form writes and reads the (B, H, T, T) scores ~13 times (two
# matmuls, the sum, the scale, two masked fills, the softmax): with 128 rows at ~1,000 frames that is
# ~2 GB a pass, and its masked fills and batched matmuls took ~90 ms of a flow batch's 1.84 s of device
# time on an H100 (bench/results/gpu_h100_worker26_profile.txt). Here the position term is written
# once (into rows padded to 16 elements, the alignment the fused kernels want of a mask) and read
# once. Streaming (chunk masks, where a padding query may see no key) keeps the eager form. Bench
# switch `enc_sdpa`. Off: the flow batch 0.969 / 0.965 of eager's time alone on an H100 (gpu_h100_parts35,
# gpu_h100_s36_parts: one of two timings lost there), but with `snake_epi` the worker ran 1.004 of the
# shipped one's speed over two rounds, inside its spread (bench/results/gpu_h100_s36c_worker.json).
ENCODER_SDPA = False
MASK_ALIGN = 16  # elements: row stride of the additive mask


@dataclass(frozen=True)
class EncoderDims:
    input_size: int  # D_in of the token embeddings (512)
    output_size: int  # D, attention width (512)
    attention_heads: int
    linear_units: int  # feed-forward hidden width
    num_blocks: int  # conformer blocks before upsampling
    static_chunk_size: int  # streaming chunk, in tokens (25)
    pre_lookahead_len: int = 3  # future tokens the lookahead conv sees
    up_stride: int = 2  # token -> mel frame ratio

    @classmethod
    def from_config(cls, flow_cfg: dict[str, Any]) -> EncoderDims:
        enc = flow_cfg["encoder"]
        unsupported = {
            "input_layer": ("linear", enc.get("input_layer")),
            "pos_enc_layer_type": ("rel_pos_espnet", enc.get("pos_enc_layer_type")),
            "selfattention_layer_type": ("rel_selfattn", enc.get("selfattention_layer_type")),
            "use_cnn_module": (False, enc.get("use_cnn_module")),
            "macaron_style": (False, enc.get("macaron_style")),
            "normalize_before": (True, enc.get("normalize_before", True)),
        }
        for key, (want, got) in unsupported.items():
            if got != want:
                raise ModelDirError(f"cosyvoice2.yaml: flow.encoder.{key} = {got!r}; only {want!r} is implemented")
        return cls(
            input_size=int(enc["input_size"]),
            output_size=int(enc["output_size"]),
            attention_heads=int(enc["attention_heads"]),
            linear_units=int(enc["linear_units"]),
            num_blocks=int(enc["num_blocks"]),
            static_chunk_size=int(enc.get("static_chunk_size", 0)),
            pre_lookahead_len=int(flow_cfg.get("pre_lookahead_len", 3)),
            up_stride=int(flow_cfg.get("token_mel_ratio", 2)),
        )


# ---------------------------------------------------------------------------------------------
# Masks (shared with the estimator)


def length_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B,) lengths -> (B, T) bool, True on valid frames."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def attention_mask(lengths: torch.Tensor, T: int, chunk_size: int = 0, left_chunks: int = -1) -> torch.Tensor:
    """Which keys each query may attend to: (B, 1, T) padding-only, or (B, T, T) with chunks.

    With `chunk_size > 0`, query i sees keys of its own chunk and of earlier chunks (all of them when
    `left_chunks < 0`), as the official static-chunk streaming mask; padding keys are always masked.
    """
    keys = length_mask(lengths, T)[:, None, :]  # (B, 1, T)
    if chunk_size <= 0:
        return keys
    pos = torch.arange(T, device=lengths.device)
    chunk_of = pos // chunk_size
    end = ((chunk_of + 1) * chunk_size)[:, None]  # (T, 1): first key past the query's chunk
    allowed = pos[None, :] < end  # (T, T)
    if left_chunks >= 0:
        start = ((chunk_of - left_chunks).clamp(min=0) * chunk_size)[:, None]
        allowed = allowed & (pos[None, :] >= start)
    return keys & allowed[None]  # (B, T, T)


# ---------------------------------------------------------------------------------------------
# Input layer and relative positions


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(D) (the espnet rel-pos encoding adds nothing to x)."""

    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(d_in, d), nn.LayerNorm(d, eps=1e-5))
        self.xscale = math.sqrt(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale  # (B, T, D)


def relative_positions(T: int, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoids of relative distances T-1, T-2, ..., 0, ..., -(T-1): (1, 2T-1, D).

    Row k encodes distance (query - key) = T-1-k, the espnet layout the official weights were
    trained with.
    """
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d))
    dist = torch.arange(T - 1, -T, -1, dtype=torch.float32, device=device)[:, None]  # (2T-1, 1)
    pe = torch.zeros(2 * T - 1, d, dtype=torch.float32, device=device)
    pe[:, 0::2] = torch.sin(dist * div)
    pe[:, 1::2] = torch.cos(dist * div)
    return pe[None].to(dtype)


def _take_relative(bd: torch.Tensor) -> torch.Tensor:
    """(B, H, T, 2T-1) scores per distance row -> (B, H, T, T) scores per key.

    out[..., i, j] = bd[..., i, (T-1) - i + j], i.e. the row for distance i-j; done as a strided
    view of the contiguous scores (offset T-1, row stride 2T-2).
    """
    bd = bd.contiguous()
    B, H, T, _ = bd.shape
    s = bd.stride()
    return bd.as_strided((B, H, T, T), (s[0], s[1], 2 * T - 2, 1), bd.storage_offset() + T - 1)


# ---------------------------------------------------------------------------------------------
# Conformer block (no macaron, no conv module: what CosyVoice2 uses)


class RelPositionSelfAttention(nn.Module):
    """Transformer-XL style attention: content term (q+u)k and position term (q+v)p."""

    def __init__(self, heads: int, d: int):
        super().__init__()
        self.h, self.d_k = heads, d // heads
        self.linear_q = nn.Linear(d, d)
        self.linear_k = nn.Linear(d, d)
        self.linear_v = nn.Linear(d, d)
        self.linear_out = nn.Linear(d, d)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (B, T, D), mask (B, 1|T, T) keys each query may see, pos (1, 2T-1, D) -> (B, T, D)."""
        B, T, _ = x.shape
        q = self.linear_q(x).view(B, T, self.h, self.d_k)  # (B, T, H, d_k)
        k = self.linear_k(x).view(B, T, self.h, self.d_k).transpose(1, 2)  # (B, H, T, d_k)
        v = self.linear_v(x).view(B, T, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos).view(1, -1, self.h, self.d_k).transpose(1, 2)  # (1, H, 2T-1, d_k)
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # (B, H, T, d_k)
        q_v = (q + self.pos_bias_v).transpose(1, 2)
        if ENCODER_SDPA and mask.size(1) == 1:  # padding keys only: every query has a key (lengths >= 1)
            scale = self.d_k**-0.5
            bd = _take_relative((q_v * scale) @ p.transpose(-2, -1))  # (B, H, T, T), a strided view
            bias = torch.empty(B, self.h, T, -(-T // MASK_ALIGN) * MASK_ALIGN, dtype=bd.dtype, device=bd.device)[..., :T]
            torch.where(mask[:, None], bd, bd.new_full((), float("-inf")), out=bias)  # a fill on the device, no copy from the host
            out = F.scaled_dot_product_attention(q_u, k, v, attn_mask=bias, scale=scale)  # (B, H, T, d_k)
            return self.linear_out(out.transpose(1, 2).reshape(B, T, self.h * self.d_k))
        ac = q_u @ k.transpose(-2, -1)  # (B, H, T, T)
        bd = _take_relative(q_v @ p.transpose(-2, -1))  # (B, H, T, 2T-1) -> (B, H, T, T)
        scores = (ac + bd) / math.sqrt(self.d_k)
        masked = ~mask[:, None]  # (B, 1, T|1, T)
        attn = scores.masked_fill(masked, float("-inf")).softmax(dim=-1).masked_fill(masked, 0.0)
        out = (attn @ v).transpose(1, 2).reshape(B, T, self.h * self.d_k)  # (B, T, D)
        return self.linear_out(out)


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(d, hidden)
        self.w_2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))  # official activation: swish


class ConformerLayer(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + ff(norm(x))."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPositionSelfAttention(heads, d)
        self.feed_forward = FeedForward(d, hidden)
        self.norm_mha = nn.LayerNorm(d, eps=1e-5)
        self.norm_ff = nn.LayerNorm(d, eps=1e-5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos)
        return x + self.feed_forward(self.norm_ff(x))


# ---------------------------------------------------------------------------------------------
# Lookahead and upsampling


class PreLookaheadLayer(nn.Module):
    """Conv over [t, t+L] (leaky relu), then causal conv k=3, residual. Input (B, T, D)."""

    def __init__(self, channels: int, lookahead: int):
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, D), zero beyond each row's tokens (incl. any right-context tokens).
        h = F.pad(x.transpose(1, 2), (0, self.lookahead))  # (B, D, T + L)
        h = F.leaky_relu(self.conv1(h))  # (B, D, T)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # causal
        return h.transpose(1, 2) + x  # (B, T, D)


class Upsample1D(nn.Module):
    """Nearest x`stride`, then a causal conv of width 2*stride+1. (B, D, T) -> (B, D, stride*T)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(h, (2 * self.stride, 0)))


# ---------------------------------------------------------------------------------------------
# The encoder


class UpsampleConformerEncoder(nn.Module):
    def __init__(self, dims: EncoderDims):
        super().__init__()
        self.dims = dims
        d = dims.output_size
        self.embed = LinearEmbed(dims.input_size, d)
        self.pre_lookahead_layer = PreLookaheadLayer(d, dims.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            [ConformerLayer(d, dims.attention_heads, dims.linear_units) for _ in range(dims.num_blocks)]
        )
        self.up_layer = Upsample1D(d, dims.up_stride)
        self.up_embed = LinearEmbed(dims.input_size, d)
        self.up_encoders = nn.ModuleList(
            [ConformerLayer(d, dims.attention_heads, dims.linear_units) for _ in range(NUM_UP_BLOCKS)]
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    def mel_lengths(self, token_lens: list[int], finalize: bool = True) -> list[int]:
        """Host-side twin of the lengths `forward` returns: frames per row for its token count."""
        cut = 0 if finalize else self.dims.pre_lookahead_len
        return [(n - cut) * self.dims.up_stride for n in token_lens]

    def forward(
        self, xs: torch.Tensor, xs_lens: torch.Tensor, streaming: bool = False, finalize: bool = True,
        host_lens: list[int] | None = None,  # xs_lens on the host, if the caller has them: no device read-back
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """xs (B, T_tok, D_in) padded embeddings, xs_lens (B,) -> (B, T_mel, D), mel lengths (B,).

        `finalize=False`: the last `pre_lookahead_len` tokens of each row are right context only,
        so each row yields `stride * (len - pre_lookahead_len)` frames.
        """
        dims = self.dims
        T = xs.size(1)
        x = self.embed(xs) * length_mask(xs_lens, T)[..., None].to(xs.dtype)  # (B, T_tok, D), pad = 0
        x = self.pre_lookahead_layer(x)
        lens = xs_lens
        host = xs_lens.tolist() if host_lens is None else host_lens
        left = [n - (0 if finalize else dims.pre_lookahead_len) for n in host]  # tokens each row encodes
        if not finalize:
            lens = xs_lens - dims.pre_lookahead_len
            x = x[:, : max(left)]
        if min(left) <= 0:
            raise ValueError("flow encoder: a row has no tokens left to encode")
        x = self._run(self.encoders, x, lens, dims.static_chunk_size if streaming else 0)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)  # (B, stride*T_tok, D)
        lens = lens * dims.up_stride
        x = self.up_embed(x)
        x = self._run(self.up_encoders, x, lens, dims.static_chunk_size * dims.up_stride if streaming else 0)
        return self.after_norm(x), lens

    @staticmethod
    def _run(layers: nn.ModuleList, x: torch.Tensor, lens: torch.Tensor, chunk: int) -> torch.Tensor:
        T = x.size(1)
        mask = attention_mask(lens, T, chunk)
        pos = relative_positions(T, x.size(2), x.device, x.dtype)
        for layer in layers:
            x = layer(x, mask, pos)
        return x
