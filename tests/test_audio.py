"""WAV objects (voxbatch/audio.py): written without libsndfile, byte for byte what libsndfile writes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from voxbatch import audio as audio_module
from voxbatch.audio import clip, encode


def _libsndfile_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, clip(audio), sample_rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.mark.parametrize("channels", [1, 2])
def test_wav_is_byte_for_byte_libsndfiles(channels: int, monkeypatch) -> None:
    """Header and samples equal libsndfile's PCM_16 WAV for random audio, full scale, values past full
    scale (clipped), values on and beside every rounding boundary, silence and an odd length."""
    rng = np.random.default_rng(0)
    n = 400_001
    audio = rng.uniform(-1.2, 1.2, n).astype(np.float32)
    steps = rng.integers(-32768, 32768, n) / 32768 + rng.choice([0.0, 0.5 / 32768, 0.5 / 65536, -0.5 / 65536], n)
    audio[: n // 2] = steps[: n // 2].astype(np.float32)
    audio[:8] = [1.0, -1.0, 0.0, -0.0, 2.0, -2.0, 1e-9, -1e-9]
    if channels == 2:
        audio = audio[: n - 1].reshape(-1, 2)
    for sample_rate in (24000, 44100):
        assert encode(audio, sample_rate, "wav") == _libsndfile_wav(audio, sample_rate)
    monkeypatch.setattr(audio_module, "WAV_BY_LIBSNDFILE", True)  # the bench's A/B switch: the same bytes
    assert encode(audio, 24000, "wav") == _libsndfile_wav(audio, 24000)
    assert encode(np.zeros(0, np.float32), 24000, "wav") == _libsndfile_wav(np.zeros(0, np.float32), 24000)


def test_wav_reads_back_as_the_audio() -> None:
    audio = np.sin(np.linspace(0, 200, 24000, dtype=np.float32)) * 0.5
    back, rate = sf.read(io.BytesIO(encode(audio, 24000, "wav")), dtype="float32")
    assert rate == 24000 and back.shape == audio.shape
    assert np.abs(back - audio).max() <= 1 / 32768
