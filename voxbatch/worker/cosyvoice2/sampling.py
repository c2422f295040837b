"""Repetition-aware sampling (RAS, VALL-E 2) as the official CosyVoice2 HF path does it, batched on device.

One step of the official sampler for one sequence:
  1. nucleus: sort the softmax descending; keep tokens while the mass before them is < top_p and fewer
     than top_k are kept; draw one of them proportionally to its probability;
  2. repetition check: if the drawn token occurs in the last `win_size` decoded tokens at least
     `win_size * tau_r` times, draw again from the whole softmax instead.
Before min_len tokens, the eos log-prob is set to -inf; any of the three stop ids ends the sequence.

The batched version (`ras_sample`) does both draws for every row with no host sync and picks one with
`torch.where`. Its uniforms come from a counter-based hash of (seed, step, draw), where step is the
row's own decoded count, computed with integer ops on the device (same bits on CPU and GPU), so a
row's draws depend on its own seed and step only, never on its batch neighbours. (Its tokens are then
batch-independent wherever the logits are: exactly so in fp32; bf16 GEMMs round differently for
different batch shapes.) Both LLM backends draw with `sample_tokens`: the torch backend inside its
decode graph, the vLLM backend in its logits processor (ras.py), so a seed gives the same tokens in
either. `ras_log_probs` is the closed form of the distribution one step draws from. `OfficialRas`
instead replays the official torch-RNG draws for one sequence (bit-exact parity with the reference
tokens); it syncs every step and is for tests only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from voxbatch.models import RAS_TAU_R, RAS_TOP_K, RAS_TOP_P, RAS_WIN_SIZE
from voxbatch.worker.cosyvoice2.checkpoint import read_config, section
from voxbatch.worker.cosyvoice2.h2d import to_device

_M32 = 0xFFFFFFFF
_DRAW_NUCLEUS, _DRAW_FULL = 1, 2  # stream ids of the two uniforms drawn at each step


@dataclass(frozen=True)
class RasConfig:
    """The yaml `llm.sampling` (`ras_sampling`) parameters."""

    top_p: float = RAS_TOP_P
    top_k: int = RAS_TOP_K
    win_size: int = RAS_WIN_SIZE
    tau_r: float = RAS_TAU_R

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> RasConfig:
        s = section(read_config(model_dir), "llm", "sampling")
        return cls(top_p=float(s["top_p"]), top_k=int(s["top_k"]), win_size=int(s["win_size"]), tau_r=float(s["tau_r"]))


# -- counter-based uniforms ------------------------------------------------------------------------


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit avalanche mixer on int64 tensors holding values in [0, 2^32).

    xorshift-multiply rounds; multipliers stay below 2^31 so every product fits in int64 without
    overflow, and the same integer ops give the same bits on CPU and GPU.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    x = x ^ (x >> 13)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def seed_keys(seeds: list[int], device: torch.device | str) -> Tensor:
    """Per-row 32-bit keys (B,) int64 from arbitrary Python-int seeds (folded to 64 bits first)."""
    lo_hi = [((s & (2**64 - 1)) & _M32, ((s & (2**64 - 1)) >> 32) & _M32) for s in seeds]
    lo = to_device([a for a, _ in lo_hi], torch.int64, device)
    hi = to_device([b for _, b in lo_hi], torch.int64, device)
    return _mix32(_mix32(lo) ^ hi)


def uniforms(keys: Tensor, step: Tensor | int, draw: int) -> Tensor:
    """U[0, 1) per row (B,) float32, a pure function of (key, step, draw): 24 random bits, exact in fp32."""
    step_t = torch.as_tensor(step, dtype=torch.int64, device=keys.device) & _M32
    h = _mix32(keys ^ _mix32(step_t ^ (draw * 0x9E3779B9 & _M32)))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Index drawn from unnormalised probs (B, N) with uniforms u (B,): first i with cumsum_i > u * total.

    Zero-probability entries can never be drawn (their cumsum equals their predecessor's).
    """
    cdf = probs.cumsum(dim=-1)  # (B, N)
    target = u[:, None] * cdf[:, -1:]
    idx = (cdf <= target).sum(dim=-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


# -- the sampler -----------------------------------------------------------------------------------


def mask_eos(logp: Tensor, n_decoded: Tensor, min_tokens: Tensor, eos_id: int) -> Tensor:
    """logp (B, V) with eos at -inf for rows that have decoded fewer than min_tokens (official min_len)."""
    out = logp.clone()
    out[:, eos_id] = torch.where(n_decoded < min_tokens, float("-inf"), logp[:, eos_id])
    return out


def nucleus_sample(logp: Tensor, u: Tensor, top_p: Tensor | float, top_k: Tensor | int) -> Tensor:
    """Official nucleus step, batched: logp (B, V), u (B,) -> token ids (B,)."""
    probs = logp.softmax(dim=-1)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True, stable=True)  # (B, V)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # (B, V): mass of the tokens ranked above
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_p = torch.as_tensor(top_p, device=probs.device, dtype=probs.dtype).reshape(-1, 1)
    top_k = torch.as_tensor(top_k, device=probs.device).reshape(-1, 1)
    keep = (mass_before < top_p) & (rank[None, :] < top_k)
    keep[:, 0] = True  # the official loop always keeps the top token
    pick = _inverse_cdf(sorted_p * keep, u)  # (B,) rank within the sorted order
    return sorted_idx.gather(-1, pick[:, None])[:, 0]


