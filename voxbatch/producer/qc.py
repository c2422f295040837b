"""Quality control of delivered chapter files: levels measured on the decoded file, rules per preset.

What is measured (float32 audio as decoded from the stored file, mono or the channel mean):

  integrated_lufs   ITU-R BS.1770-4 integrated loudness, gated (pyloudnorm)
  rms_db            RMS of the whole file in dBFS, room tone included (how ACX measures it)
  peak_dbfs         largest absolute sample
  true_peak_dbtp    largest absolute value after 4x oversampling (soxr, very high quality), BS.1770's
                    true-peak method
  noise_floor_db    RMS of the quietest 500 ms stretch (50 windows of 10 ms), as ACX's checker does
  head_s / tail_s   room tone before the first / after the last 10 ms window louder than -50 dBFS
  duration_s

Rules are per preset (`RULES`); a file passes when every rule of its preset holds. A chapter that
mastering cannot bring inside its preset is delivered with its failing rules named, never silently.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from voxbatch.models import QcLevels

WINDOW_S = 0.010  # analysis window for head/tail and the noise floor
NOISE_WINDOWS = 50  # 50 x 10 ms = the 500 ms stretch the noise floor is measured over
SIGNAL_DBFS = -50.0  # a 10 ms window louder than this is programme, not room tone
TRUE_PEAK_OVERSAMPLE = 4
FLOOR_DB = -120.0  # what digital silence reads as, instead of -inf (JSON has no infinities)


def db(power_or_amplitude: float, power: bool = False) -> float:
    """Decibels, floored at FLOOR_DB."""
    if power_or_amplitude <= 0:
        return FLOOR_DB
    v = (10 if power else 20) * math.log10(power_or_amplitude)
    return max(FLOOR_DB, v)


def mono(audio: np.ndarray) -> np.ndarray:
    a = np.asarray(audio, dtype=np.float32)
    return a if a.ndim == 1 else a.mean(axis=1)


def integrated_lufs(audio: np.ndarray, sample_rate: int) -> float:
    """BS.1770 integrated loudness (pyloudnorm); FLOOR_DB for files under 400 ms or all silence."""
    import pyloudnorm

    x = mono(audio)
    if len(x) < int(0.4 * sample_rate):
        return FLOOR_DB
    value = pyloudnorm.Meter(sample_rate).integrated_loudness(x.astype(np.float64))
    return FLOOR_DB if not math.isfinite(value) else max(FLOOR_DB, float(value))


def true_peak_db(audio: np.ndarray, sample_rate: int, chunk: int = 1 << 20) -> float:
    """dBTP: the peak of the signal oversampled 4x (streamed in chunks: memory stays flat)."""
    import soxr

    x = mono(audio)
    stream = soxr.ResampleStream(sample_rate, sample_rate * TRUE_PEAK_OVERSAMPLE, 1, dtype="float32",
                                 quality="VHQ")
    peak = 0.0
    for i in range(0, len(x), chunk):
        last = i + chunk >= len(x)
        up = stream.resample_chunk(x[i:i + chunk], last=last)
        if len(up):
            peak = max(peak, float(np.abs(up).max()))
    if len(x) == 0:
        return FLOOR_DB
    return db(max(peak, float(np.abs(x).max())))


def _window_power(x: np.ndarray, n: int) -> np.ndarray:
    """Mean square of consecutive n-sample windows (the last partial window dropped)."""
    k = len(x) // n
    if k == 0:
        return np.array([float(np.mean(x.astype(np.float64) ** 2))]) if len(x) else np.zeros(0)
    return (x[: k * n].astype(np.float64) ** 2).reshape(k, n).mean(axis=1)


def _edges(x: np.ndarray, power: np.ndarray, n: int, sample_rate: int) -> tuple[float, float]:
    loud = np.flatnonzero(power > 10 ** (SIGNAL_DBFS / 10))
    if not len(loud):
        return len(x) / sample_rate, len(x) / sample_rate
    return loud[0] * n / sample_rate, (len(x) - (loud[-1] + 1) * n) / sample_rate


def edges_s(audio: np.ndarray, sample_rate: int) -> tuple[float, float]:
    """Seconds of room tone (nothing louder than SIGNAL_DBFS in 10 ms) at the head and at the tail."""
    x = mono(audio)
    n = max(1, int(round(WINDOW_S * sample_rate)))
    return _edges(x, _window_power(x, n), n, sample_rate)


def measure(audio: np.ndarray, sample_rate: int) -> QcLevels:
    """Every level the rules look at, from decoded audio."""
    x = mono(audio)
    n = max(1, int(round(WINDOW_S * sample_rate)))
    power = _window_power(x, n)
    if len(power) >= NOISE_WINDOWS:
        rolling = np.convolve(power, np.ones(NOISE_WINDOWS) / NOISE_WINDOWS, mode="valid")
        floor = db(float(rolling.min()), power=True)
    else:
        floor = db(float(power.mean()) if len(power) else 0.0, power=True)
    head_s, tail_s = _edges(x, power, n, sample_rate)
    return QcLevels(
        integrated_lufs=round(integrated_lufs(x, sample_rate), 2),
        rms_db=round(db(float(np.mean(x.astype(np.float64) ** 2)) if len(x) else 0.0, power=True), 2),
        peak_dbfs=round(db(float(np.abs(x).max()) if len(x) else 0.0), 2),
        true_peak_dbtp=round(true_peak_db(x, sample_rate), 2),
        noise_floor_db=round(floor, 2),
        head_s=round(head_s, 3),
        tail_s=round(tail_s, 3),
        duration_s=round(len(x) / sample_rate, 3),
    )


PEAK_LIMIT_DB = {"acx": -3.0}  # sample peak, dBFS
TRUE_PEAK_LIMIT_DB = {"podcast": -1.0}  # dBTP
ACX_RMS_DB = (-23.0, -18.0)
PODCAST_LUFS, PODCAST_LUFS_TOLERANCE = -16.0, 1.0
MAX_FILE_S = {"acx": 120 * 60}

# A rule: (name, what it demands in words, test on the measured levels and the file's format facts).
Rule = tuple[str, str, Callable[[QcLevels, dict], bool]]

RULES: dict[str, list[Rule]] = {
    "acx": [
        ("format", "MP3, 192 kb/s CBR, 44.1 kHz, mono",
         lambda lv, f: f["format"] == "mp3" and f["kbps"] == 192 and f["sample_rate"] == 44100 and f["channels"] == 1),
        ("rms", "RMS between -23 and -18 dB", lambda lv, f: ACX_RMS_DB[0] <= lv.rms_db <= ACX_RMS_DB[1]),
        ("peak", "peaks <= -3 dBFS", lambda lv, f: lv.peak_dbfs <= PEAK_LIMIT_DB["acx"]),
        ("noise_floor", "noise floor <= -60 dB RMS", lambda lv, f: lv.noise_floor_db <= -60.0),
        ("room_tone_head", "0.5-1 s of room tone at the head", lambda lv, f: 0.5 <= lv.head_s <= 1.0),
        ("room_tone_tail", "1-5 s of room tone at the tail", lambda lv, f: 1.0 <= lv.tail_s <= 5.0),
        ("length", "no file over 120 minutes (VOXBATCH_MASTER_MAX_FILE_S)",
         lambda lv, f: lv.duration_s <= f.get("max_file_s", MAX_FILE_S["acx"])),
    ],
    "podcast": [
        ("loudness", "-16 LUFS integrated, +-1",
         lambda lv, f: abs(lv.integrated_lufs - PODCAST_LUFS) <= PODCAST_LUFS_TOLERANCE),
        ("true_peak", "true peak <= -1 dBTP", lambda lv, f: lv.true_peak_dbtp <= TRUE_PEAK_LIMIT_DB["podcast"]),
    ],
    "none": [],
}


def check(preset: str, levels: QcLevels, facts: dict) -> dict[str, bool]:
    """Rule name -> pass, for the preset's rules. `facts`: format, kbps, sample_rate, channels and
    max_file_s (the job's file length cap; ACX's 120 min by default)."""
    return {name: bool(test(levels, facts)) for name, _, test in RULES[preset]}


def load_manifest(storage, job_id: str):
    """The job's manifest from storage; KeyError when the job has not been assembled."""
    from voxbatch import keys
    from voxbatch.models import Manifest

    return Manifest.model_validate_json(storage.get(keys.manifest(job_id)))


