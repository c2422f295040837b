"""Benchmark only: how many speech tokens real speech of a text would take.

A model with random weights never emits eos, so the GPU benchmark forces every segment's length from
its text (`Settings.engine_forced_lengths`): 25 speech tokens per second of audio at ~4.5 Chinese
characters or ~2.6 English words per second. Shared by the engine and bench/gpu_models.py so the worker
process, the engine alone and the baseline decode the same lengths.
"""

from __future__ import annotations

TOKENS_PER_S = 25  # speech tokens per second of audio
ZH_CHARS_PER_S = 4.5
EN_WORDS_PER_S = 2.6


def cjk_chars(text: str) -> int:
    return sum(1 for c in text if "\u4e00" <= c <= "\u9fff")


def forced_speech_tokens(text: str) -> int:
    """Speech tokens of the text spoken at a natural rate (at least 1)."""
    cjk = cjk_chars(text)
    if cjk:
        return max(1, round(cjk / ZH_CHARS_PER_S * TOKENS_PER_S))
    return max(1, round(len(text.split()) / EN_WORDS_PER_S * TOKENS_PER_S))