def random_sample(logp: Tensor, u: Tensor) -> Tensor:
    """Official fallback: draw from the whole softmax (vocabulary order), logp (B, V) -> (B,)."""
    return _inverse_cdf(logp.softmax(dim=-1), u)


def ras_sample(
    logp: Tensor,  # (B, V) log-probs, eos already masked where needed
    recent: Tensor,  # (B, W) the last W decoded tokens, oldest first, -1 where there are fewer
    u_nucleus: Tensor,  # (B,) uniforms for the nucleus draw
    u_full: Tensor,  # (B,) uniforms for the fallback draw
    top_p: Tensor | float = RAS_TOP_P,
    top_k: Tensor | int = RAS_TOP_K,
    win_size: Tensor | int = RAS_WIN_SIZE,
    tau_r: Tensor | float = RAS_TAU_R,
) -> Tensor:
    """The two-step RAS procedure for a batch; a plain callable so tests can Monte-Carlo it."""
    top = nucleus_sample(logp, u_nucleus, top_p, top_k)
    W = recent.shape[-1]
    win = torch.as_tensor(win_size, device=logp.device).reshape(-1, 1)
    in_window = torch.arange(W, device=logp.device)[None, :] >= W - win  # (B, W): the last win_size slots
    reps = ((recent == top[:, None]) & in_window).sum(dim=-1)  # (B,)
    threshold = torch.as_tensor(win_size, device=logp.device) * torch.as_tensor(tau_r, device=logp.device)
    return torch.where(reps >= threshold, random_sample(logp, u_full), top)


def sample_tokens(
    logp: Tensor,  # (B, V) raw log-probs of the next token
    n_decoded: Tensor,  # (B,) tokens each row has decoded so far
    min_tokens: Tensor,  # (B,) eos is masked while n_decoded < min_tokens
    recent: Tensor,  # (B, W) last decoded tokens, -1 where fewer
    keys: Tensor,  # (B,) per-row seed keys (`seed_keys`)
    top_p: Tensor,  # (B,)
    top_k: Tensor,  # (B,)
    win_size: Tensor,  # (B,)
    tau_r: Tensor,  # (B,)
    greedy: Tensor,  # (B,) bool: argmax instead of RAS
    eos_id: int,
) -> Tensor:
    """One decoding step's token choice for every row: eos mask, then RAS (or argmax). Pure; compilable.

    The uniforms hash each row's own decoded count, so a row's draws never depend on its neighbours
    or on when it joined the batch.
    """
    logp = mask_eos(logp.float(), n_decoded, min_tokens, eos_id)
    u1 = uniforms(keys, n_decoded, _DRAW_NUCLEUS)
    u2 = uniforms(keys, n_decoded, _DRAW_FULL)
    drawn = ras_sample(logp, recent, u1, u2, top_p, top_k, win_size, tau_r)
    return torch.where(greedy, logp.argmax(dim=-1), drawn)