def qc_table(manifest):
    """One row per chapter file: levels and the rules it fails (rich Table; user strings escaped)."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"QC of job {escape(manifest.job_id)} (preset {manifest.preset})",
                  caption="LUFS integrated; RMS, peak dBFS; TP true peak dBTP; floor: quietest 500 ms, dB RMS; "
                          "head/tail: room tone s; len s")
    for col in ("file", "LUFS", "RMS", "peak", "TP", "floor", "head", "tail", "len", "result"):
        table.add_column(col, justify="left" if col in ("file", "result") else "right",
                         no_wrap=col != "result")
    for row in manifest.qc:
        lv = row.levels
        failing = [name for name, ok in row.checks.items() if not ok]
        result = "[green]pass[/green]" if row.passed else "[red]FAIL[/red] " + escape(", ".join(failing))
        table.add_row(escape(row.key.rsplit("/", 1)[-1]), f"{lv.integrated_lufs:.1f}", f"{lv.rms_db:.1f}",
                      f"{lv.peak_dbfs:.1f}", f"{lv.true_peak_dbtp:.1f}", f"{lv.noise_floor_db:.1f}",
                      f"{lv.head_s:.2f}", f"{lv.tail_s:.2f}", f"{lv.duration_s:.1f}", result)
    return table


def failure_lines(manifest) -> list[str]:
    """One line per failing file: which rules, in words (the table has no room for them)."""
    words = {name: demand for name, demand, _ in RULES.get(manifest.preset, [])}
    return [
        f"FAIL {row.key}: " + "; ".join(f"{name} ({words.get(name, name)})" for name, ok in row.checks.items() if not ok)
        for row in manifest.qc if not row.passed
    ]
