"""Delivery mastering: what a preset does to one chapter file before it is encoded.

    assembled chapter (engine rate, e.g. 24 kHz)
    -> mono, resampled to 44.1 kHz (soxr, very high quality)
    -> head/tail padded or cut so the room tone lasts head_s / tail_s (acx; only what lies under -50 dBFS
       is ever cut)
    -> gain to the preset's level target (acx: RMS -20 dB over the whole file; podcast: -16 LUFS,
       BS.1770 via pyloudnorm), iterated with the limiter in the loop because limiting lowers the level
    -> true-peak limiter at the preset's ceiling (look-ahead on the 4x-oversampled envelope, see `limit`)
    -> room tone (acx): a constant bed of seeded white noise at -75 dBFS RMS under the whole file
    -> encoded by the assembler (MP3 192 kb/s CBR for acx, 128 kb/s for podcast, or AAC), then measured
       again from the decoded file (qc.py); when encoding pushed a peak over, the ceiling is lowered
       by the excess and the chapter mastered again (`CEILING_RETRIES` times at most).

Room tone: ACX wants 0.5-1 s at the head, 1-5 s at the tail and a noise floor <= -60 dB RMS. The
generated room tone is very low white noise (-75 dBFS RMS, peaks near -62 dBFS), not digital silence:
ACX asks for room tone, gaps that drop to digital zero ("dead air") read as gated or edited audio, and a
constant bed makes the gaps between segments sound like one recording. -75 dB leaves 15 dB of margin
to the -60 dB limit after MP3 encoding.

The limiter: pedalboard's `Limiter` was measured and is not a ceiling limiter: it adds (3.75 dB minus
its threshold) of make-up gain and hard-clips at 0 dBFS (a -30 dBFS sine with threshold -6 came out
at -20.25 dBFS), so it cannot hold peaks at -3 dBFS without clipping. `limit` is a look-ahead gain
computer in two scipy filters: the gain at each sample is the mean, over +-attack, of the minimum,
over +-(attack+hold), of the gain each sample needs to keep its true-peak envelope (the 4x-oversampled
magnitude, soxr) under the ceiling, so no sample or inter-sample peak exceeds it and the gain moves in
ramps of 2 x attack (5 ms) instead of clipping.

Memory: one chapter file (<= 120 min) in memory at 44.1 kHz float32 (1.3 GB at 120 min) plus the
limiter's gain arrays, processed in blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from voxbatch.producer import qc

MASTER_RATE = 44100
ROOM_TONE_DBFS = -75.0
CEILING_RETRIES = 2
LEVEL_TOLERANCE_DB = 0.1
MAX_GAIN_STEPS = 16
MIN_SLOPE = 0.05  # dB of level per dB of gain, the least a secant step assumes
MAX_GAIN_DB = 60.0
LIMIT_BLOCK = 1 << 20  # samples per limiter block (blocks overlap by the look-ahead)


@dataclass(frozen=True)
class Preset:
    name: str
    fmt: str  # chapter file format
    kbps: int  # constant bit rate
    level: Literal["rms", "lufs"]  # what the gain targets
    target_db: float
    ceiling_db: float  # limiter ceiling, true peak (dBTP), below the rule's limit for codec overshoot
    head_s: float | None = None  # room tone at the head (None: the assembled lead stays as it is)
    tail_s: float | None = None
    room_tone_dbfs: float | None = None
    sample_rate: int = MASTER_RATE  # files are mono


PRESETS: dict[str, Preset] = {
    # ACX: RMS -23..-18 (target the middle), peaks <= -3 dBFS (ceiling 1 dB lower: MP3 overshoots),
    # room tone 0.5-1 s head (0.7) and 1-5 s tail (1.5: short files, such as credits, keep their RMS up).
    "acx": Preset("acx", "mp3", 192, "rms", -20.0, -4.0, head_s=0.7, tail_s=1.5, room_tone_dbfs=ROOM_TONE_DBFS),
    # Podcast: -16 LUFS +-1, true peak <= -1 dBTP (ceiling 1 dB lower: MP3 encoding adds peaks).
    "podcast": Preset("podcast", "mp3", 128, "lufs", -16.0, -2.0),
}


def preset_for(name: str, job_format: str) -> Preset | None:
    """The preset a job's chapters get (None for "none"); podcast chapters are AAC when the job asks m4a."""
    if name == "none":
        return None
    p = PRESETS[name]
    if name == "podcast" and job_format == "m4a":
        return replace(p, fmt="m4a", kbps=96)
    return p


@dataclass
class Mastered:
    audio: np.ndarray  # float32 mono at preset.sample_rate
    head_pad_s: float  # seconds put before (< 0: cut from) the chapter's start; cues shift by this
    gain_db: float  # gain before the limiter


