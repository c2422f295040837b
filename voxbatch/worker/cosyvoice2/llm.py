"""The CosyVoice2 language model (text tokens -> speech tokens): a Qwen2 body between two small heads.

The official `Qwen2LM` feeds Qwen2 with embeddings instead of token ids:

    [sos, embed_tokens(prompt_text ++ text), task_id, speech_embedding(prompt_speech)]

where sos/task_id are rows 0/1 of `llm_embedding`, and reads speech-token log-probs from `llm_decoder`
(speech_token_size + 3 outputs: the speech tokens, then eos and two more stop ids). Qwen2's own
`lm_head` (tied to `embed_tokens`) is never used; it exists so the official `llm.pt` loads strictly.

Decoding keeps the path static (gpt-fast style): one KV cache `(layers, B_max, kv_heads, T_max, head_dim)`
allocated once and written in place; `prefill` runs right-padded prompts of different lengths,
`prefill_packed` the same prompts laid end to end (no padding, one causal flash call per layer, GPU);
`decode_step` runs one token per row at per-row positions; the torch backend captures it (with the sampler) as CUDA graphs on GPU.

Module names mirror the official state dict (`llm.model.model.layers.N.self_attn.q_proj`, ...), so
`llm.pt` loads with `load_state_dict(strict=True, assign=True)` and no renaming table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from voxbatch.model_files import QWEN_DIR
from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError, check_keys, empty_init, load_state_dict, read_config, section
from voxbatch.worker.cosyvoice2 import flash_varlen
from voxbatch.worker.cosyvoice2.derived import stacked
from voxbatch.worker.cosyvoice2.h2d import to_device
from voxbatch.worker.cosyvoice2.rope_kernel import decode_rope_cache

SOS, TASK_ID = 0, 1  # rows of `llm_embedding`


@dataclass(frozen=True)
class LlmDims:
    """Qwen2 sizes from `CosyVoice-BlankEN/config.json`, head sizes from `cosyvoice2.yaml` (`llm:`)."""

    hidden: int  # D: Qwen2 hidden_size (= yaml llm_input_size = llm_output_size)
    intermediate: int  # MLP width
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention: n_heads // n_kv_heads query heads share one K/V head
    head_dim: int
    vocab_size: int  # Qwen text vocabulary (embed_tokens rows)
    rope_theta: float
    rms_norm_eps: float
    speech_token_size: int  # S: speech tokens 0..S-1; S = eos; S+1, S+2 also stop

    @property
    def n_speech(self) -> int:
        """Rows of speech_embedding / outputs of llm_decoder: S speech tokens + eos + 2 more specials."""
        return self.speech_token_size + 3

    @property
    def eos_id(self) -> int:
        return self.speech_token_size

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(self.speech_token_size + i for i in range(3))

    def kv_cache_bytes(self, rows: int, seq: int, dtype: torch.dtype) -> int:
        """Bytes of K and V as `CosyVoice2LM.setup_cache(rows, seq)` allocates them in `dtype`."""
        return 2 * self.n_layers * rows * self.n_kv_heads * seq * self.head_dim * dtype.itemsize

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> LlmDims:
        path = Path(model_dir) / QWEN_DIR / "config.json"
        if not path.is_file():
            raise ModelDirError(f"{path}: missing (the Qwen2 config of the LLM)")
        qwen = json.loads(path.read_text(encoding="utf-8"))
        llm = section(read_config(model_dir), "llm")
        n_heads = qwen["num_attention_heads"]
        dims = cls(
            hidden=qwen["hidden_size"],
            intermediate=qwen["intermediate_size"],
            n_layers=qwen["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=qwen.get("num_key_value_heads", n_heads),
            head_dim=qwen.get("head_dim", qwen["hidden_size"] // n_heads),
            vocab_size=qwen["vocab_size"],
            rope_theta=float(qwen.get("rope_theta", 10000.0)),
            rms_norm_eps=float(qwen.get("rms_norm_eps", 1e-6)),
            speech_token_size=int(llm["speech_token_size"]),
        )
        for key in ("llm_input_size", "llm_output_size"):
            if int(llm[key]) != dims.hidden:
                raise ModelDirError(f"cosyvoice2.yaml: llm.{key}={llm[key]} but {path} has hidden_size={dims.hidden}")
        return dims


# Stacked projections (q/k/v, gate/up) and the one-kernel RMSNorm. The decode step at 256 rows is
# about a thousand small kernels (H200 profile, bench/results), so each kernel fewer is time saved;
# False keeps the layer-by-layer form (the benchmark's A/B).
FUSED_KERNELS = True
# Prefill prompts packed end to end with causal flash attention where it runs (CUDA, fp16/bf16), else
# padded with a masked SDPA; False always pads (the benchmark's A/B, engine on the H200: 279.3x packed
# vs 270.7x padded, bench/results/gpu_h200_worker6.json; medians of two runs each in A B B A order
# 246.8x vs 216.4x, gpu_h200_worker7.json).
PACKED_PREFILL = True
# The decode step's rotary embedding of q and k and its writes of k and v into the cache as one Triton
# kernel per layer (rope_kernel.py) instead of 12 small ones (bench/results/kernel_census.json, `rope=1`),
# bit for bit eager's in fp16/bf16 (small kernels of those kinds are ~19% of a 256-row step's device time,
# bench/results/gpu_h100_worker26_profile.txt).
# Bench switch `rope`; off: not yet measured on a GPU.
FUSED_DECODE_ROPE = False


class RMSNorm(nn.Module):
    """Qwen2's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if FUSED_KERNELS:  # one kernel; in bf16 the scale is applied before the one rounding (HF rounds twice)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin tables (B, T, head_dim) for integer positions (B, T), computed in fp32 as in HF Qwen2."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)  # (head_dim/2,)
    freqs = positions.float()[..., None] * inv_freq  # (B, T, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., head_dim) rotated by cos/sin that broadcast against it (the rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, heads, T, head_dim) by cos/sin (B, T, head_dim)."""
    return rotate(x, cos[:, None], sin[:, None])  # cos/sin (B, 1, T, head_dim)


