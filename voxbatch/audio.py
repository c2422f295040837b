"""Audio containers for segment and chapter objects: encode, decode, stream-write, probe.

One table maps each libsndfile `AudioFormat` to its container/subtype and HTTP content type, so the
worker's upload threads and the assembler agree on what "ogg" or "opus" means. Two formats go
through other encoders: "mp3" through pedalboard's LAME (chosen over libsndfile's MPEG writer and
lameenc by `bench/mp3_encoders.py`: fastest, CBR to the frame, gapless), decoded by libsndfile; "m4a"
(AAC-LC in MP4) through ffmpeg, which must be on PATH. Audio in memory is float32 in [-1, 1], shaped
(T,) for mono or (T, C). No torch here: the producer and the assembler import this module.

Lengths are exact for every format but m4a: they decode to the same number of samples they were
given (Ogg granule positions and the LAME gapless header trim the codec padding), which the
assembler relies on for sample-exact timing. AAC decodes with its last frame's padding (up to 1023
samples of trailing silence per object); the assembler places what it decodes, so timing stays
consistent, but m4a segments end up to 43 ms longer at 24 kHz.
"""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import wave
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

# Formats encoded outside libsndfile: content types, and the constant MP3 bit rate per rate class.
ENCODED_TYPES: dict[str, str] = {"mp3": "audio/mpeg", "m4a": "audio/mp4"}
MP3_KBPS = 192  # at >= 32 kHz (MPEG-1 layer III): what ACX asks for
MP3_KBPS_LOW_RATES = 96  # at 16-24 kHz (MPEG-2 layer III tops out at 160 kb/s): speech at the engine's rate
AAC_KBPS = 64  # AAC-LC mono spoken word, as audiobook stores ship it

# The only rates the Opus encoder accepts (libsndfile passes them through to libopus).
OPUS_SAMPLE_RATES = (8000, 12000, 16000, 24000, 48000)

# WAV through libsndfile instead of `_wav_pcm16` (the same bytes): the GPU bench's switch `sfwav`.
WAV_BY_LIBSNDFILE = False
# Non-audio objects the assembler writes.
CONTENT_TYPES: dict[str, str] = {
    **{fmt: c.content_type for fmt, c in CONTAINERS.items()},
    **ENCODED_TYPES,
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


@functools.cache
def _writable(sf_format: str, subtype: str) -> bool:
    """Whether this libsndfile writes `subtype` in `sf_format`: asked once per pair, not per object (the
    upload threads encode every segment; the lookup is pure Python loops over libsndfile's tables,
    GIL time the engine's launching threads wait for)."""
    return subtype in sf.available_subtypes(sf_format)


def container(fmt: str, sample_rate: int) -> Container:
    """The container for `fmt`, after checking this libsndfile can write it at this rate."""
    if fmt not in CONTAINERS:
        raise AudioFormatError(f"unknown audio format {fmt!r}; expected one of {sorted(CONTAINERS) + sorted(ENCODED_TYPES)}")
    c = CONTAINERS[fmt]
    if not _writable(c.sf_format, c.subtype):
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


def _ffmpeg() -> str:
    path = shutil.which("ffmpeg")
    if path is None:
        raise AudioFormatError("audio format 'm4a' needs ffmpeg on PATH (Debian: apt-get install -y ffmpeg)")
    return path


def supported_formats() -> list[str]:
    """Formats this machine can write (opus depends on how libsndfile was built, m4a on ffmpeg)."""
    formats = [f for f, c in CONTAINERS.items() if _writable(c.sf_format, c.subtype)]
    return formats + ["mp3"] + (["m4a"] if shutil.which("ffmpeg") else [])


def mp3_kbps(sample_rate: int) -> int:
    """The constant bit rate MP3s are written at: 192 kb/s at CD-class rates, less where MPEG-2 caps it."""
    return MP3_KBPS if sample_rate >= 32000 else MP3_KBPS_LOW_RATES


def clip(audio: np.ndarray) -> np.ndarray:
    """float32 audio clipped to [-1, 1], so every format (lossy codecs too) gets the same bounded signal."""
    return np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)


def _channels(audio: np.ndarray) -> int:
    return 1 if audio.ndim == 1 else audio.shape[1]


