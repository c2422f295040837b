"""The torch-free voice frontend (producer/audio_features.py, producer/voice.py, voxbatch/voice.py)
against the official CosyVoice2 frontend's outputs (`reference.npz` section d and the e2e prompt).

Tolerances (max abs difference unless stated):
  - prompt mel: 1e-4 (measured 3.6e-5; we compute in float64, the official in float32 torch);
  - whisper log-mel, on `dsp_wav16k`: 1e-4 where the reference is above its max-8 floor
    (measured 4.1e-5 everywhere);
  - Kaldi fbank via kaldi-native-fbank, on `dsp_wav16k`: 5e-4 (the fixture README saw 3.1e-4 max,
    8.5e-6 mean against torchaudio's Python fbank; measured the same), mean abs 2e-5;
  - speech tokens of the (fake) tokenizer: exact; speaker embedding of the (fake) CAM++: 1e-4
    (measured 1e-5);
  - the prompt resampled by soxr differs from torchaudio's resampler, so tokens and embedding made
    from the file are checked for shape and closeness only; the fake tokenizer hashes its input.
The producer must not import torch: checked in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from voxbatch.producer import audio_features as af
from voxbatch.producer.voice import VoiceCreationError, align_prompt, create_voice, speaker_embedding, speech_tokens
from voxbatch.storage import LocalStorage
from voxbatch.voice import VoiceFormatError, VoiceNotFoundError, VoiceProfile, load_voice, save_voice

REPO = Path(__file__).resolve().parents[1]
MEL_TOL = 1e-4
WHISPER_TOL = 1e-4
FBANK_TOL = 5e-4
FBANK_MEAN_TOL = 2e-5
EMB_TOL = 1e-4
PROMPT_TEXT = "Good morning, we are testing speech synthesis today."


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> dict[str, np.ndarray]:
    with np.load(tiny_model_dir / "reference.npz") as z:
        return {k: z[k] for k in z.files if k.startswith(("dsp_", "e2e_prompt", "e2e_embedding"))}


def test_producer_imports_without_torch():
    code = (
        "import sys, producer.voice, producer.audio_features, voxbatch.voice; "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_load_wav_matches_official_loader(tiny_model_dir, ref):
    wav, rate = af.load_wav(tiny_model_dir / "prompt_24k.wav")
    assert rate == 24000 and wav.dtype == np.float32
    np.testing.assert_array_equal(wav, ref["dsp_wav24k"][0])  # int16 / 32768, bit-exact


def test_load_wav_mixes_channels_and_names_bad_files(tmp_path):
    stereo = np.stack([np.full(1600, 0.5), np.full(1600, -0.25)], axis=1)
    sf.write(tmp_path / "s.wav", stereo, 16000, subtype="FLOAT")
    wav, rate = af.load_wav(tmp_path / "s.wav")
    assert rate == 16000 and wav.shape == (1600,) and np.allclose(wav, 0.125)
    (tmp_path / "bad.wav").write_bytes(b"RIFF not really a wave file")
    with pytest.raises(af.AudioError, match=r"bad\.wav"):
        af.load_wav(tmp_path / "bad.wav")
    with pytest.raises(af.AudioError, match=r"absent\.wav"):
        af.load_wav(tmp_path / "absent.wav")


def test_mel_filterbank_is_slaney(ref):
    fb = af.mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert fb.shape == (80, 961) and fb.dtype == np.float32
    assert fb.min() >= 0 and (fb.max(axis=1) > 0).all()  # every filter has support
    assert fb[:, np.linspace(0, 12000, 961) > 8000].max() == 0  # nothing above fmax
    assert af.mel_filterbank(24000, 1920, 80, 0.0, 8000.0) is fb  # cached
    np.testing.assert_allclose(af.mel_to_hz(af.hz_to_mel(np.array([0.0, 440.0, 1000.0, 7999.0]))),
                               [0.0, 440.0, 1000.0, 7999.0], rtol=1e-12)


def test_prompt_mel(ref):
    mel = af.prompt_mel(ref["dsp_wav24k"][0])
    want = ref["dsp_prompt_mel"][0]
    assert mel.shape == want.shape == (150, 80)
    assert np.abs(mel - want).max() <= MEL_TOL


def test_whisper_log_mel(ref):
    got = af.whisper_log_mel(ref["dsp_wav16k"][0])
    want = ref["dsp_whisper_logmel"][0]
    assert got.shape == want.shape == (128, 300)
    assert int(ref["dsp_whisper_len"][0]) == got.shape[1]
    above_floor = want > want.min() + 1e-3
    assert above_floor.mean() > 0.5
    assert np.abs(got - want)[above_floor].max() <= WHISPER_TOL


def test_kaldi_fbank(ref):
    raw = af.kaldi_fbank(ref["dsp_wav16k"][0])
    assert raw.shape == ref["dsp_fbank_raw"].shape == (298, 80)
    diff = np.abs(raw - ref["dsp_fbank_raw"])
    assert diff.max() <= FBANK_TOL and diff.mean() <= FBANK_MEAN_TOL
    cmn = af.mean_normalized_fbank(ref["dsp_wav16k"][0])
    assert np.abs(cmn - ref["dsp_fbank_cmn"][0]).max() <= FBANK_TOL
    assert np.abs(cmn.mean(axis=0)).max() < 1e-5


def test_speech_tokens_exact(tiny_model_dir, ref):
    tokens = speech_tokens(tiny_model_dir, ref["dsp_wav16k"][0])
    assert tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, ref["dsp_speech_token_fake_onnx"][0])


def test_speaker_embedding(tiny_model_dir, ref):
    emb = speaker_embedding(tiny_model_dir, ref["dsp_wav16k"][0])
    assert emb.shape == (192,) and emb.dtype == np.float32
    assert np.abs(emb - ref["dsp_campplus_emb_fake_onnx"][0]).max() <= EMB_TOL
    assert np.abs(emb - ref["e2e_embedding"][0]).max() <= EMB_TOL


def test_prompt_alignment_as_official(tiny_model_dir, ref):
    tokens = speech_tokens(tiny_model_dir, ref["dsp_wav16k"][0])
    tokens, mel = align_prompt(tokens, af.prompt_mel(ref["dsp_wav24k"][0]))
    np.testing.assert_array_equal(tokens, ref["e2e_prompt_speech_token"][0])
    assert np.abs(mel - ref["e2e_prompt_feat"][0]).max() <= MEL_TOL
    # Cut to whichever is shorter, at 2 frames per token.
    t, m = align_prompt(np.arange(10, dtype=np.int32), np.zeros((25, 80), np.float32))
    assert (len(t), len(m)) == (10, 20)
    t, m = align_prompt(np.arange(10, dtype=np.int32), np.zeros((13, 80), np.float32))
    assert (len(t), len(m)) == (6, 12)


def test_create_voice_from_file(tiny_model_dir, ref):
    profile = create_voice(tiny_model_dir, "tiny-1", tiny_model_dir / "prompt_24k.wav", f"  {PROMPT_TEXT} ")
    assert profile.name == "tiny-1" and profile.prompt_text == PROMPT_TEXT
    assert profile.sample_rate == 24000 and profile.source == "prompt_24k.wav"
    assert profile.prompt_speech_tokens.shape == (75,) and profile.prompt_speech_tokens.dtype == np.int32
    assert profile.prompt_mel.shape == (150, 80)
    # The 24 kHz file needs no resampling: the prompt mel is the official one.
    assert np.abs(profile.prompt_mel - ref["e2e_prompt_feat"][0]).max() <= MEL_TOL
    # The 16 kHz side is resampled by soxr, not torchaudio: near, not equal.
    assert np.abs(profile.speaker_embedding - ref["e2e_embedding"][0]).max() < 0.05
    assert ((profile.prompt_speech_tokens >= 0) & (profile.prompt_speech_tokens < 300)).all()


def _write(path: Path, wav: np.ndarray, rate: int) -> Path:
    sf.write(path, wav.astype(np.float32), rate, subtype="PCM_16")
    return path


def test_refusals_name_the_file_and_the_reason(tiny_model_dir, tmp_path):
    rng = np.random.default_rng(0)
    long_wav = _write(tmp_path / "long.wav", 0.1 * rng.standard_normal(16000 * 31), 16000)
    with pytest.raises(VoiceCreationError, match=r"long\.wav.*31\.0 s.*at most 30 s"):
        create_voice(tiny_model_dir, "v", long_wav, "text")
    silent = _write(tmp_path / "silent.wav", np.zeros(24000 * 3), 24000)
    with pytest.raises(VoiceCreationError, match=r"silent\.wav.*silent"):
        create_voice(tiny_model_dir, "v", silent, "text")
    narrow = _write(tmp_path / "narrow.wav", 0.1 * rng.standard_normal(8000 * 3), 8000)
    with pytest.raises(VoiceCreationError, match=r"narrow\.wav.*8000 Hz.*16000 Hz"):
        create_voice(tiny_model_dir, "v", narrow, "text")
    assert issubclass(VoiceCreationError, ValueError)  # the CLI reports ValueErrors as messages


def test_missing_or_malformed_onnx_is_named(tiny_model_dir, tmp_path, ref):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "campplus.onnx").write_bytes((tiny_model_dir / "campplus.onnx").read_bytes())
    with pytest.raises(VoiceCreationError, match=r"speech_tokenizer_v2\.onnx: missing"):
        speech_tokens(model_dir, ref["dsp_wav16k"][0])
    (model_dir / "speech_tokenizer_v2.onnx").write_bytes(b"\x00garbage, not a protobuf")
    with pytest.raises(VoiceCreationError, match=r"speech_tokenizer_v2\.onnx: not a loadable ONNX model"):
        speech_tokens(model_dir, ref["dsp_wav16k"][0])
    # The right file under the wrong name: its signature does not fit.
    (model_dir / "speech_tokenizer_v2.onnx").unlink()
    (model_dir / "speech_tokenizer_v2.onnx").write_bytes((tiny_model_dir / "campplus.onnx").read_bytes())
    with pytest.raises(VoiceCreationError, match=r"speech_tokenizer_v2\.onnx: expected a model with 2 inputs"):
        speech_tokens(model_dir, ref["dsp_wav16k"][0])


def test_profile_round_trip_through_local_storage(tiny_model_dir, tmp_path, ref):
    storage = LocalStorage(tmp_path / "store")
    profile = VoiceProfile(
        name="narrator.en-1",
        prompt_text="Ünïcödé prompt, 中文 too.",
        prompt_speech_tokens=ref["e2e_prompt_speech_token"][0],
        speaker_embedding=ref["e2e_embedding"][0],
        prompt_mel=ref["e2e_prompt_feat"][0],
        source="prompt.wav",
    )
    key = save_voice(storage, profile)
    assert key == "voices/narrator.en-1.safetensors" and storage.exists(key)
    back = load_voice(storage, "narrator.en-1")
    for field in ("name", "prompt_text", "sample_rate", "created_at", "source"):
        assert getattr(back, field) == getattr(profile, field), field
    for field in ("prompt_speech_tokens", "speaker_embedding", "prompt_mel"):
        got, want = getattr(back, field), getattr(profile, field)
        assert got.dtype == want.dtype and np.array_equal(got, want), field
    with pytest.raises(VoiceNotFoundError, match=r"'nobody' not found at .*voices/nobody\.safetensors"):
        load_voice(storage, "nobody")
    storage.put("voices/broken.safetensors", b"not safetensors")
    with pytest.raises(VoiceFormatError, match=r"broken\.safetensors"):
        load_voice(storage, "broken")


def test_profile_validation(ref):
    good = dict(prompt_text="t", prompt_speech_tokens=np.zeros(3, np.int32),
                speaker_embedding=np.zeros(192, np.float32), prompt_mel=np.zeros((6, 80), np.float32))
    with pytest.raises(VoiceFormatError, match="voice name"):
        VoiceProfile(name="../escape", **good)
    with pytest.raises(VoiceFormatError, match=r"speaker_embedding must be \(192,\)"):
        VoiceProfile(name="v", **{**good, "speaker_embedding": np.zeros(80, np.float32)})
    with pytest.raises(VoiceFormatError, match=r"prompt_mel must be \(T, 80\)"):
        VoiceProfile(name="v", **{**good, "prompt_mel": np.zeros((6, 100), np.float32)})
