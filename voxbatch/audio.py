"""Audio containers for segment and chapter objects: encode, decode, stream-write, probe.

One table maps each `AudioFormat` to its libsndfile container/subtype and HTTP content type, so the
worker's upload threads and the assembler agree on what "ogg" or "opus" means. Audio in memory is
float32 in [-1, 1], shaped (T,) for mono or (T, C). No torch here: the producer and the assembler
import this module.

Lengths are exact: every format here decodes to the same number of samples it was given (Ogg
granule positions trim the codec padding), which the assembler relies on for sample-exact timing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from voxbatch.settings import AudioFormat


@dataclass(frozen=True)
class Container:
    sf_format: str  # libsndfile major format
    subtype: str  # libsndfile subtype (codec / sample encoding)
    content_type: str  # what S3 stores as Content-Type


CONTAINERS: dict[str, Container] = {
    "wav": Container("WAV", "PCM_16", "audio/wav"),
    "flac": Container("FLAC", "PCM_16", "audio/flac"),
    "ogg": Container("OGG", "VORBIS", "audio/ogg"),
    # Ogg Opus is "audio/ogg" per RFC 7845 ("audio/opus" names bare RTP Opus); the codecs
    # parameter lets browsers tell it from Vorbis.
    "opus": Container("OGG", "OPUS", "audio/ogg; codecs=opus"),
}

# The only rates the Opus encoder accepts (libsndfile passes them through to libopus).
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)

# Non-audio objects the assembler writes.
CONTENT_TYPES: dict[str, str] = {
    **{fmt: c.content_type for fmt, c in CONTAINERS.items()},
    "m4b": "audio/mp4",
    "srt": "application/x-subrip",
    "vtt": "text/vtt; charset=utf-8",
    "json": "application/json",
}


class AudioFormatError(ValueError):
    """A format this build cannot write, or a rate the format's codec refuses."""


class AudioDecodeError(ValueError):
    """Bytes that are not audio libsndfile can read; the message names the object."""


def content_type(fmt: str) -> str:
    try:
        return CONTENT_TYPES[fmt]
    except KeyError:
        raise AudioFormatError(f"no content type for format {fmt!r}") from None


def container(fmt: str, sample_rate: int) -> Container:
    """The container for `fmt`, after checking this libsndfile can write it at this rate."""
    if fmt not in CONTAINERS:
        raise AudioFormatError(f"unknown audio format {fmt!r}; expected one of {sorted(CONTAINERS)}")
    c = CONTAINERS[fmt]
    if c.subtype not in sf.available_subtypes(c.sf_format):
        raise AudioFormatError(
            f"audio format {fmt!r} ({c.sf_format}/{c.subtype}) is not supported by the installed "
            f"libsndfile {sf.__libsndfile_version__}; use wav, flac or ogg, or install libsndfile >= 1.0.29 "
            f"built with Opus"
        )
    if fmt == "opus" and sample_rate not in OPUS_SAMPLE_RATES:
        raise AudioFormatError(
            f"audio format 'opus' cannot encode {sample_rate} Hz (Opus takes {OPUS_SAMPLE_RATES}); "
            f"use wav, flac or ogg for this model's output"
        )
    return c


def supported_formats() -> list[str]:
    """Formats this machine's libsndfile can write (opus depends on how libsndfile was built)."""
    return [f for f, c in CONTAINERS.items() if c.subtype in sf.available_subtypes(c.sf_format)]


def clip(audio: np.ndarray) -> np.ndarray:
    """float32 audio clipped to [-1, 1], so every format (lossy codecs too) gets the same bounded signal."""
    return np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)


def encode(audio: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Encode float32 audio (T,) or (T, C) into one object's bytes in format `fmt`."""
    c = container(fmt, sample_rate)
    buf = io.BytesIO()
    sf.write(buf, clip(audio), sample_rate, format=c.sf_format, subtype=c.subtype)
    return buf.getvalue()


def decode(data: bytes, name: str = "<bytes>") -> tuple[np.ndarray, int]:
    """Decode an object into float32 audio (T,) mono or (T, C), and its sample rate."""
    try:
        audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioDecodeError(f"cannot decode audio {name}: {e}") from e
    return audio, sr


@dataclass(frozen=True)
class AudioInfo:
    sample_rate: int
    frames: int
    channels: int

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate


def probe(data: bytes, name: str = "<bytes>") -> AudioInfo:
    """Rate, length and channels from an object's header, without decoding the samples."""
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioDecodeError(f"cannot read audio header of {name}: {e}") from e
    return AudioInfo(info.samplerate, info.frames, info.channels)


def duration_s(audio: np.ndarray, sample_rate: int) -> float:
    """Seconds of audio in an array (T,) or (T, C)."""
    return len(audio) / sample_rate


def open_writer(path: str | Path, sample_rate: int, channels: int, fmt: AudioFormat) -> sf.SoundFile:
    """A file writer in format `fmt`, for audio appended piece by piece (assembled chapters).

    Write float32 arrays clipped with `clip`; close it (or use it as a context manager) to finish.
    """
    c = container(fmt, sample_rate)
    return sf.SoundFile(
        str(path), "w", samplerate=sample_rate, channels=channels, format=c.sf_format, subtype=c.subtype
    )
