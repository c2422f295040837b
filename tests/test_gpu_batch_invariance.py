"""Re-render identity on a GPU: a segment rendered alone and inside a batch of others comes out as
`Settings.llm_dtype` promises (voxbatch/settings.py), on the tiny official-format fixture.

What is promised depends on the LLM dtype the settings resolve to on the GPU:
  float32   the same speech tokens alone and in any batch (so the same words, timing and length), and
            a mel within the flow's fp16 rounding (MEL_ATOL). Audio samples are not compared: HiFT
            integrates F0 into phase, so rounding moves samples (measured on CPU with this fixture:
            a 1e-4 change of the mel moves the waveform by ~25% of its RMS); lengths are.
  bfloat16  nothing: its GEMMs round differently per batch shape and RAS then draws other tokens.
`test_default_settings` checks what the default promises (and skips, saying why, while the default
resolves to bf16); `test_float32` checks the float32 promise whatever the default is. Segments are
compared alone, in a batch, and in the same batch reversed (other rows, other neighbours' order).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from voxbatch.models import SynthesisParams
from voxbatch.producer.voice import create_voice
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage
from voxbatch.voice import save_voice
from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine, Placement
from voxbatch.worker.engine import SynthesisRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# The flow runs fp16 on a GPU: a row's mel moves with its batch's shape by fp16 rounding. Bound: the
# flow's own fp16 batched-vs-single bound (tests/test_cosyvoice2_flow.py: 0.0033 measured on an H200,
# asserted <= 0.02; mels span about +-5).
MEL_ATOL = 0.02
MAX_TOKENS = 60  # bounds the run; sequences may stop earlier at eos (where it falls is compared too)

TEXTS = [
    "Hello there, this is a test of the engine.",
    "Short.",
    "A much longer sentence that goes on for a while, with commas, clauses and more words than the others.",
    "你好，世界。今天天气很好。",
    "The harbor was quiet at dawn, and the boats came back one by one.",
    "我们明天早上八点在车站见面，别迟到。",
]


@pytest.fixture(scope="module")
def storage_dir(tmp_path_factory, tiny_model_dir, tiny_facts) -> Path:
    path = tmp_path_factory.mktemp("storage")
    save_voice(LocalStorage(path), create_voice(tiny_model_dir, "v1", tiny_model_dir / "prompt_24k.wav", tiny_facts.prompt_text))
    return path


def settings_for(tiny_model_dir: Path, storage_dir: Path, **overrides) -> Settings:
    """The default settings a worker would have, pointed at the fixture and the voice's storage."""
    return Settings(engine="cosyvoice2", model_dir=str(tiny_model_dir), storage_url=storage_dir.as_uri(), **overrides)


def requests() -> list[SynthesisRequest]:
    return [SynthesisRequest(f"s{i}", t, "v1", 1000 + i, SynthesisParams(max_tokens=MAX_TOKENS)) for i, t in enumerate(TEXTS)]


def tokens_of(engine: CosyVoice2Engine, batch: list[SynthesisRequest]) -> dict[str, list[int]]:
    """Speech tokens of each request, the batch decoded together by the engine's LLM backend."""
    voice = engine.voices.get("v1")
    return {batch[r.index].segment_id: r.tokens for r in engine.llm.generate([engine.llm_request(q, voice) for q in batch])}


def mels_of(engine: CosyVoice2Engine, tokens: dict[str, list[int]], ids: list[str]) -> dict[str, torch.Tensor]:
    """The flow's mels of the given rows as one batch (engine.mels, the first half of engine.vocode)."""
    voice = engine.voices.get("v1")
    return dict(zip(ids, engine.mels([tokens[i] for i in ids], [voice] * len(ids))))


def audio_of(engine: CosyVoice2Engine, batch: list[SynthesisRequest]) -> dict[str, np.ndarray]:
    out = {}
    for r in engine.synthesize(batch):
        assert r.error is None, r.error
        out[r.request.segment_id] = r.audio
    return out


def assert_float32_promise(engine: CosyVoice2Engine) -> None:
    """Alone vs in a batch vs in the reversed batch: same tokens, same audio length, mel within MEL_ATOL."""
    batch = requests()
    ids = [r.segment_id for r in batch]
    alone = {}
    for r in batch:
        alone.update(tokens_of(engine, [r]))
    for name, order in (("batch", batch), ("reversed batch", batch[::-1])):
        together = tokens_of(engine, order)
        differ = {i: next((k for k, (a, b) in enumerate(zip(alone[i], together[i])) if a != b), None) for i in ids if alone[i] != together[i]}
        assert not differ, f"{name}: speech tokens differ from alone for {differ} (segment: first differing step)"
    mel_alone = {i: mels_of(engine, alone, [i])[i] for i in ids}
    mel_batch = mels_of(engine, alone, ids)
    for i in ids:
        assert mel_batch[i].shape == mel_alone[i].shape
        diff = float((mel_batch[i] - mel_alone[i]).abs().max())
        assert diff <= MEL_ATOL, f"{i}: mel in a batch differs from alone by {diff} (> {MEL_ATOL})"
    audio_alone = {}
    for r in batch:
        audio_alone.update(audio_of(engine, [r]))
    audio_batch = audio_of(engine, batch)
    spt = engine.samples_per_token
    for i in ids:
        assert len(audio_batch[i]) == len(audio_alone[i]) == spt * len(alone[i]), i
        assert np.isfinite(audio_batch[i]).all() and float(np.abs(audio_batch[i]).max()) > 0


def test_default_settings(tiny_model_dir, storage_dir):
    """What the default settings promise for a segment re-rendered in another batch."""
    settings = settings_for(tiny_model_dir, storage_dir)
    dtype = Placement.from_settings(settings).llm_dtype
    if dtype != torch.float32:
        pytest.skip(f"the default llm_dtype ({settings.llm_dtype!r}) resolves to {dtype} on this GPU, which promises no "
                    "re-render identity (Settings.llm_dtype); test_float32 checks what float32 promises")
    engine = CosyVoice2Engine.from_settings(settings)
    try:
        assert_float32_promise(engine)
    finally:
        engine.llm.close()


def test_float32(tiny_model_dir, storage_dir):
    """`llm_dtype=float32` on the GPU: the promise whatever the default is (the flip is tested before it is made)."""
    engine = CosyVoice2Engine.from_settings(settings_for(tiny_model_dir, storage_dir, llm_dtype="float32"))
    try:
        assert engine.placement.llm_dtype == torch.float32 and engine.placement.flow_dtype == torch.float16
        assert_float32_promise(engine)
    finally:
        engine.llm.close()
