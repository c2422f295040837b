"""The `tone` engine: deterministic tones whose length follows the text. Not speech.

It exists to test and benchmark the whole distributed path on machines without a GPU, and for
capacity planning: it produces audio at the length real speech of the same text would have
(about 15 characters per second of English; Chinese characters count three times), as fast as
numpy can write samples, so whatever throughput the pipeline shows with it is the pipeline's own.
The same (text, voice, seed) always gives the same samples. `rtf` > 0 makes it take that many
seconds per second of audio, to stand in for a GPU of known speed. A segment whose text contains
`FAIL_MARKER` raises, so tests can drive the retry/failure path through real processes.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator

import numpy as np

from worker.engine import Engine, SynthesisRequest, SynthesisResult

SAMPLE_RATE = 24000
CHARS_PER_SECOND = 15.0
FAIL_MARKER = "[[tone:fail]]"
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def tone_duration_s(text: str) -> float:
    """Seconds of audio the tone engine makes for a text (CJK characters weigh 3, others 1)."""
    cjk = len(_CJK.findall(text))
    weight = cjk * 3 + (len(text) - cjk)
    return round(0.2 + weight / CHARS_PER_SECOND, 3)


def tone_samples(text: str) -> int:
    return int(round(tone_duration_s(text) * SAMPLE_RATE))


class ToneEngine(Engine):
    name = "tone"
    sample_rate = SAMPLE_RATE

    def __init__(self, max_batch: int = 64, rtf: float = 0.0):
        self.max_batch = max_batch
        self.rtf = rtf

    def warmup(self) -> None:
        list(self.synthesize([SynthesisRequest("warmup", "Warm up.", "default", 0)]))

    def synthesize(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        for req in batch:
            if FAIL_MARKER in req.text:
                raise ValueError(f"segment {req.segment_id}: text asks the tone engine to fail")
            n = tone_samples(req.text)
            if self.rtf:
                time.sleep(self.rtf * n / SAMPLE_RATE)
            voice_hz = 110 + int.from_bytes(hashlib.blake2b(req.voice.encode(), digest_size=2).digest(), "little") % 110
            hz = voice_hz * (1 + (req.seed % 7) / 12)
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01).astype(np.float32)
            audio = 0.2 * np.sin(2 * np.pi * hz * t).astype(np.float32) * fade
            yield SynthesisResult(req, audio)
