"""The `tone` engine: deterministic tones whose length follows the text. Not speech.

It exists to test and benchmark the whole distributed path on machines without a GPU, and for
capacity planning: it produces audio at the length real speech of the same text would have
(about 15 characters per second of English; Chinese characters count three times), as fast as
numpy can write samples, so whatever throughput the pipeline shows with it is the pipeline's own.
The same (text, voice, seed) always gives the same samples. `rtf` > 0 makes it take that many
seconds per second of audio, to stand in for a GPU of known speed.

Two markers in a segment's text let tests drive the failure paths through real processes:
`FAIL_MARKER` ("[[tone:fail]]") makes synthesis raise (the retry, then failed-for-good path), and
`CRASH_MARKER` ("[[tone:crash]]") makes the whole worker process SIGKILL itself while rendering
that segment, as the OOM killer or a driver fault would: nothing is recorded, the task stays unacked,
and only the attempt counter in Redis stops the redelivered task from crashing workers forever.
Before it dies it starts a helper process that would outlive it, as vLLM's engine core outlives a
worker that aborts (its pid is in the crash line): the launcher must end it before the next worker starts.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from voxbatch.worker.engine import Engine, SynthesisRequest, SynthesisResult

SAMPLE_RATE = 24000
CHARS_PER_SECOND = 15.0
FAIL_MARKER = "[[tone:fail]]"
CRASH_MARKER = "[[tone:crash]]"
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def tone_duration_s(text: str) -> float:
    """Seconds of audio the tone engine makes for a text (CJK characters weigh 3, others 1)."""
    cjk = len(_CJK.findall(text))
    weight = cjk * 3 + (len(text) - cjk)
    return round(0.2 + weight / CHARS_PER_SECOND, 3)


def tone_samples(text: str) -> int:
    return int(round(tone_duration_s(text) * SAMPLE_RATE))


def _crash(segment_id: str) -> None:
    """Die at once, no cleanup, no exception handler reached: SIGKILL, like the kernel's OOM killer,
    leaving a helper process behind (one that sleeps, in the worker's process group)."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"tone engine: segment {segment_id} asks for a crash; helper pid {helper.pid}; SIGKILL to pid {os.getpid()}",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


class ToneEngine(Engine):
    name = "tone"
    sample_rate = SAMPLE_RATE

    ROWS = 64  # segments per batch when the settings leave it to the engine (engine_max_batch unset)

    def __init__(self, max_batch: int | None = None, rtf: float = 0.0):
        self.max_batch = max_batch or self.ROWS
        self.rtf = rtf

    def warmup(self) -> None:
        list(self.synthesize([SynthesisRequest("warmup", "Warm up.", "default", 0)]))

    def synthesize(self, batch: list[SynthesisRequest]) -> Iterator[SynthesisResult]:
        for req in batch:
            if FAIL_MARKER in req.text:
                raise ValueError(f"segment {req.segment_id}: text asks the tone engine to fail")
            if CRASH_MARKER in req.text:
                _crash(req.segment_id)
            n = tone_samples(req.text)
            if self.rtf:
                time.sleep(self.rtf * n / SAMPLE_RATE)
            voice_hz = 110 + int.from_bytes(hashlib.blake2b(req.voice.encode(), digest_size=2).digest(), "little") % 110
            hz = voice_hz * (1 + (req.seed % 7) / 12)
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.01).astype(np.float32)
            audio = 0.2 * np.sin(2 * np.pi * hz * t).astype(np.float32) * fade
            yield SynthesisResult(req, audio)
