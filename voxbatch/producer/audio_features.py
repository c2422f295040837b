"""Audio features of a voice prompt, in numpy (the producer runs without torch).

Three features, each what the official CosyVoice2 frontend feeds one network:
  - the prompt mel (24 kHz, the flow's conditioning): matcha's `mel_spectrogram`;
  - the whisper log-mel (16 kHz, 128 bins), input of the speech tokenizer;
  - the Kaldi fbank (16 kHz, 80 bins, mean-normalised), input of the CAM++ speaker embedding.
Plus WAV loading (soundfile, mono mix) and resampling (the official windowed sinc, in numpy).

Shapes: T_wav samples; mel features are (T_frames, n_mels) except the whisper log-mel, which is
(128, T_frames) as the tokenizer takes it.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

# Prompt mel (the flow's `feat_extractor` in cosyvoice2.yaml: matcha mel_spectrogram).
SAMPLE_RATE = 24000
N_FFT = 1920
HOP_LENGTH = 480
WIN_LENGTH = 1920
N_MELS = 80
FMIN = 0.0
FMAX = 8000.0
LOG_FLOOR = 1e-5  # natural log of max(mel, 1e-5)
MAGNITUDE_EPS = 1e-9  # |X| = sqrt(re^2 + im^2 + 1e-9), as matcha

# Speech tokenizer input (openai-whisper's log_mel_spectrogram with n_mels=128).
TOKENIZER_SAMPLE_RATE = 16000
WHISPER_N_FFT = 400
WHISPER_HOP_LENGTH = 160
WHISPER_N_MELS = 128
WHISPER_LOG_FLOOR = 1e-10  # log10 floor
WHISPER_DYNAMIC_RANGE = 8.0  # log10 units kept below the maximum

# Speaker-embedding input (Kaldi fbank with torchaudio.compliance.kaldi's defaults, dither 0).
FBANK_SAMPLE_RATE = 16000
FBANK_N_MELS = 80
FBANK_FRAME = 400  # 25 ms
FBANK_SHIFT = 160  # 10 ms
FBANK_N_FFT = 512  # the frame rounded up to a power of two
FBANK_PREEMPHASIS = 0.97
FBANK_LOW_HZ = 20.0  # lowest filter edge; the highest is Nyquist

# Resampling (torchaudio.functional.resample defaults, which the official `load_wav` uses).
RESAMPLE_LOWPASS_WIDTH = 6  # zero crossings of the sinc kept on each side
RESAMPLE_ROLLOFF = 0.99  # cutoff as a fraction of the lower rate's Nyquist frequency
RESAMPLE_MAX_KERNEL = 1 << 22  # kernel values (new phases x taps): 16 MiB of float32
RESAMPLE_FRAMES_PER_CHUNK = 4096  # output frames computed per matrix product


class AudioError(ValueError):
    """An audio file that cannot be read, or audio that cannot be used."""


# ---------------------------------------------------------------------------------------------
# Loading and resampling.
# ---------------------------------------------------------------------------------------------


def load_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file as float32 mono in [-1, 1] (channels averaged) and its native rate.

    16-bit PCM comes back as int16 / 32768, as the official loader (torchaudio's soundfile backend).
    """
    import soundfile as sf

    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)  # (T_wav, channels)
    except Exception as e:  # noqa: BLE001 - libsndfile raises several types; all mean "unreadable"
        raise AudioError(f"{path}: cannot read audio ({type(e).__name__}: {e})") from e
    if data.shape[0] == 0:
        raise AudioError(f"{path}: holds no samples")
    return data.mean(axis=1, dtype=np.float32), int(rate)


def _resample_width(orig: int, new: int) -> int:
    """Input samples of padding each side: the filter's half-length at the reduced rates."""
    return math.ceil(RESAMPLE_LOWPASS_WIDTH * orig / (min(orig, new) * RESAMPLE_ROLLOFF))