class FlashUnavailable(RuntimeError):
    """The packed prefill's flash call cannot run here; the caller prefills padded instead."""


def _spans(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Indices starts[b] + [0, counts[b]) for every b, concatenated."""
    first = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return first + np.arange(int(counts.sum()))


@dataclass(frozen=True)
class PackedPrompts:
    """B prompts [sos, text, task_id, prompt speech] laid end to end: N = sum of their lengths positions,
    prompt b at [cu_seq[b], cu_seq[b+1]). Index arrays are built on the host with numpy and reach the
    device as one pinned copy (no host wait, h2d.py)."""

    positions: Tensor  # (N,) position of each entry within its prompt (its RoPE angle, its cache column)
    rows: Tensor  # (N,) the cache row its prompt prefills
    text_at: Tensor  # (n_text,) where the text tokens go
    text_ids: Tensor  # (n_text,)
    speech_at: Tensor  # (n_speech,) where the prompt speech tokens go
    speech_ids: Tensor  # (n_speech,)
    special_at: Tensor  # (2B,) where sos and task_id go
    special_ids: Tensor  # (2B,) rows of llm_embedding: SOS, TASK_ID per prompt
    last: Tensor  # (B,) each prompt's last entry: its logits predict the first speech token
    lengths: Tensor  # (B,) int64 prompt lengths
    cu_seq: Tensor  # (B+1,) int32 prompt starts, as flash reads them
    longest: int
    total: int  # N

    @classmethod
    def of(cls, prompts: Sequence[tuple[list[int], list[int]]], rows: Sequence[int], device: torch.device) -> PackedPrompts:
        n_text = np.array([len(t) for t, _ in prompts], dtype=np.int64)
        n_speech = np.array([len(s) for _, s in prompts], dtype=np.int64)
        lengths = n_text + n_speech + 2
        cu = np.concatenate([[0], np.cumsum(lengths)])
        starts, N, B = cu[:-1], int(cu[-1]), len(prompts)
        parts = {
            "positions": np.arange(N) - np.repeat(starts, lengths),
            "rows": np.repeat(np.asarray(rows, dtype=np.int64), lengths),
            "text_at": _spans(starts + 1, n_text),
            "text_ids": np.fromiter(chain.from_iterable(t for t, _ in prompts), np.int64, int(n_text.sum())),
            "speech_at": _spans(starts + 2 + n_text, n_speech),
            "speech_ids": np.fromiter(chain.from_iterable(s for _, s in prompts), np.int64, int(n_speech.sum())),
            "special_at": np.stack([starts, starts + 1 + n_text], axis=1).reshape(-1),
            "special_ids": np.tile(np.array([SOS, TASK_ID], dtype=np.int64), B),
            "last": cu[1:] - 1,
            "lengths": lengths,
            "cu_seq": cu,
        }
        flat = to_device(np.concatenate(list(parts.values())), torch.int64, device)
        views = dict(zip(parts, flat.split([len(a) for a in parts.values()])))
        views["cu_seq"] = views["cu_seq"].to(torch.int32)
        return cls(**views, longest=int(lengths.max()), total=N)


class Attention(nn.Module):
    """Grouped-query self-attention with biased q/k/v; optionally reads/writes a slice of the KV cache."""

    def __init__(self, d: LlmDims):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = d.n_heads, d.n_kv_heads, d.head_dim
        self.q_proj = nn.Linear(d.hidden, d.n_heads * d.head_dim, bias=True)
        self.k_proj = nn.Linear(d.hidden, d.n_kv_heads * d.head_dim, bias=True)
        self.v_proj = nn.Linear(d.hidden, d.n_kv_heads * d.head_dim, bias=True)
        self.o_proj = nn.Linear(d.n_heads * d.head_dim, d.hidden, bias=False)
        self._qkv_w, self._qkv_b = stacked(), stacked()  # q, k, v projections as one matmul

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, D) -> q (B, T, H*hd), k and v (B, T, KVH*hd)."""
        if not FUSED_KERNELS:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qkv = F.linear(x, self._qkv_w(self.q_proj.weight, self.k_proj.weight, self.v_proj.weight),
                       self._qkv_b(self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return qkv.split([q_dim, kv_dim, kv_dim], dim=-1)

    def forward(
        self,
        x: Tensor,  # (B, T, D)
        cos: Tensor,  # (B, T, head_dim)
        sin: Tensor,
        mask: Tensor,  # (B, 1, T, S) bool, True = may attend; S = T without cache / kv_len when decoding
        cache: tuple[Tensor, Tensor] | None = None,  # this layer's (k, v), each (B_max, kv_heads, T_max, head_dim)
        write_rows: Tensor | None = None,  # prefill: (B,) cache row of each sequence
        write_pos: Tensor | None = None,  # decode: (B,) position each row's token is written at
        kv_len: int = 0,  # decode: how many cache positions to attend over
        kv_used: tuple[Tensor, Tensor] | None = None,  # decode, FA3: flash_varlen.decode_rows of the positions
        packed: PackedPrompts | None = None,  # packed prefill: x is (N, D), cos/sin (N, head_dim)
    ) -> Tensor:
        if packed is not None:
            return self._packed(x, cos, sin, cache, packed)
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if FUSED_DECODE_ROPE and cache is not None and write_pos is not None:
            q_rot = decode_rope_cache(q, k, v, cos, sin, cache[0], cache[1], write_pos)  # (B, H, 1, hd), cache written
            if q_rot is not None:
                return self._attend_cache(q_rot, cache, mask, kv_len, kv_used)
        q = q.reshape(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KVH, T, hd)
        v = v.reshape(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            cache_k, cache_v = cache
            if write_pos is None:  # prefill: rows `write_rows`, positions [0, T); attend within the prompt
                cache_k[write_rows, :, :T] = k  # (B, KVH, T, hd)
                cache_v[write_rows, :, :T] = v
            else:  # decode: T == 1, row b at write_pos[b]; attend over the cache
                rows = torch.arange(B, device=x.device)
                cache_k[rows, :, write_pos] = k[:, :, 0]  # (B, KVH, hd)
                cache_v[rows, :, write_pos] = v[:, :, 0]
                return self._attend_cache(q, cache, mask, kv_len, kv_used)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def _attend_cache(self, q: Tensor, cache: tuple[Tensor, Tensor], mask: Tensor, kv_len: int,
                      kv_used: tuple[Tensor, Tensor] | None) -> Tensor:
        """Decode: q (B, H, 1, hd), this step's k and v already in the cache -> (B, 1, D), each row over
        cache positions [0, kv_len) as `mask` allows (FA3 with its key counts where `kv_used` and it runs)."""
        B = q.shape[0]
        k, v = cache[0][:B, :, :kv_len], cache[1][:B, :, :kv_len]  # (B, KVH, kv_len, hd)
        out = flash_varlen.decode_attention(q, k, v, kv_used) if kv_used is not None else None  # None: FA3 cannot run
        if out is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, 1, self.n_heads * self.head_dim))

    def _packed(self, x: Tensor, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor], packed: PackedPrompts) -> Tensor:
        """Prompts laid end to end, x (N, D): write K/V at each entry's (row, position), attend causally
        within each prompt (flash varlen; grouped-query K/V as they are)."""
        N = x.shape[0]
        q, k, v = self.project(x)
        q = rotate(q.view(N, self.n_heads, self.head_dim), cos[:, None], sin[:, None])  # (N, H, hd)
        k = rotate(k.view(N, self.n_kv_heads, self.head_dim), cos[:, None], sin[:, None])  # (N, KVH, hd)
        v = v.view(N, self.n_kv_heads, self.head_dim)
        cache_k, cache_v = cache
        cache_k[packed.rows, :, packed.positions] = k  # (N, KVH, hd) into (B_max, KVH, T_max, hd)
        cache_v[packed.rows, :, packed.positions] = v
        out = flash_varlen.packed_causal_attention(q, k, v, packed.cu_seq, packed.longest)
        if out is None:
            raise FlashUnavailable("packed causal flash attention cannot run here")
        return self.o_proj(out.reshape(N, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d: LlmDims):
        super().__init__()
        self.gate_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.up_proj = nn.Linear(d.hidden, d.intermediate, bias=False)
        self.down_proj = nn.Linear(d.intermediate, d.hidden, bias=False)
        self._gate_up = stacked()  # gate and up projections as one matmul

    def forward(self, x: Tensor) -> Tensor:
        if not FUSED_KERNELS:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self._gate_up(self.gate_proj.weight, self.up_proj.weight)).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, d: LlmDims):
        super().__init__()
        self.self_attn = Attention(d)
        self.mlp = MLP(d)
        self.input_layernorm = RMSNorm(d.hidden, d.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, **cache_args) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, **cache_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Body(nn.Module):
    """Qwen2 without its head: embeddings in, final-normed hidden states out (HF's `hidden_states[-1]`)."""

    def __init__(self, d: LlmDims):
        super().__init__()
        self.dims = d
        self.embed_tokens = nn.Embedding(d.vocab_size, d.hidden)
        self.layers = nn.ModuleList(DecoderLayer(d) for _ in range(d.n_layers))
        self.norm = RMSNorm(d.hidden, d.rms_norm_eps)

    def forward(
        self,
        x: Tensor,  # (B, T, D) input embeddings
        positions: Tensor,  # (B, T) int
        mask: Tensor,  # (B, 1, T, S) bool
        cache: tuple[Tensor, Tensor] | None = None,  # (layers, B_max, KVH, T_max, hd) each
        write_rows: Tensor | None = None,
        write_pos: Tensor | None = None,
        kv_len: int = 0,
        kv_used: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        cos, sin = rope_cos_sin(positions, self.dims.head_dim, self.dims.rope_theta, x.dtype)
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else (cache[0][i], cache[1][i])
            x = layer(x, cos, sin, mask, cache=layer_cache, write_rows=write_rows, write_pos=write_pos, kv_len=kv_len,
                      kv_used=kv_used)
        return self.norm(x)

    def packed(self, x: Tensor, packed: PackedPrompts, cache: tuple[Tensor, Tensor]) -> Tensor:
        """Prompts laid end to end (N, D) -> final-normed hidden states (N, D), K/V written to `cache`."""
        cos, sin = rope_cos_sin(packed.positions, self.dims.head_dim, self.dims.rope_theta, x.dtype)  # (N, hd)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None, cache=(cache[0][i], cache[1][i]), packed=packed)
        return self.norm(x)


class _Qwen2ForCausalLM(nn.Module):
    """Official `llm.model` (HF Qwen2ForCausalLM): the body plus the tied text head we never call."""

    def __init__(self, d: LlmDims):
        super().__init__()
        self.model = Qwen2Body(d)
        self.lm_head = nn.Linear(d.hidden, d.vocab_size, bias=False)


class _Qwen2Encoder(nn.Module):
    """Official `llm` (Qwen2Encoder): a wrapper whose only child is `model`."""

    def __init__(self, d: LlmDims):
        super().__init__()
        self.model = _Qwen2ForCausalLM(d)


def padding_causal_mask(lengths: Tensor, T: int) -> Tensor:
    """(B, 1, T, T) bool: query t may see key s when s <= t and s < length (right padding)."""
    idx = torch.arange(T, device=lengths.device)
    causal = idx[None, :] <= idx[:, None]  # (T, T)
    valid = idx[None, :] < lengths[:, None]  # (B, T)
    return (causal[None] & valid[:, None, :])[:, None]


class CosyVoice2LM(nn.Module):
    """`Qwen2LM` for inference: input sequence building, a teacher-forced forward, prefill and decode."""

    def __init__(self, d: LlmDims):
        super().__init__()
        self.dims = d
        self.llm_embedding = nn.Embedding(2, d.hidden)  # row 0 = sos, row 1 = task_id
        self.llm = _Qwen2Encoder(d)
        self.llm_decoder = nn.Linear(d.hidden, d.n_speech)
        self.speech_embedding = nn.Embedding(d.n_speech, d.hidden)
        # KV cache (layers, B_max, KVH, T_max, hd): buffers written in place, so a captured decode step may mutate them
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)

    @property
    def body(self) -> Qwen2Body:
        return self.llm.model.model

    # -- loading -----------------------------------------------------------------------------------

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> CosyVoice2LM:
        """Build on the meta device, then adopt `llm.pt`'s tensors, read onto `device` and cast there
        (strict keys, errors name the file)."""
        dims = LlmDims.from_model_dir(model_dir)
        with empty_init():
            model = cls(dims)
        state = load_state_dict(model_dir, "llm.pt", device)
        check_keys(str(Path(model_dir) / "llm.pt"), set(state), set(model.state_dict()))
        for name, expected in model.state_dict().items():
            if state[name].shape != expected.shape:
                raise ModelDirError(f"{Path(model_dir) / 'llm.pt'}: {name} has shape {tuple(state[name].shape)}, expected {tuple(expected.shape)}")
        model.load_state_dict(state, strict=True, assign=True)
        model.llm.model.lm_head.weight = model.body.embed_tokens.weight  # tied, as in the official file
        return model.to(device=device, dtype=dtype).eval()

    # -- the input sequence ------------------------------------------------------------------------

    def embed_prompt(self, text_tokens: Tensor, prompt_speech_tokens: Tensor) -> Tensor:
        """(T_text,), (T_tok,) ids -> (1 + T_text + 1 + T_tok, D): [sos, text, task_id, prompt speech]."""
        w = self.llm_embedding.weight
        return torch.cat(
            [w[SOS : SOS + 1], self.body.embed_tokens(text_tokens), w[TASK_ID : TASK_ID + 1], self.speech_embedding(prompt_speech_tokens)]
        )

    def embed_batch(self, prompts: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor]:
        """[(text ids, prompt speech ids)] -> right-padded embeddings (B, T, D) and lengths (B,)."""
        dev = self.llm_decoder.weight.device
        seqs = [self.embed_prompt(torch.tensor(t, dtype=torch.long, device=dev), torch.tensor(s, dtype=torch.long, device=dev)) for t, s in prompts]
        lengths = torch.tensor([len(s) for s in seqs], device=dev)
        return nn.utils.rnn.pad_sequence(seqs, batch_first=True), lengths

    def logp(self, hidden: Tensor) -> Tensor:
        """Hidden states (..., D) -> speech-token log-probs (..., S+3) in fp32."""
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    # -- teacher forcing (no cache) -----------------------------------------------------------------

    def forward(self, embeds: Tensor, lengths: Tensor) -> Tensor:
        """Full-sequence path: (B, T, D) right-padded embeddings -> log-probs (B, T, S+3)."""
        B, T, _ = embeds.shape
        positions = torch.arange(T, device=embeds.device).expand(B, T)
        return self.logp(self.body(embeds, positions, padding_causal_mask(lengths, T)))

    # -- decoding with the static KV cache ----------------------------------------------------------

    def setup_cache(self, batch_max: int, seq_max: int) -> None:
        """Allocate the KV cache once; decoding writes into it in place (CUDA-graph safe)."""
        d, p = self.dims, self.llm_decoder.weight
        shape = (d.n_layers, batch_max, d.n_kv_heads, seq_max, d.head_dim)
        self.cache_k = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.cache_v = torch.zeros(shape, device=p.device, dtype=p.dtype)

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(B_max, T_max) of the allocated cache."""
        if self.cache_k is None:
            raise RuntimeError("call setup_cache() before prefill/decode_step")
        return self.cache_k.shape[1], self.cache_k.shape[3]

    def prefill(self, embeds: Tensor, lengths: Tensor, all_positions: bool = False, rows: Tensor | None = None) -> Tensor:
        """Run right-padded prompts (B, T, D) into cache rows `rows` (B,) (default [0, B)).

        Returns the log-probs of the token after each prompt (B, S+3), or at every position (B, T, S+3).
        Padded positions write garbage into the cache; decoding overwrites each before it is attended.
        """
        B, T, _ = embeds.shape
        b_max, t_max = self.cache_shape
        if T > t_max or (rows is None and B > b_max):
            raise ValueError(f"prefill of {B}x{T} does not fit the KV cache ({b_max}x{t_max})")
        positions = torch.arange(T, device=embeds.device).expand(B, T)
        rows = torch.arange(B, device=embeds.device) if rows is None else rows
        mask = padding_causal_mask(lengths, T)
        hidden = self.body(embeds, positions, mask, cache=(self.cache_k, self.cache_v), write_rows=rows)  # (B, T, D)
        if all_positions:
            return self.logp(hidden)
        last = hidden[torch.arange(B, device=embeds.device), lengths - 1]  # (B, D)
        return self.logp(last)

    def packed_ready(self) -> bool:
        """Whether `prefill_packed` can run for this model's device and dtype (PACKED_PREFILL on)."""
        p = self.llm_decoder.weight
        return PACKED_PREFILL and flash_varlen.packed_causal_ready(p.device, p.dtype)

    def prefill_packed(self, prompts: Sequence[tuple[list[int], list[int]]], rows: Sequence[int]) -> tuple[Tensor, Tensor]:
        """[(text ids, prompt speech ids)] into cache rows `rows`, laid end to end (no padding) ->
        (log-probs of the token after each prompt (B, S+3), prompt lengths (B,)).

        Same result as `embed_batch` + `prefill` up to the attention kernel's rounding; raises
        FlashUnavailable (before any cache write) where flash cannot run, or (after some) where its
        call fails: the caller prefills padded, which rewrites those rows."""
        if not self.packed_ready():
            raise FlashUnavailable("packed prefill needs flash attention (CUDA, fp16/bf16)")
        w = self.llm_decoder.weight
        b_max, t_max = self.cache_shape
        packed = PackedPrompts.of(prompts, rows, w.device)
        if packed.longest > t_max or max(rows, default=0) >= b_max:
            raise ValueError(f"packed prefill of {len(prompts)} prompts (longest {packed.longest}) does not fit the KV cache ({b_max}x{t_max})")
        x = torch.empty((packed.total, self.dims.hidden), device=w.device, dtype=w.dtype)  # (N, D)
        x[packed.special_at] = self.llm_embedding(packed.special_ids)
        x[packed.text_at] = self.body.embed_tokens(packed.text_ids)
        x[packed.speech_at] = self.speech_embedding(packed.speech_ids)
        hidden = self.body.packed(x, packed, (self.cache_k, self.cache_v))  # (N, D)
        return self.logp(hidden[packed.last]), packed.lengths

    def decode_step(self, tokens: Tensor, positions: Tensor, kv_len: int | None = None) -> Tensor:
        """One speech token per row (B,) at per-row positions (B,) -> next-token log-probs (B, S+3).

        Row b of the batch is cache row b. `kv_len` bounds attention to cache positions [0, kv_len)
        (it must exceed every position); a fixed kv_len keeps shapes static for CUDA-graph capture.
        """
        kv_len = self.cache_shape[1] if kv_len is None else kv_len
        x = self.speech_embedding(tokens)[:, None]  # (B, 1, D)
        keys = torch.arange(kv_len, device=tokens.device)
        mask = (keys[None, :] <= positions[:, None])[:, None, None]  # (B, 1, 1, kv_len)
        used = flash_varlen.decode_rows(positions) if flash_varlen.DECODE_FA3 else None  # the same keys as counts per row
        hidden = self.body(x, positions[:, None], mask, cache=(self.cache_k, self.cache_v), write_pos=positions, kv_len=kv_len,
                           kv_used=used)
        return self.logp(hidden[:, 0])  # (B, S+3)
