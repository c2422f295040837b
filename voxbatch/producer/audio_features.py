"""Audio features of a voice prompt, in numpy (the producer runs without torch).

Three features, each what the official CosyVoice2 frontend feeds one network:
  - the prompt mel (24 kHz, the flow's conditioning): matcha's `mel_spectrogram`;
  - the whisper log-mel (16 kHz, 128 bins), input of the speech tokenizer;
  - the Kaldi fbank (16 kHz, 80 bins, mean-normalised), input of the CAM++ speaker embedding.
Plus WAV loading (soundfile, mono mix) and resampling (soxr).

Shapes: T_wav samples; mel features are (T_frames, n_mels) except the whisper log-mel, which is
(128, T_frames) as the tokenizer takes it.
"""

from __future__ import annotations

import functools
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

# Speaker-embedding input (Kaldi fbank, torchaudio.compliance.kaldi defaults except these).
FBANK_SAMPLE_RATE = 16000
FBANK_N_MELS = 80
FBANK_DITHER = 0.0


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


def resample(wav: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """float32 (T_wav,) from rate_in to rate_out with soxr (very high quality); no-op if equal."""
    if rate_in == rate_out:
        return wav.astype(np.float32, copy=False)
    import soxr

    return soxr.resample(wav.astype(np.float32, copy=False), rate_in, rate_out, quality="VHQ").astype(np.float32)


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


def kaldi_fbank(wav16k: np.ndarray) -> np.ndarray:
    """16 kHz (T_wav,) float samples in [-1, 1] -> Kaldi log-mel fbank (T_frames, 80) float32
    (25 ms / 10 ms povey frames, snip edges, pre-emphasis 0.97, no dither), via kaldi-native-fbank.

    Like the official frontend, on the float scale, not Kaldi's int16 scale.
    """
    import kaldi_native_fbank as knf

    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = FBANK_SAMPLE_RATE
    opts.frame_opts.dither = FBANK_DITHER
    opts.mel_opts.num_bins = FBANK_N_MELS
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(FBANK_SAMPLE_RATE, wav16k.astype(np.float32).tolist())
    fbank.input_finished()
    n = fbank.num_frames_ready
    if n == 0:
        raise AudioError(f"audio of {len(wav16k)} samples is shorter than one 25 ms fbank frame")
    return np.stack([np.asarray(fbank.get_frame(i), dtype=np.float32) for i in range(n)])


def mean_normalized_fbank(wav16k: np.ndarray) -> np.ndarray:
    """The speaker-embedding input: Kaldi fbank (T_frames, 80) minus its per-utterance mean."""
    feats = kaldi_fbank(wav16k)
    return (feats - feats.mean(axis=0, keepdims=True)).astype(np.float32)