def encode(audio: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Encode float32 audio (T,) or (T, C) into one object's bytes in format `fmt`."""
    if fmt in ENCODED_TYPES:
        buf = io.BytesIO()
        with open_writer(buf, sample_rate, _channels(audio), fmt) as w:
            w.write(clip(audio))
        return buf.getvalue()
    if fmt == "wav" and not WAV_BY_LIBSNDFILE:
        return _wav_pcm16(audio, sample_rate)
    c = container(fmt, sample_rate)
    buf = io.BytesIO()
    sf.write(buf, clip(audio), sample_rate, format=c.sf_format, subtype=c.subtype)
    return buf.getvalue()


def _wav_pcm16(audio: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV, byte for byte what libsndfile writes (its header, its float -> int16 rounding:
    x * 2^31 in float32, rounded to int32, the top 16 bits; tests/test_audio.py), written with the
    standard library's `wave` in one call. libsndfile writing into memory calls back into Python for
    every chunk, each call taking the GIL, on the upload threads while the engine's threads launch GPU
    work: py-spy --gil put soundfile at 5.6% of the GIL samples of a GPU bench process running the
    engine (SoundFile._cdata_io and its format checks, bench/results/gpu_h200_worker13_pyspy.txt);
    this is one numpy pass and one write."""
    x = clip(audio)
    scaled = np.rint(x * np.float32(2**31)).astype(np.float64)  # float32 product, as libsndfile's
    pcm = (np.clip(scaled, -(2**31), 2**31 - 1).astype(np.int64) >> 16).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(_channels(x))
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _decode_aac(data: bytes, name: str) -> tuple[np.ndarray, int]:
    ffmpeg = _ffmpeg()
    probe_cmd = [str(Path(ffmpeg).with_name("ffprobe")), "-v", "error", "-select_streams", "a:0",
                 "-show_entries", "stream=channels,sample_rate", "-of", "csv=p=0", "pipe:0"]
    meta = subprocess.run(probe_cmd, input=data, capture_output=True)
    try:
        rate_s, channels_s = meta.stdout.decode().strip().split(",")[:2]
        rate, channels = int(rate_s), int(channels_s)
    except ValueError:
        raise AudioDecodeError(f"cannot decode audio {name}: no audio stream in this MP4 "
                               f"({meta.stderr.decode(errors='replace').strip()[-300:]})") from None
    proc = subprocess.run([ffmpeg, "-nostdin", "-v", "error", "-i", "pipe:0", "-f", "f32le", "pipe:1"],
                          input=data, capture_output=True)
    if proc.returncode != 0:
        raise AudioDecodeError(f"cannot decode audio {name}: {proc.stderr.decode(errors='replace').strip()[-500:]}")
    audio = np.frombuffer(proc.stdout, dtype="<f4").reshape(-1, channels)
    return (audio[:, 0] if channels == 1 else audio).copy(), rate


def _is_mp4(data: bytes) -> bool:
    return data[4:8] == b"ftyp"


def decode(data: bytes, name: str = "<bytes>") -> tuple[np.ndarray, int]:
    """Decode an object into float32 audio (T,) mono or (T, C), and its sample rate."""
    if _is_mp4(data):
        return _decode_aac(data, name)
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
    """Rate, length and channels from an object's header, without decoding the samples (AAC: decoded)."""
    if _is_mp4(data):
        audio, sr = _decode_aac(data, name)
        return AudioInfo(sr, len(audio), _channels(audio))
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise AudioDecodeError(f"cannot read audio header of {name}: {e}") from e
    return AudioInfo(info.samplerate, info.frames, info.channels)


def duration_s(audio: np.ndarray, sample_rate: int) -> float:
    """Seconds of audio in an array (T,) or (T, C)."""
    return len(audio) / sample_rate


class _Mp3Writer:
    """Constant-bit-rate MP3 through pedalboard's LAME, appended piece by piece (gapless header)."""

    def __init__(self, target, sample_rate: int, channels: int, kbps: int | None = None):
        from pedalboard.io import AudioFile

        quality = kbps or mp3_kbps(sample_rate)
        if isinstance(target, io.IOBase):
            self._f = AudioFile(target, "w", sample_rate, channels, quality=quality, format="mp3")
        else:  # a path names its format by its suffix
            self._f = AudioFile(str(target), "w", sample_rate, channels, quality=quality)

    def write(self, audio: np.ndarray) -> None:
        a = np.asarray(audio, dtype=np.float32)
        self._f.write(a[None, :] if a.ndim == 1 else a.T)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AacWriter:
    """AAC-LC in MP4 (.m4a) through an ffmpeg process fed raw float32 PCM on stdin."""

    def __init__(self, target, sample_rate: int, channels: int, kbps: int | None = None):
        self._target = target
        self._out = target if not isinstance(target, io.IOBase) else None
        self._tmp = None
        if self._out is None:  # MP4 needs a seekable file to finish its index: write one, then copy
            import tempfile

            self._tmp = tempfile.NamedTemporaryFile(suffix=".m4a", delete=False)
            self._tmp.close()
            self._out = self._tmp.name
        cmd = [_ffmpeg(), "-nostdin", "-v", "error", "-y", "-f", "f32le", "-ar", str(sample_rate), "-ac",
               str(channels), "-i", "pipe:0", "-c:a", "aac", "-b:a", f"{kbps or AAC_KBPS}k",
               "-movflags", "+faststart", "-f", "ipod", str(self._out)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE)

    def write(self, audio: np.ndarray) -> None:
        self._proc.stdin.write(np.ascontiguousarray(audio, dtype="<f4").tobytes())

    def close(self) -> None:
        self._proc.stdin.close()
        stderr = self._proc.stderr.read().decode(errors="replace")
        rc = self._proc.wait()
        try:
            if rc != 0:
                raise AudioFormatError(f"ffmpeg failed ({rc}) writing AAC: {stderr.strip()[-500:]}")
            if self._tmp is not None:
                self._target.write(Path(self._out).read_bytes())
        finally:
            if self._tmp is not None:
                Path(self._out).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_writer(path, sample_rate: int, channels: int, fmt: AudioFormat, *, kbps: int | None = None):
    """A writer in format `fmt` (to a path or a binary file object), for audio appended piece by piece.

    Write float32 arrays clipped with `clip`; close it (or use it as a context manager) to finish.
    `kbps` sets the bit rate of mp3/m4a (default: `mp3_kbps(rate)` / AAC_KBPS).
    """
    if fmt == "mp3":
        return _Mp3Writer(path, sample_rate, channels, kbps)
    if fmt == "m4a":
        return _AacWriter(path, sample_rate, channels, kbps)
    c = container(fmt, sample_rate)
    return sf.SoundFile(
        path if isinstance(path, io.IOBase) else str(path), "w", samplerate=sample_rate, channels=channels,
        format=c.sf_format, subtype=c.subtype,
    )
