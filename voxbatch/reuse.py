"""Content addressing of segment audio: re-render only what changed.

A segment's audio is fully determined by what is spoken and how: its spoken text, the voice profile's
content, the model files (and the engine's numerics), the synthesis params, the seed and the output
format. The worker hashes exactly those into `content_hash`, stores the audio under
`keys.cache(hash, fmt)` as well as under the job's own segment key, and before rendering a segment
looks for that cache object: found, it is copied into the job and the segment is recorded `reused`.
So an edited book resubmitted (or `voxbatch render` again into the same folder) renders only its new
or changed segments, across jobs, workers and restarts, and never across another model or voice
(both are in the hash). Seeds come from the content too (`models.content_seed`), not the position.

Everything hashed is computed by the worker itself (the model fingerprint, the voice profile bytes
read from storage) or taken from the task's own fields, so a message cannot point a job at audio
made for other content.
"""

from __future__ import annotations

import hashlib
import threading
import time

from voxbatch import keys
from voxbatch.models import RenderTask, TaskSegment
from voxbatch.storage import Storage

# Bump when the meaning of a cached object changes (e.g. how segments are encoded).
CACHE_VERSION = "voxbatch.cache/1"
# Tone-engine voices need no stored profile: "tone" and "tone:<name>" (each name a distinct pitch).
TONE_VOICE = "tone"


def is_builtin_voice(voice: str) -> bool:
    return voice == TONE_VOICE or (voice.startswith(TONE_VOICE + ":") and 0 < len(voice) - 5 <= 64)


def content_hash(engine_fingerprint: str, voice_digest: str, task: RenderTask, seg: TaskSegment) -> str:
    """Hex digest of everything that determines a segment's audio (see the module docstring).

    The task's fields other than its job, segments and reuse flag (voice name, format, params and
    whatever synthesis or encoding option a task grows later) all go in, so a new option is part of
    the hash without touching this function."""
    h = hashlib.sha256()
    task_fields = task.model_dump_json(exclude={"job_id", "segments", "reuse"})
    for part in (CACHE_VERSION, engine_fingerprint, voice_digest, task_fields, str(seg.seed), seg.text):
        h.update(part.encode())
        h.update(b"\x1f")
    return h.hexdigest()


# How long a worker trusts what it read of a voice profile (its digest here, its prepared tensors in the
# engine's VoiceCache): both re-read after this, so a voice re-created under the same name is picked up
# by the cache key and by the engine within the same window.
VOICE_TTL_S = 30.0


class VoiceDigests:
    """sha256 of each voice profile's stored bytes, re-read after `ttl_s` so a voice re-created
    under the same name (`voxbatch voice add` again) stops matching its old audio."""

    def __init__(self, storage: Storage, ttl_s: float = VOICE_TTL_S):
        self.storage, self.ttl_s = storage, ttl_s
        self._digests: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def get(self, voice: str) -> str:
        if is_builtin_voice(voice):
            return f"builtin:{voice}"
        now = time.monotonic()
        with self._lock:
            hit = self._digests.get(voice)
        if hit is not None and now - hit[1] < self.ttl_s:
            return hit[0]
        digest = hashlib.sha256(self.storage.get(keys.voice(voice))).hexdigest()  # KeyError: no such voice
        with self._lock:
            self._digests[voice] = (digest, now)
        return digest


class SegmentCache:
    """The worker's view of the cache: the key of a segment's audio, given the engine rendering it."""

    def __init__(self, storage: Storage, engine_fingerprint: str):
        self.storage = storage
        self.fingerprint = engine_fingerprint
        self.voices = VoiceDigests(storage)

    def key(self, task: RenderTask, seg: TaskSegment) -> str:
        return keys.cache(content_hash(self.fingerprint, self.voices.get(task.voice), task, seg), task.format)
