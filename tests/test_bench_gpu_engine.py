"""The worker's torch LLM backend gives the same tokens whatever its row count, and the GPU benchmark's
variants (grouped decode attention) and corpus do what they claim (CPU, tiny fixture).

Same requests, same seeds -> identical speech tokens, whatever the number of cache rows (continuous
batching refills rows in another order, in groups) and whichever decode attention
(`bench.gpu_engine.set_grouped_decode`). On CPU the CUDA graphs are off; the step they capture is the
same function.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.gpu_engine import set_grouped_decode
from bench.gpu_models import make_corpus, plan_text
from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM
from voxbatch.worker.cosyvoice2.llm_backend import LlmRequest
from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.set_num_threads(1)
    return CosyVoice2LM.from_model_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def requests(tiny_model_dir) -> list[LlmRequest]:
    with np.load(tiny_model_dir / "reference.npz") as z:
        text = [int(t) for t in z["llm_text_token"]]
        speech = [int(t) for t in z["llm_prompt_speech_token"]]
    # Mixed prompt and output lengths; eos masked for the whole length, so each runs to max_tokens
    # unless one of the other two stop ids is drawn (then both backends must stop at the same token).
    lengths = [7, 19, 3, 12, 25]
    return [LlmRequest(text[: len(text) - i], speech[: len(speech) - 2 * i], n, n, seed=100 + i) for i, n in enumerate(lengths)]


def _tokens(backend, reqs) -> dict[int, list[int]]:
    out = {r.index: r.tokens for r in backend.generate(reqs)}
    assert sorted(out) == list(range(len(reqs)))
    return out


def test_tokens_do_not_depend_on_row_count(model, requests):
    want = _tokens(TorchLlmBackend(model, max_batch=8, max_seq=256), requests)
    assert any(len(t) > 1 for t in want.values())
    for rows in (2, 5):  # 2 rows: refills while others decode
        got = _tokens(TorchLlmBackend(model, rows, 256, sync_every=4, bucket_batches=False), requests)
        assert got == want, f"rows={rows}"


def test_grouped_decode_attention_gives_the_same_tokens(model, requests):
    want = _tokens(TorchLlmBackend(model, 3, 256, bucket_batches=False), requests)
    set_grouped_decode(model, True)
    try:
        got = _tokens(TorchLlmBackend(model, 3, 256, bucket_batches=False), requests)
    finally:
        set_grouped_decode(model, False)
    assert got == want


def test_corpus_lengths_follow_speaking_rates():
    corpus = make_corpus(200, seed=3)
    assert {s.lang for s in corpus} == {"zh", "en"}
    for s in corpus:
        assert 1.5 <= s.audio_s <= 16.0
        assert plan_text(s.text)[1] == s.speech_tokens
    zh = next(s for s in corpus if s.lang == "zh")
    cjk = sum("\u4e00" <= c <= "\u9fff" for c in zh.text)
    assert abs(zh.audio_s - cjk / 4.5) < 0.05  # 4.5 characters per second, 25 tokens per second