def ras_log_probs(
    logits: Tensor,  # (R, V) float32 raw logits
    window: Tensor,  # (R, W) int64, the last win_size decoded tokens, -1 where empty
    top_p: Tensor,  # (R,) float32
    top_k: Tensor,  # (R,) int64
    rep_threshold: Tensor,  # (R,) float32, integer valued: ceil(win_size * tau_r)
    mask_eos: Tensor,  # (R,) bool: fewer than min_tokens decoded
    greedy: Tensor,  # (R,) bool
    eos_id: int,
) -> Tensor:
    """log P of one RAS step in closed form per row (greedy rows: the eos-masked logits). (R, V) float32.

    The two-step sampler draws from the mixture
        P(x) = q(x) * [x not in R] + q(R) * p(x),    R = tokens repeated >= win_size * tau_r times,
    q the nucleus distribution, p the full softmax. Tests check samplers against it.
    """
    R, V = logits.shape
    col = torch.arange(V, device=logits.device)
    eos_col = (col == eos_id).unsqueeze(0)  # (1, V)
    scores = logits.masked_fill(mask_eos.unsqueeze(1) & eos_col, float("-inf"))

    p = scores.softmax(dim=-1)  # (R, V) the full distribution of the fallback draw
    sorted_p, order = p.sort(dim=-1, descending=True, stable=True)  # (R, V)
    # Running mass before each token: the official loop's sequential sum, shifted by one.
    mass_before = torch.nn.functional.pad(torch.cumsum(sorted_p, dim=-1)[:, :-1], (1, 0))
    rank = col.unsqueeze(0)  # (1, V)
    keep = (mass_before < top_p.unsqueeze(1)) & (rank < top_k.unsqueeze(1))
    q_sorted = sorted_p * keep
    q_sorted = q_sorted / q_sorted.sum(dim=-1, keepdim=True)
    q = torch.zeros_like(p).scatter_(1, order, q_sorted)  # (R, V) nucleus distribution

    counts = torch.zeros_like(p).scatter_add_(1, window.clamp(min=0), (window >= 0).to(p.dtype))  # (R, V)
    repeated = counts >= rep_threshold.unsqueeze(1)  # (R, V)
    rejected_mass = (q * repeated).sum(dim=-1, keepdim=True)  # (R, 1)
    mixture = q.masked_fill(repeated, 0.0) + rejected_mass * p
    return torch.where(greedy.unsqueeze(1), scores, mixture.log())


class BatchSampler:
    """Per-row RAS settings and seed keys for the rows of a decoding batch, sampled with no host sync.

    Rows are (re)assigned as requests enter the batch. Everything lives in static tensors, so the
    torch backend captures the sampler inside its CUDA graph of the whole decode step.
    """

    def __init__(self, rows: int, window: int, device: torch.device | str, eos_id: int, fn=sample_tokens):
        self.keys = torch.zeros(rows, dtype=torch.int64, device=device)
        self.top_p = torch.ones(rows, device=device)
        self.top_k = torch.ones(rows, dtype=torch.int64, device=device)
        self.win_size = torch.ones(rows, dtype=torch.int64, device=device)
        self.tau_r = torch.ones(rows, device=device)
        self.greedy = torch.ones(rows, dtype=torch.bool, device=device)  # idle rows: cheapest choice
        self.window, self.eos_id = window, eos_id  # window: W of the `recent` buffer
        self._fn = fn

    def assign(self, rows: Tensor, seeds: list[int], configs: list[RasConfig], greedy: list[bool]) -> None:
        """Give rows (n,) to new requests."""
        if any(c.win_size > self.window for c in configs):
            raise ValueError(f"win_size above the batch's window {self.window}")
        dev = self.keys.device
        self.keys[rows] = seed_keys(seeds, dev)
        self.top_p[rows] = to_device([c.top_p for c in configs], torch.float32, dev)
        self.top_k[rows] = to_device([c.top_k for c in configs], torch.int64, dev)
        self.win_size[rows] = to_device([c.win_size for c in configs], torch.int64, dev)
        self.tau_r[rows] = to_device([c.tau_r for c in configs], torch.float32, dev)
        self.greedy[rows] = to_device(greedy, torch.bool, dev)

    def __call__(self, logp: Tensor, n_decoded: Tensor, min_tokens: Tensor, recent: Tensor) -> Tensor:
        """logp (B, V), n_decoded (B,), min_tokens (B,), recent (B, W) -> tokens (B,)."""
        tok = self._fn(logp, n_decoded, min_tokens, recent, self.keys, self.top_p, self.top_k, self.win_size, self.tau_r, self.greedy, self.eos_id)
        return tok


# -- replay of the official torch-RNG draws (one sequence, tests) ----------------------------------


class OfficialRas:
    """The official `ras_sampling` with torch's global RNG, in the official order of multinomial calls.

    Seed with `torch.manual_seed(seed)` first. The nucleus mass is accumulated in fp32 one token at a
    time, exactly as the official Python loop does, so the kept set matches at the top_p boundary.
    """

    def __init__(self, config: RasConfig):
        self.config = config

    def __call__(self, logp: Tensor, decoded: list[int]) -> int:
        c = self.config
        probs = logp.softmax(dim=0)  # (V,)
        sorted_p, sorted_idx = probs.sort(descending=True, stable=True)
        mass, kept = torch.zeros((), dtype=probs.dtype), 0
        while kept < len(sorted_p) and bool(mass < c.top_p) and kept < c.top_k:
            mass = mass + sorted_p[kept]
            kept += 1
        top = int(sorted_idx[:kept][sorted_p[:kept].clone().multinomial(1, replacement=True)])
        reps = sum(1 for t in decoded[-c.win_size :] if t == top)
        if reps >= c.win_size * c.tau_r:
            top = int(probs.multinomial(1, replacement=True))
        return top
