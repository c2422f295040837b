"""Voice profiles: what a worker needs to speak in a voice, stored as one safetensors object.

A profile is made once on the producer side (`producer.voice.create_voice`, ONNX frontend, no torch)
and read by every worker for every segment in that voice, so it holds the features, not the audio:
prompt speech tokens, speaker embedding and prompt mel, plus the prompt transcript. Arrays are
safetensors tensors; strings and scalars go in the safetensors metadata (string to string).

Stored at `keys.voice(name)` = `voices/<name>.safetensors`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

from voxbatch import keys
from voxbatch.storage import Storage

FORMAT = "voxbatch.voice/1"  # bump when the stored fields change meaning
SPEAKER_EMBEDDING_DIM = 192  # CAM++
N_MELS = 80
NAME_RE = keys.NAME_RE  # what a voice name may be (the rule lives with the storage keys it becomes)


class VoiceNotFoundError(LookupError):
    """No profile stored under that voice name."""


class VoiceFormatError(ValueError):
    """Bytes that are not a voice profile we can read, or fields that do not fit together."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, eq=False)
class VoiceProfile:
    name: str  # voice id: letters, digits, '_', '-', '.'; at most 64 characters
    prompt_text: str  # transcript of the prompt audio (the LLM's prompt text)
    prompt_speech_tokens: np.ndarray  # int32 (T_p,): speech tokens of the prompt audio, 25 per second
    speaker_embedding: np.ndarray  # float32 (192,): CAM++ embedding (the flow's speaker condition)
    prompt_mel: np.ndarray  # float32 (T_pm, 80): 24 kHz log mel of the prompt, T_pm = 2 * T_p
    sample_rate: int = 24000  # rate of the prompt mel (and of the audio the model makes)
    created_at: str = field(default_factory=_now)  # ISO 8601, UTC
    source: str = ""  # the prompt audio file it was made from (its name only, for people)

    def __post_init__(self) -> None:
        try:
            keys.check_name("voice name", self.name)  # also a storage key component
        except keys.BadName as e:
            raise VoiceFormatError(str(e)) from None
        object.__setattr__(self, "prompt_speech_tokens", np.ascontiguousarray(self.prompt_speech_tokens, np.int32))
        object.__setattr__(self, "speaker_embedding", np.ascontiguousarray(self.speaker_embedding, np.float32))
        object.__setattr__(self, "prompt_mel", np.ascontiguousarray(self.prompt_mel, np.float32))
        tokens, emb, mel = self.prompt_speech_tokens, self.speaker_embedding, self.prompt_mel
        if tokens.ndim != 1:
            raise VoiceFormatError(f"voice {self.name!r}: prompt_speech_tokens must be 1-D, got {tokens.shape}")
        if emb.shape != (SPEAKER_EMBEDDING_DIM,):
            raise VoiceFormatError(f"voice {self.name!r}: speaker_embedding must be ({SPEAKER_EMBEDDING_DIM},), got {emb.shape}")
        if mel.ndim != 2 or mel.shape[1] != N_MELS:
            raise VoiceFormatError(f"voice {self.name!r}: prompt_mel must be (T, {N_MELS}), got {mel.shape}")
        if not (np.isfinite(emb).all() and np.isfinite(mel).all()):
            raise VoiceFormatError(f"voice {self.name!r}: speaker_embedding or prompt_mel holds NaN/inf")

    @property
    def duration_s(self) -> float:
        return self.prompt_mel.shape[0] * 480 / self.sample_rate

    def to_bytes(self) -> bytes:
        from safetensors.numpy import save

        tensors = {
            "prompt_speech_tokens": self.prompt_speech_tokens,
            "speaker_embedding": self.speaker_embedding,
            "prompt_mel": self.prompt_mel,
        }
        metadata = {
            "format": FORMAT,
            "name": self.name,
            "prompt_text": self.prompt_text,
            "sample_rate": str(self.sample_rate),
            "created_at": self.created_at,
            "source": self.source,
        }
        return save(tensors, metadata=metadata)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "voice profile") -> VoiceProfile:
        from safetensors.numpy import load

        try:
            metadata = _metadata(data)
            tensors = load(data)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad bytes
            raise VoiceFormatError(f"{where}: not a safetensors voice profile ({type(e).__name__}: {e})") from e
        if metadata.get("format") != FORMAT:
            raise VoiceFormatError(f"{where}: format {metadata.get('format')!r}, expected {FORMAT!r}")
        missing = {"prompt_speech_tokens", "speaker_embedding", "prompt_mel"} - tensors.keys()
        if missing:
            raise VoiceFormatError(f"{where}: missing tensors {sorted(missing)}")
        try:
            return cls(
                name=metadata["name"],
                prompt_text=metadata.get("prompt_text", ""),
                prompt_speech_tokens=tensors["prompt_speech_tokens"],
                speaker_embedding=tensors["speaker_embedding"],
                prompt_mel=tensors["prompt_mel"],
                sample_rate=int(metadata.get("sample_rate", "24000")),
                created_at=metadata.get("created_at", ""),
                source=metadata.get("source", ""),
            )
        except (KeyError, ValueError) as e:
            raise VoiceFormatError(f"{where}: {e}") from e


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors `__metadata__` (header: u64 little-endian length, then JSON)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def save_voice(storage: Storage, profile: VoiceProfile) -> str:
    """Store a profile under `voices/<name>.safetensors` (atomic put); returns the key."""
    key = keys.voice(profile.name)
    storage.put(key, profile.to_bytes(), "application/octet-stream")
    return key


def load_voice(storage: Storage, name: str) -> VoiceProfile:
    key = keys.voice(name)
    try:
        data = storage.get(key)
    except KeyError:
        raise VoiceNotFoundError(
            f"voice {name!r} not found at {storage.describe(key)}; "
            f"create it with `voxbatch voice add {name} --wav PROMPT.wav --text TRANSCRIPT`"
        ) from None
    profile = VoiceProfile.from_bytes(data, where=storage.describe(key))
    if profile.name != name:
        raise VoiceFormatError(f"{storage.describe(key)}: holds voice {profile.name!r}, not {name!r}")
    return profile
