"""Create a voice profile from a prompt recording, on the CPU, without torch.

The official CosyVoice2 frontend (`frontend_zero_shot`) turns a prompt into three things, and so do we:
  - speech tokens: `speech_tokenizer_v2.onnx` on the 16 kHz whisper log-mel;
  - speaker embedding: `campplus.onnx` on the 16 kHz mean-normalised Kaldi fbank;
  - prompt mel: the 24 kHz mel the flow is conditioned on;
then cuts both to agree (2 mel frames per token). Audio is refused up front when it cannot make a
usable voice (too long for the tokenizer, silent, NaN/Inf samples, or recorded below 16 kHz), and so
is a transcript that is empty or so long that the prompt leaves no room in the LLM's positions for a
segment to be spoken (`check_transcript`), with the reason.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from voxbatch.producer.audio_features import (
    SAMPLE_RATE,
    TOKENIZER_SAMPLE_RATE,
    load_wav,
    mean_normalized_fbank,
    prompt_mel,
    resample,
    whisper_log_mel,
)
from voxbatch.voice import SPEAKER_EMBEDDING_DIM, VoiceProfile

MAX_PROMPT_S = 30.0  # the speech tokenizer's limit (the official frontend asserts it)
MIN_PROMPT_RMS = 1e-3  # -60 dBFS: below this the prompt is silence
MIN_NATIVE_SAMPLE_RATE = 16000  # upsampled narrowband audio has no speech above 4 kHz to learn from
TOKEN_MEL_RATIO = 2  # prompt mel frames per speech token (50 Hz mel, 25 Hz tokens)
# What one segment needs in the LLM's positions besides the prompt: the longest segment the segmenter
# makes (`SplitRules.hard_max_n` text tokens) and the fewest speech tokens the engine lets it speak
# (2 per text token, `MIN_TOKENS_PER_TEXT_TOKEN` in worker/cosyvoice2/engine.py).
SEGMENT_ROOM_TOKENS = 160 * (1 + 2)
SPEECH_TOKENIZER = "speech_tokenizer_v2.onnx"
SPEAKER_ENCODER = "campplus.onnx"


class VoiceCreationError(ValueError):
    """A prompt or a frontend model that cannot make a voice; the message names the file."""


def check_prompt(wav: np.ndarray, sample_rate: int, path: str | Path) -> None:
    """Refuse prompt audio that cannot make a usable voice, saying why."""
    duration_s = len(wav) / sample_rate
    if not np.isfinite(wav).all():
        bad = int(np.flatnonzero(~np.isfinite(wav))[0])
        raise VoiceCreationError(f"{path}: holds NaN or infinite samples (the first at sample {bad}); "
                                 "export the prompt again")
    if sample_rate < MIN_NATIVE_SAMPLE_RATE:
        raise VoiceCreationError(
            f"{path}: sample rate {sample_rate} Hz is below {MIN_NATIVE_SAMPLE_RATE} Hz; "
            "record or export the prompt at 16 kHz or more"
        )
    if duration_s > MAX_PROMPT_S:
        raise VoiceCreationError(
            f"{path}: prompt is {duration_s:.1f} s long; the speech tokenizer takes at most {MAX_PROMPT_S:.0f} s "
            "(3-10 s of clean speech works best)"
        )
    rms = float(np.sqrt(np.mean(np.square(wav, dtype=np.float64))))
    if rms < MIN_PROMPT_RMS:
        raise VoiceCreationError(
            f"{path}: prompt is silent (RMS {rms:.2e}, {20 * np.log10(max(rms, 1e-12)):.0f} dBFS; "
            f"needs at least {MIN_PROMPT_RMS:.0e})"
        )


def _session(path: str):  # -> onnxruntime.InferenceSession
    """One session per file version (sessions are costly to build; a replaced file is reloaded)."""
    try:
        stat = Path(path).stat()
    except FileNotFoundError:
        raise VoiceCreationError(f"{path}: missing (needed to make voice profiles)") from None
    return _cached_session(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _cached_session(path: str, mtime_ns: int, size: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    try:
        return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises pybind types (InvalidProtobuf, Fail, ...)
        raise VoiceCreationError(f"{path}: not a loadable ONNX model ({type(e).__name__}: {e})") from e


def _run(path: Path, inputs: list[np.ndarray]) -> np.ndarray:
    session = _session(str(path))
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise VoiceCreationError(f"{path}: expected a model with {len(inputs)} inputs, it has {names}")
    try:
        return session.run(None, dict(zip(names, inputs)))[0]
    except Exception as e:  # noqa: BLE001 - shape/type mismatches surface as onnxruntime errors
        raise VoiceCreationError(f"{path}: inference failed ({type(e).__name__}: {e})") from e


def speech_tokens(model_dir: str | Path, wav16k: np.ndarray) -> np.ndarray:
    """16 kHz (T_wav,) -> speech tokens int32 (T_wav // 640,) (25 per second)."""
    feats = whisper_log_mel(wav16k)[None]  # (1, 128, T_frames)
    path = Path(model_dir) / SPEECH_TOKENIZER
    out = _run(path, [feats, np.array([feats.shape[2]], dtype=np.int32)])
    return np.asarray(out).reshape(-1).astype(np.int32)


def speaker_embedding(model_dir: str | Path, wav16k: np.ndarray) -> np.ndarray:
    """16 kHz (T_wav,) -> speaker embedding float32 (192,)."""
    feats = mean_normalized_fbank(wav16k)[None]  # (1, T_frames, 80)
    path = Path(model_dir) / SPEAKER_ENCODER
    out = np.asarray(_run(path, [feats]), dtype=np.float32).reshape(-1)
    if out.shape != (SPEAKER_EMBEDDING_DIM,):
        raise VoiceCreationError(f"{path}: returned {out.shape[0]} values, expected a {SPEAKER_EMBEDDING_DIM}-d embedding")
    return out


def align_prompt(tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut tokens (T_tok,) and mel (T_mel, 80) to T_p tokens and 2 * T_p frames, T_p the most both
    allow (the official frontend does this so the flow sees the prompt at exactly 2 frames a token)."""
    n = min(mel.shape[0] // TOKEN_MEL_RATIO, tokens.shape[0])
    return tokens[:n], mel[: TOKEN_MEL_RATIO * n]


def check_transcript(model_dir: str | Path, text: str, n_speech_tokens: int, max_positions: int) -> None:
    """Refuse an empty transcript, or one whose prompt (transcript tokens + prompt speech tokens + 2)
    leaves fewer than SEGMENT_ROOM_TOKENS of the LLM's `max_positions` for a segment."""
    if not text.strip():
        raise VoiceCreationError("empty transcript: --text must say what the prompt audio says")
    from voxbatch.tokenizer import CosyVoice2Tokenizer

    n_text = len(CosyVoice2Tokenizer.from_model_dir(model_dir).encode(text.strip()))
    prompt = n_text + n_speech_tokens + 2
    if prompt + SEGMENT_ROOM_TOKENS > max_positions:
        raise VoiceCreationError(
            f"transcript of {n_text} tokens (+ {n_speech_tokens} prompt speech tokens) leaves "
            f"{max(max_positions - prompt, 0)} of the LLM's {max_positions} positions for a segment, which "
            f"needs {SEGMENT_ROOM_TOKENS}; use a shorter prompt and transcript (3-10 s of speech)")


def create_voice(model_dir: str | Path, name: str, wav_path: str | Path, text: str,
                 max_positions: int = 4096) -> VoiceProfile:
    """Prompt recording + its transcript -> a voice profile (store it with `voxbatch.voice.save_voice`).

    `max_positions` is the LLM's sequence capacity (`Settings.vllm_max_model_len`)."""
    if not text.strip():
        raise VoiceCreationError("empty transcript: --text must say what the prompt audio says")
    wav, rate = load_wav(wav_path)
    check_prompt(wav, rate, wav_path)
    wav16k = resample(wav, rate, TOKENIZER_SAMPLE_RATE)
    wav24k = resample(wav, rate, SAMPLE_RATE)
    tokens, mel = align_prompt(speech_tokens(model_dir, wav16k), prompt_mel(wav24k))
    if tokens.shape[0] == 0:
        raise VoiceCreationError(f"{wav_path}: too short to give a single speech token")
    check_transcript(model_dir, text, tokens.shape[0], max_positions)
    return VoiceProfile(
        name=name,
        prompt_text=text.strip(),
        prompt_speech_tokens=tokens,
        speaker_embedding=speaker_embedding(model_dir, wav16k),
        prompt_mel=mel,
        sample_rate=SAMPLE_RATE,
        source=Path(wav_path).name,
    )