def _sinc_resample_kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """Polyphase kernel (new, 2 * width + orig) float32 and the padding `width`, for rates already
    divided by their gcd: a Hann-windowed sinc low-pass at `RESAMPLE_ROLLOFF` of the lower Nyquist,
    `RESAMPLE_LOWPASS_WIDTH` zero crossings each side. Row j makes output phase j: output sample
    i * new + j is the dot product of row j with input samples i * orig - width ... i * orig + width + orig - 1.

    The arithmetic (float64 positions, float32 phase offsets j / new, clamp, cos^2 window, float32
    kernel) is torchaudio's `sinc_interp_hann` default, which the official `load_wav` applies.
    """
    base = min(orig, new) * RESAMPLE_ROLLOFF  # cutoff, in units of the reduced rates
    width = _resample_width(orig, new)
    taps = np.arange(-width, width + orig, dtype=np.float64) / orig  # (K,) tap offsets, in input frames of `orig` samples
    phases = (np.arange(0, -new, -1) / np.float32(new)).astype(np.float32)  # (new,) in float32, as torch computes them
    t = (phases.astype(np.float64)[:, None] + taps[None, :]) * base  # (new, K): distance in zero crossings
    t = np.clip(t, -RESAMPLE_LOWPASS_WIDTH, RESAMPLE_LOWPASS_WIDTH)
    window = np.cos(t * np.pi / RESAMPLE_LOWPASS_WIDTH / 2) ** 2
    t *= np.pi
    with np.errstate(invalid="ignore", divide="ignore"):
        sinc = np.where(t == 0, 1.0, np.sin(t) / t)
    return (sinc * (window * (base / orig))).astype(np.float32), width


def resample(wav: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """float32 (T_wav,) from rate_in to rate_out as the official frontend resamples (torchaudio's
    default windowed-sinc `Resample`), so a voice made here is the voice the official code makes:
    ceil(T_wav * rate_out / rate_in) samples, zero padding at both ends. No-op if the rates are equal.

    Refuses rate pairs whose polyphase kernel would be huge (rates sharing almost no common factor,
    such as 44099 Hz): the official code would build the same kernel; we name the rate instead.
    """
    if rate_in == rate_out:
        return wav.astype(np.float32, copy=False)
    if rate_in <= 0 or rate_out <= 0:
        raise AudioError(f"cannot resample from {rate_in} Hz to {rate_out} Hz")
    gcd = math.gcd(rate_in, rate_out)
    orig, new = rate_in // gcd, rate_out // gcd
    if new * (orig + 2 * _resample_width(orig, new)) > RESAMPLE_MAX_KERNEL:
        raise AudioError(
            f"sample rate {rate_in} Hz cannot be resampled to {rate_out} Hz with a bounded filter "
            "(the rates share too small a factor); convert the file to 16, 24, 44.1 or 48 kHz"
        )
    kernel, width = _sinc_resample_kernel(orig, new)  # (new, K)
    n_taps = kernel.shape[1]
    x = np.pad(wav.astype(np.float32, copy=False), (width, width + orig))
    frames = np.lib.stride_tricks.sliding_window_view(x, n_taps)[::orig]  # (T_frames, K), a view
    out = np.empty((frames.shape[0], new), dtype=np.float32)  # (T_frames, new)
    for start in range(0, frames.shape[0], RESAMPLE_FRAMES_PER_CHUNK):  # bounded temporary copies
        out[start : start + RESAMPLE_FRAMES_PER_CHUNK] = frames[start : start + RESAMPLE_FRAMES_PER_CHUNK] @ kernel.T
    return out.reshape(-1)[: math.ceil(new * len(wav) / orig)]


# ---------------------------------------------------------------------------------------------
# Filterbanks (librosa-compatible slaney mel, cached).
# ---------------------------------------------------------------------------------------------

_F_SP = 200.0 / 3  # slaney mel scale: linear below 1 kHz (3 mels per 200 Hz)...
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = np.log(6.4) / 27.0  # ...logarithmic above


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / _F_SP
    log_part = _MIN_LOG_MEL + np.log(np.maximum(hz, _MIN_LOG_HZ) / _MIN_LOG_HZ) / _LOGSTEP
    return np.where(hz >= _MIN_LOG_HZ, log_part, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    hz = _F_SP * mel
    log_part = _MIN_LOG_HZ * np.exp(_LOGSTEP * (np.maximum(mel, _MIN_LOG_MEL) - _MIN_LOG_MEL))
    return np.where(mel >= _MIN_LOG_MEL, log_part, hz)


@functools.lru_cache(maxsize=8)
def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None) -> np.ndarray:
    """Slaney-style, slaney-normalised triangular filters (n_mels, n_fft // 2 + 1), float32.

    Same construction and float32 rounding steps as `librosa.filters.mel` (htk=False,
    norm="slaney"), which both matcha and whisper use. Read-only: it is cached and shared.
    """
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_hz = np.linspace(0, sample_rate / 2, n_fft // 2 + 1)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))  # (n_mels + 2,)
    widths = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]  # (n_mels + 2, n_fft // 2 + 1)
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        rising = -ramps[i] / widths[i]
        falling = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0, np.minimum(rising, falling))
    weights *= (2.0 / (edges_hz[2 : n_mels + 2] - edges_hz[:n_mels]))[:, None]  # equal area per filter
    weights.flags.writeable = False
    return weights