def true_peak_envelope(x: np.ndarray, sample_rate: int) -> np.ndarray:
    """Per sample, the largest magnitude of the signal oversampled 4x around it (soxr): the peaks a
    DAC or a decoder reconstructs between samples, which BS.1770's true peak measures."""
    import soxr

    up = soxr.resample(x, sample_rate, sample_rate * 4, quality="HQ")
    n = min(len(x), len(up) // 4)
    env = np.abs(x).astype(np.float32)
    env[:n] = np.maximum(env[:n], np.abs(up[: n * 4]).reshape(n, 4).max(axis=1))
    return env


def limit(x: np.ndarray, sample_rate: int, ceiling_db: float, attack_ms: float = 2.5,
          hold_ms: float = 5.0, envelope: np.ndarray | None = None) -> np.ndarray:
    """Look-ahead peak limiter: no sample (with `envelope`, e.g. `true_peak_envelope`: no true peak)
    over `ceiling_db`, gain ramps of 2 x attack."""
    from scipy.ndimage import minimum_filter1d, uniform_filter1d

    ceiling = 10 ** (ceiling_db / 20)
    a = max(1, int(sample_rate * attack_ms / 1000))
    h = int(sample_rate * hold_ms / 1000)
    margin = 2 * (a + h) + 2
    out = np.empty_like(x, dtype=np.float32)
    for start in range(0, len(x), LIMIT_BLOCK):
        lo, hi = max(0, start - margin), min(len(x), start + LIMIT_BLOCK + margin)
        block = x[lo:hi]
        peak = np.abs(block) if envelope is None else envelope[lo:hi]
        need = np.minimum(1.0, ceiling / np.maximum(peak, 1e-12)).astype(np.float32)
        held = minimum_filter1d(need, size=2 * (a + h) + 1, mode="nearest")
        gain = uniform_filter1d(held, size=2 * a + 1, mode="nearest")
        gain = np.minimum(gain, need)  # float rounding in the mean must not let a sample through
        end = min(len(x), start + LIMIT_BLOCK)
        out[start:end] = (block * gain)[start - lo:end - lo]
    return out


def room_tone(n: int, dbfs: float, seed: int) -> np.ndarray:
    """Seeded white noise at `dbfs` RMS: the same chapter always gets the same bed."""
    return (10 ** (dbfs / 20) * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


def _level(x: np.ndarray, sample_rate: int, kind: str) -> float:
    if kind == "lufs":
        return qc.integrated_lufs(x, sample_rate)
    return qc.db(float(np.mean(x.astype(np.float64) ** 2)), power=True)


def master(audio: np.ndarray, sample_rate: int, preset: Preset, *, ceiling_offset_db: float = 0.0,
           seed: int = 0) -> Mastered:
    """Master one chapter file's audio (T,) or (T, C) at `sample_rate` to `preset` (see module doc)."""
    import soxr

    x = qc.mono(audio)
    if sample_rate != preset.sample_rate:
        x = soxr.resample(x, sample_rate, preset.sample_rate, quality="VHQ").astype(np.float32)
    sr = preset.sample_rate
    level = _level(x, sr, preset.level)
    gain_db = preset.target_db - level if level > qc.FLOOR_DB else 0.0
    head_pad = 0
    if preset.head_s is not None:
        # Room tone is what lies under -50 dBFS once at level: measure the edges after the first gain,
        # then pad (or cut, when the chapter opens or ends with more silence) to head_s / tail_s.
        head_s, tail_s = qc.edges_s(x * np.float32(10 ** (gain_db / 20)), sr)
        head_pad = int(round((preset.head_s - head_s) * sr))
        tail_pad = int(round((preset.tail_s - tail_s) * sr))
        x = x[max(0, -head_pad): len(x) - max(0, -tail_pad)]
        x = np.concatenate([np.zeros(max(0, head_pad), np.float32), x, np.zeros(max(0, tail_pad), np.float32)])
    bed = room_tone(len(x), preset.room_tone_dbfs, seed) if preset.room_tone_dbfs is not None else None
    ceiling = preset.ceiling_db - ceiling_offset_db
    envelope = true_peak_envelope(x, sr)  # of the signal before gain: it scales with the gain
    out = x
    prev: tuple[float, float] | None = None  # (gain, level) of the step before
    for _ in range(MAX_GAIN_STEPS):
        g = np.float32(10 ** (gain_db / 20))
        out = limit(x * g, sr, ceiling, envelope=envelope * g)
        if bed is not None:
            out = out + bed
        got = _level(out, sr, preset.level)
        if got <= qc.FLOOR_DB or abs(got - preset.target_db) < LEVEL_TOLERANCE_DB:
            break
        # Secant steps: under heavy limiting a dB of gain buys much less than a dB of level.
        slope = 1.0
        if prev is not None and gain_db != prev[0]:
            slope = min(1.0, max(MIN_SLOPE, (got - prev[1]) / (gain_db - prev[0])))
        prev = (gain_db, got)
        gain_db = min(MAX_GAIN_DB, gain_db + (preset.target_db - got) / slope)
    return Mastered(audio=np.clip(out, -1.0, 1.0), head_pad_s=head_pad / sr, gain_db=round(gain_db, 2))