def hann_window(n: int) -> np.ndarray:
    """Periodic Hann window (torch.hann_window's default), float64."""
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


def _stft(wav: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    """Frames without centering (the caller pads): (T_wav,) -> complex (T_frames, n_fft // 2 + 1)."""
    frames = np.lib.stride_tricks.sliding_window_view(wav, n_fft)[::hop]  # (T_frames, n_fft)
    return np.fft.rfft(frames * hann_window(n_fft), axis=1)


# ---------------------------------------------------------------------------------------------
# The three features.
# ---------------------------------------------------------------------------------------------


def prompt_mel(wav24k: np.ndarray) -> np.ndarray:
    """24 kHz (T_wav,) -> log mel (T_mel, 80) float32, T_mel = T_wav // 480 (matcha mel_spectrogram:
    reflect padding of (n_fft - hop) / 2 each side, no centering, |STFT|, mel, log of max(., 1e-5))."""
    pad = (N_FFT - HOP_LENGTH) // 2
    x = np.pad(wav24k.astype(np.float64), (pad, pad), mode="reflect")
    spec = _stft(x, N_FFT, HOP_LENGTH)
    magnitude = np.sqrt(spec.real**2 + spec.imag**2 + MAGNITUDE_EPS)  # (T_mel, n_fft // 2 + 1)
    mel = magnitude @ mel_filterbank(SAMPLE_RATE, N_FFT, N_MELS, FMIN, FMAX).T.astype(np.float64)
    return np.log(np.maximum(mel, LOG_FLOOR)).astype(np.float32)


def whisper_log_mel(wav16k: np.ndarray) -> np.ndarray:
    """16 kHz (T_wav,) -> whisper log-mel (128, T_wav // 160) float32: centered STFT (reflect),
    power, mel, log10 of max(., 1e-10), floor at max - 8, then (x + 4) / 4."""
    pad = WHISPER_N_FFT // 2
    x = np.pad(wav16k.astype(np.float64), (pad, pad), mode="reflect")
    spec = _stft(x, WHISPER_N_FFT, WHISPER_HOP_LENGTH)[:-1]  # whisper drops the last frame
    power = spec.real**2 + spec.imag**2  # (T_frames, 201)
    filters = mel_filterbank(TOKENIZER_SAMPLE_RATE, WHISPER_N_FFT, WHISPER_N_MELS).astype(np.float64)
    log_mel = np.log10(np.maximum(filters @ power.T, WHISPER_LOG_FLOOR))  # (128, T_frames)
    log_mel = np.maximum(log_mel, log_mel.max() - WHISPER_DYNAMIC_RANGE)
    return ((log_mel + 4.0) / 4.0).astype(np.float32)


@functools.lru_cache(maxsize=4)
def kaldi_mel_banks(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Kaldi's triangular filters on the mel scale 1127 ln(1 + f / 700), from `FBANK_LOW_HZ` to
    Nyquist, (n_mels, n_fft // 2 + 1) float32 (the Nyquist column is zero). Built in float32 as
    torchaudio builds them (bin frequencies, their mels and the slopes all rounded to float32): that
    rounding moves low-energy bands by up to 3e-4 in log energy, and the reference carries it."""
    f32 = np.float32
    mel_low, mel_high = (1127.0 * math.log(1.0 + hz / 700.0) for hz in (FBANK_LOW_HZ, sample_rate / 2))
    delta = (mel_high - mel_low) / (n_mels + 1)
    band = np.arange(n_mels, dtype=f32)[:, None]  # (n_mels, 1)
    left, center, right = (f32(mel_low) + (band + f32(k)) * f32(delta) for k in (0, 1, 2))
    bin_hz = f32(sample_rate / n_fft) * np.arange(n_fft // 2, dtype=f32)
    bin_mel = (f32(1127.0) * np.log(f32(1.0) + bin_hz / f32(700.0)))[None, :]  # (1, n_fft // 2)
    rising, falling = (bin_mel - left) / (center - left), (right - bin_mel) / (right - center)
    banks = np.pad(np.maximum(f32(0.0), np.minimum(rising, falling)), ((0, 0), (0, 1)))
    banks.flags.writeable = False
    return banks


def povey_window(n: int) -> np.ndarray:
    """Kaldi's default window: a symmetric Hann window to the power 0.85, float64."""
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / (n - 1))) ** 0.85


def kaldi_fbank(wav16k: np.ndarray) -> np.ndarray:
    """16 kHz (T_wav,) float samples in [-1, 1] -> Kaldi log-mel fbank (T_frames, 80) float32, the
    `torchaudio.compliance.kaldi.fbank` the official frontend calls (dither 0, otherwise Kaldi's
    defaults): 25 ms frames every 10 ms without padding (snip edges), DC offset removed,
    pre-emphasis 0.97, povey window, 512-point power spectrum, mel filters, natural log floored
    at float32 epsilon. Like the official frontend, on the float scale, not Kaldi's int16 scale.

    Own numpy code rather than kaldi-native-fbank: that library's float32 filterbank rounds
    differently from torchaudio's (3.1e-4 max log difference on the fixture, 5.4e-4 on another),
    while this one follows torchaudio's arithmetic (measured 1.3e-4 max, 8e-5 away from the floor).
    """
    if len(wav16k) < FBANK_FRAME:
        raise AudioError(f"audio of {len(wav16k)} samples is shorter than one 25 ms fbank frame")
    frames = np.lib.stride_tricks.sliding_window_view(wav16k.astype(np.float64), FBANK_FRAME)[::FBANK_SHIFT]  # (T_frames, 400)
    frames = frames - frames.mean(axis=1, keepdims=True)
    frames = frames - FBANK_PREEMPHASIS * np.concatenate([frames[:, :1], frames[:, :-1]], axis=1)  # x[-1] := x[0]
    spec = np.fft.rfft(frames * povey_window(FBANK_FRAME), n=FBANK_N_FFT, axis=1)  # (T_frames, 257)
    power = np.abs(spec.astype(np.complex64)).astype(np.float64) ** 2  # |X| rounded to float32, as torch's abs()
    energies = power @ kaldi_mel_banks(FBANK_SAMPLE_RATE, FBANK_N_FFT, FBANK_N_MELS).T.astype(np.float64)
    return np.log(np.maximum(energies, np.finfo(np.float32).eps)).astype(np.float32)


def mean_normalized_fbank(wav16k: np.ndarray) -> np.ndarray:
    """The speaker-embedding input: Kaldi fbank (T_frames, 80) minus its per-utterance mean."""
    feats = kaldi_fbank(wav16k)
    return (feats - feats.mean(axis=0, keepdims=True)).astype(np.float32)
