"""Parity of our CosyVoice2 LLM, sampler, tokenizer and torch backend with the official implementation.

References come from `cosyvoice2-tiny/reference.npz` (official code, fp32 CPU, 1 thread). Tolerances:
- input embeddings (`llm_lm_input`, `e2e_lm_input`): exact (they are row gathers);
- log-probs (teacher-forced full path, KV-cache path, greedy `weighted_scores`): 1e-4 abs on finite
  entries, and -inf exactly where the reference has -inf (the fixture README suggests 1e-4; we reach
  0 on the full path and ~5e-6 on the cache path);
- greedy tokens: exact (smallest top-1/top-2 gap in the reference is 0.135);
- official-RNG replay of `e2e_speech_token`: exact (bit-exact logits are needed for the multinomial draws);
- tokenizer ids: exact.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError
from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM, LlmDims
from voxbatch.worker.cosyvoice2.llm_backend import LlmRequest
from voxbatch.worker.cosyvoice2.sampling import OfficialRas, RasConfig, mask_eos, ras_sample, seed_keys, uniforms
from voxbatch.tokenizer import CosyVoice2Tokenizer
from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGP_ATOL = 1e-4
MIXED_MAX_TOKENS = 50  # the longest of `_mixed_requests`


@pytest.fixture(scope="module")
def meta(tiny_facts) -> dict:
    return tiny_facts.meta


@pytest.fixture(scope="module")
def seq_max(ref) -> int:
    """Cache length for the fixture's prompt plus the longest sequence these tests decode."""
    return ref["llm_lm_input"].shape[1] + max(len(ref["llm_forced_speech_token"]), len(ref["llm_greedy_tokens"]), MIXED_MAX_TOKENS)


@pytest.fixture(scope="module")
def model(tiny_model_dir, seq_max) -> CosyVoice2LM:
    m = CosyVoice2LM.from_model_dir(tiny_model_dir)
    m.setup_cache(batch_max=4, seq_max=seq_max)
    return m


@pytest.fixture(scope="module")
def backend(tiny_model_dir, seq_max) -> TorchLlmBackend:
    return TorchLlmBackend.from_model_dir(tiny_model_dir, max_batch=4, max_seq=seq_max)


def _llm_prompt(ref) -> tuple[list[int], list[int]]:
    return ref["llm_prompt_text_token"].tolist() + ref["llm_text_token"].tolist(), ref["llm_prompt_speech_token"].tolist()


def _assert_logp_close(got: torch.Tensor, want: np.ndarray) -> None:
    want_t = torch.from_numpy(want)
    finite = torch.isfinite(want_t)
    assert torch.equal(torch.isfinite(got), finite), "-inf entries differ"
    err = (got[finite] - want_t[finite]).abs().max().item()
    assert err <= LOGP_ATOL, f"max |diff| {err:.3g} > {LOGP_ATOL}"


# -- dimensions and loading ------------------------------------------------------------------------


def test_dims_come_from_config_and_yaml(tiny_model_dir, tiny_facts):
    d = LlmDims.from_model_dir(tiny_model_dir)
    q = tiny_facts.qwen
    assert (d.hidden, d.intermediate, d.n_layers, d.n_heads, d.n_kv_heads) == (
        q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"], q["num_attention_heads"], q["num_key_value_heads"])
    assert d.head_dim == q.get("head_dim", q["hidden_size"] // q["num_attention_heads"])
    assert d.rope_theta == q["rope_theta"] and d.speech_token_size == tiny_facts.speech_token_size
    assert list(d.stop_ids) == tiny_facts.stop_ids and d.eos_id == tiny_facts.eos_id
    assert RasConfig.from_model_dir(tiny_model_dir) == RasConfig(**tiny_facts.ras)


def _model_dir_with(tiny_model_dir: Path, tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    shutil.copy(tiny_model_dir / "CosyVoice-BlankEN" / "config.json", tmp_path / "CosyVoice-BlankEN" / "config.json")
    shutil.copy(tiny_model_dir / "cosyvoice2.yaml", tmp_path / "cosyvoice2.yaml")
    torch.save(state, tmp_path / "llm.pt")
    return tmp_path


def test_strict_keys_error_names_the_file(tiny_model_dir, tmp_path):
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    del state["llm_decoder.bias"]
    state["llm.extra.weight"] = torch.zeros(1)
    model_dir = _model_dir_with(tiny_model_dir, tmp_path, state)
    with pytest.raises(ModelDirError, match=r"llm\.pt.*llm_decoder\.bias") as info:
        CosyVoice2LM.from_model_dir(model_dir)
    assert "llm.extra.weight" in str(info.value)


def test_shape_mismatch_error_names_the_file(tiny_model_dir, tiny_facts, tmp_path):
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    state["speech_embedding.weight"] = torch.zeros(tiny_facts.llm_vocab + 1, tiny_facts.qwen["hidden_size"])
    with pytest.raises(ModelDirError, match=r"llm\.pt: speech_embedding\.weight has shape"):
        CosyVoice2LM.from_model_dir(_model_dir_with(tiny_model_dir, tmp_path, state))


def test_weights_come_from_llm_pt_not_the_decoy(tiny_model_dir, model):
    from safetensors.torch import load_file

    decoy = load_file(str(tiny_model_dir / "CosyVoice-BlankEN" / "model.safetensors"))
    ours = model.body.embed_tokens.weight
    assert not any(t.shape == ours.shape and torch.allclose(t.float(), ours, atol=1e-2) for t in decoy.values())


# -- the input sequence ----------------------------------------------------------------------------


def test_lm_input_matches_reference(model, ref):
    embeds, lengths = model.embed_batch([_llm_prompt(ref)])
    assert lengths.tolist() == [ref["llm_lm_input"].shape[1]]
    assert torch.equal(embeds, torch.from_numpy(ref["llm_lm_input"]))


def test_e2e_lm_input_matches_reference(model, ref):
    text = ref["e2e_prompt_text_token"][0].tolist() + ref["e2e_text_token"][0].tolist()
    embeds, _ = model.embed_batch([(text, ref["e2e_prompt_speech_token"][0].tolist())])
    assert torch.equal(embeds, torch.from_numpy(ref["e2e_lm_input"]))


# -- teacher forcing and greedy decoding -----------------------------------------------------------


@torch.inference_mode()
def test_teacher_forced_full_path(model, ref):
    forced = torch.from_numpy(ref["llm_forced_speech_token"]).long()
    embeds, _ = model.embed_batch([_llm_prompt(ref)])
    seq = torch.cat([embeds, model.speech_embedding(forced)[None]], dim=1)  # (1, 87, D)
    _assert_logp_close(model(seq, torch.tensor([seq.shape[1]]))[0], ref["llm_tf_logp"])


@torch.inference_mode()
def test_teacher_forced_kv_cache_path(model, ref):
    forced = ref["llm_forced_speech_token"].tolist()
    embeds, lengths = model.embed_batch([_llm_prompt(ref)])
    L = embeds.shape[1]
    rows = [model.prefill(embeds, lengths, all_positions=True)[0]]  # (47, V)
    for i, tok in enumerate(forced):
        rows.append(model.decode_step(torch.tensor([tok]), torch.tensor([L + i]), kv_len=L + i + 1))
    _assert_logp_close(torch.cat(rows), ref["llm_tf_logp_step"])


@torch.inference_mode()
def test_teacher_forced_kv_cache_path_full_cache_width(model, ref):
    """The compiled decode step attends over the whole cache (masked): same numbers."""
    forced = ref["llm_forced_speech_token"].tolist()[:8]
    embeds, lengths = model.embed_batch([_llm_prompt(ref)])
    L = embeds.shape[1]
    rows = [model.prefill(embeds, lengths)]
    for i, tok in enumerate(forced):
        rows.append(model.decode_step(torch.tensor([tok]), torch.tensor([L + i])))
    _assert_logp_close(torch.cat(rows), ref["llm_tf_logp_step"][L - 1 : L + len(forced)])


@torch.inference_mode()
def test_greedy_tokens_and_logp(model, ref, meta):
    min_len = meta["llm"]["min_len"]
    embeds, lengths = model.embed_batch([_llm_prompt(ref)])
    L = embeds.shape[1]
    logp, tokens, scores = model.prefill(embeds, lengths), [], []
    for i in range(len(ref["llm_greedy_tokens"])):
        masked = mask_eos(logp, torch.tensor([i]), torch.tensor([min_len]), model.dims.eos_id)
        scores.append(masked)
        tokens.append(int(masked.argmax(-1)))
        logp = model.decode_step(torch.tensor([tokens[-1]]), torch.tensor([L + i]), kv_len=L + i + 1)
    assert tokens == ref["llm_greedy_tokens"].tolist()
    _assert_logp_close(torch.cat(scores), ref["llm_greedy_logp"])


def test_backend_greedy_tokens(backend, ref, meta):
    text, speech = _llm_prompt(ref)
    req = LlmRequest(text, speech, min_tokens=meta["llm"]["min_len"], max_tokens=len(ref["llm_greedy_tokens"]), seed=0, greedy=True)
    (result,) = list(backend.generate([req]))
    assert result.index == 0 and result.tokens == ref["llm_greedy_tokens"].tolist()


def test_official_rng_replay_of_e2e_tokens(tiny_model_dir, model, ref, meta):
    """Bonus: torch.manual_seed + the official multinomial order reproduce e2e_speech_token exactly."""
    e2e = meta["e2e"]
    text = ref["e2e_prompt_text_token"][0].tolist() + ref["e2e_text_token"][0].tolist()
    sampler = OfficialRas(RasConfig.from_model_dir(tiny_model_dir))
    m = CosyVoice2LM.from_model_dir(tiny_model_dir)
    m.setup_cache(batch_max=1, seq_max=ref["e2e_lm_input"].shape[1] + e2e["max_len"])
    with torch.inference_mode():
        embeds, lengths = m.embed_batch([(text, ref["e2e_prompt_speech_token"][0].tolist())])
        L, out = embeds.shape[1], []
        torch.manual_seed(e2e["seed"])
        logp = m.prefill(embeds, lengths)
        for i in range(e2e["max_len"]):
            masked = mask_eos(logp, torch.tensor([i]), torch.tensor([e2e["min_len"]]), m.dims.eos_id)
            tok = sampler(masked[0], out)
            if tok in m.dims.stop_ids:
                break
            out.append(tok)
            logp = m.decode_step(torch.tensor([tok]), torch.tensor([L + i]), kv_len=L + i + 1)
    assert out == ref["e2e_speech_token"][0].tolist()


# -- batching --------------------------------------------------------------------------------------


def _mixed_requests(ref, greedy: bool) -> list[LlmRequest]:
    text, speech = _llm_prompt(ref)
    return [
        LlmRequest(text, speech, min_tokens=24, max_tokens=40, seed=11, greedy=greedy),
        LlmRequest(text[:5], [], min_tokens=3, max_tokens=30, seed=12, greedy=greedy),
        LlmRequest(text[3:], speech[:7], min_tokens=10, max_tokens=MIXED_MAX_TOKENS, seed=13, greedy=greedy),
    ]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "ras"])
def test_batched_equals_single(backend, ref, tiny_facts, greedy):
    """Greedy: batching must not change tokens. RAS: a segment's seed alone decides its tokens."""
    reqs = _mixed_requests(ref, greedy)
    batched = {r.index: r.tokens for r in backend.generate(reqs)}
    single = [next(iter(backend.generate([q]))).tokens for q in reqs]
    assert sorted(batched) == [0, 1, 2]
    assert [batched[i] for i in range(3)] == single
    assert len({len(t) for t in single}) > 1, "requests should stop at different lengths"
    for q, toks in zip(reqs, single):
        assert len(toks) <= q.max_tokens and all(0 <= t < tiny_facts.speech_token_size for t in toks)


def test_padded_batch_rows_change_nothing(tiny_model_dir, backend, ref, seq_max):
    """Waves padded to a power of two (as compiled GPU decoding does) give the same tokens."""
    padded = TorchLlmBackend(CosyVoice2LM.from_model_dir(tiny_model_dir), max_batch=4, max_seq=seq_max, bucket_batches=True)
    reqs = _mixed_requests(ref, greedy=False)  # 3 requests -> 4 rows
    assert {r.index: r.tokens for r in padded.generate(reqs)} == {r.index: r.tokens for r in backend.generate(reqs)}


def test_continuous_batching_refills_freed_rows(tiny_model_dir, backend, ref, seq_max):
    """6 requests through 2 rows: each freed row takes the next request; tokens as if decoded alone."""
    two_rows = TorchLlmBackend(CosyVoice2LM.from_model_dir(tiny_model_dir), max_batch=2, max_seq=seq_max, sync_every=4)
    reqs = _mixed_requests(ref, greedy=False) + _mixed_requests(ref, greedy=True)
    reqs = [LlmRequest(**{**q.__dict__, "seed": 50 + i}) for i, q in enumerate(reqs)]
    got = {r.index: r.tokens for r in two_rows.generate(reqs)}
    assert sorted(got) == list(range(6))
    assert [got[i] for i in range(6)] == [next(iter(backend.generate([q]))).tokens for q in reqs]


@pytest.mark.parametrize("look_lag", [3, 7])
def test_lagged_looks_change_no_tokens(tiny_model_dir, backend, ref, seq_max, look_lag):
    """Looks read `look_lag` steps after they are taken (as on CUDA): rows still stop, free and refill,
    and every request gets the tokens it gets decoded alone."""
    lagged = TorchLlmBackend(CosyVoice2LM.from_model_dir(tiny_model_dir), max_batch=2, max_seq=seq_max, sync_every=4,
                             look_lag=look_lag)
    reqs = _mixed_requests(ref, greedy=False) + _mixed_requests(ref, greedy=True)
    reqs = [LlmRequest(**{**q.__dict__, "seed": 70 + i}) for i, q in enumerate(reqs)]
    got = {r.index: r.tokens for r in lagged.generate(reqs)}
    assert sorted(got) == list(range(6))
    assert [got[i] for i in range(6)] == [next(iter(backend.generate([q]))).tokens for q in reqs]


def test_ras_seed_changes_tokens_and_order_does_not(backend, ref):
    reqs = _mixed_requests(ref, greedy=False)
    first = {r.index: r.tokens for r in backend.generate(reqs)}
    rev = {r.index: r.tokens for r in backend.generate(reqs[::-1])}
    assert [rev[2 - i] for i in range(3)] == [first[i] for i in range(3)]
    reseeded = LlmRequest(**{**reqs[0].__dict__, "seed": 99})
    assert next(iter(backend.generate([reseeded]))).tokens != first[0]


def test_max_tokens_and_validation(backend, ref, seq_max):
    text, speech = _llm_prompt(ref)
    (r,) = list(backend.generate([LlmRequest(text, speech, min_tokens=5, max_tokens=5, seed=1)]))
    assert len(r.tokens) == 5  # eos masked for all 5 steps, so the cap stops it
    with pytest.raises(ValueError, match="request 0: prompt"):
        list(backend.generate([LlmRequest(text, speech, min_tokens=0, max_tokens=seq_max + 1, seed=1)]))


# -- the sampler -----------------------------------------------------------------------------------


def test_uniforms_are_counter_based():
    keys = seed_keys([1, 2, 1, 2**40 + 1], "cpu")
    u = uniforms(keys, 5, 1)
    assert u[0] == u[2] and u[0] != u[1] and u[0] != u[3]
    assert not torch.equal(uniforms(keys, 6, 1), u) and not torch.equal(uniforms(keys, 5, 2), u)
    many = uniforms(seed_keys([7] * 1, "cpu").expand(20000), torch.arange(20000), 1)
    assert 0.0 <= many.min() and many.max() < 1.0 and abs(many.mean().item() - 0.5) < 0.01


def test_ras_sample_matches_its_closed_form():
    """Monte-Carlo the two-step procedure on a 6-token distribution, with and without a repeat."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logp = probs.log()[None].expand(40000, 6)
    u = uniforms(seed_keys([3], "cpu").expand(40000), torch.arange(40000), 1)
    u2 = uniforms(seed_keys([3], "cpu").expand(40000), torch.arange(40000), 2)
    # nucleus with top_p 0.7: keeps 0.4, 0.25, 0.15 (mass before each < 0.7); top_k 25
    nucleus = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0]) / 0.8
    recent = torch.full((40000, 10), -1)
    got = torch.bincount(ras_sample(logp, recent, u, u2, top_p=0.7), minlength=6) / 40000
    assert (got - nucleus).abs().max() < 0.01
    recent[:, -1] = 0  # token 0 repeated once in the window: 1 >= 10 * 0.1, so it is redrawn from the full softmax
    want = nucleus.clone()
    want[0] = 0
    want += nucleus[0] * probs
    got = torch.bincount(ras_sample(logp, recent, u, u2, top_p=0.7), minlength=6) / 40000
    assert (got - want).abs().max() < 0.01


# -- tokenizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab+merges"])
def test_tokenizer_encode_tests(tiny_model_dir, meta, tmp_path, layout):
    folder = tiny_model_dir / "CosyVoice-BlankEN"
    if layout == "vocab+merges":
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy(folder / name, tmp_path / name)
        folder = tmp_path
    tok = CosyVoice2Tokenizer(folder)
    assert len(tok) == meta["tokenizer"]["len_with_specials"]
    assert {t: tok.token_id(t) for t in meta["tokenizer"]["special_ids"]} == meta["tokenizer"]["special_ids"]
    for case in meta["tokenizer"]["encode_tests"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    assert tok.token_length(meta["tokenizer"]["encode_tests"][0]["text"]) == len(meta["tokenizer"]["encode_tests"][0]["ids"])


def test_tokenizer_reproduces_e2e_text_tokens(tiny_model_dir, ref, meta):
    tok = CosyVoice2Tokenizer.from_model_dir(tiny_model_dir)
    assert tok.encode(meta["e2e"]["normalized_text_segments"][0]) == ref["e2e_text_token"][0].tolist()
    assert tok.encode(meta["e2e"]["prompt_text_normalized"]) == ref["e2e_prompt_text_token"][0].tolist()


# -- packed prefill --------------------------------------------------------------------------------


def _causal_in_sdpa(q, k, v, cu_seq, longest):
    """What the packed causal flash call computes, as SDPA per sequence: q (N, H, hd), k/v (N, KVH, hd)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seq.tolist()
    assert longest == max(b - a for a, b in zip(bounds, bounds[1:]))
    for a, b in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (heads, L, hd)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=ks.shape[0] != qs.shape[0])
        out[a:b] = o.transpose(0, 1)
    return out


@pytest.fixture
def emulated_flash(monkeypatch) -> list[int]:
    """The packed prefill's flash call replaced by its SDPA emulation on CPU fp32; returns a call log."""
    from voxbatch.worker.cosyvoice2 import flash_varlen

    calls: list[int] = []

    def emulated(*args):
        calls.append(1)
        return _causal_in_sdpa(*args)

    monkeypatch.setattr(flash_varlen, "_DEVICES", ("cpu",))
    monkeypatch.setattr(flash_varlen, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(flash_varlen, "_causal", emulated)
    return calls


def _prompts(ref) -> list[tuple[list[int], list[int]]]:
    return [(r.text_tokens, r.prompt_speech_tokens) for r in _mixed_requests(ref, greedy=True)]


def test_packed_layout_puts_every_prompt_entry_in_place(ref):
    """Each prompt at [cu_seq[b], cu_seq[b+1]) as [sos, text, task_id, speech], positions restarting at
    0, every entry tagged with its prompt's cache row: checked entry by entry against the prompt lists."""
    from voxbatch.worker.cosyvoice2.llm import SOS, TASK_ID, PackedPrompts

    prompts, rows = _prompts(ref), [3, 0, 2]
    p = PackedPrompts.of(prompts, rows, torch.device("cpu"))
    kind = {}  # entry -> (table, id)
    for at, ids, table in ((p.text_at, p.text_ids, "text"), (p.speech_at, p.speech_ids, "speech"), (p.special_at, p.special_ids, "special")):
        for i, t in zip(at.tolist(), ids.tolist()):
            assert i not in kind
            kind[i] = (table, t)
    want, cu = [], [0]
    for (text, speech), row in zip(prompts, rows):
        seq = [("special", SOS)] + [("text", t) for t in text] + [("special", TASK_ID)] + [("speech", s) for s in speech]
        want += [(e, pos, row) for pos, e in enumerate(seq)]
        cu.append(cu[-1] + len(seq))
    assert p.total == len(want) and sorted(kind) == list(range(p.total))
    assert [(kind[i], p.positions[i].item(), p.rows[i].item()) for i in range(p.total)] == want
    assert p.cu_seq.dtype == torch.int32 and p.cu_seq.tolist() == cu
    assert p.last.tolist() == [c - 1 for c in cu[1:]] and p.lengths.tolist() == [b - a for a, b in zip(cu, cu[1:])]
    assert p.longest == max(p.lengths.tolist())


@torch.inference_mode()
def test_packed_prefill_equals_padded(tiny_model_dir, ref, seq_max, emulated_flash):
    """With the flash call emulated on CPU fp32: same next-token log-probs as the padded prefill
    (within LOGP_ATOL), the same K/V in every valid cache entry (1e-5), and greedy decoding from either
    cache gives the same tokens."""
    prompts, rows = _prompts(ref), [2, 0, 3]
    caches = []
    for packed in (False, True):
        m = CosyVoice2LM.from_model_dir(tiny_model_dir)
        m.setup_cache(batch_max=4, seq_max=seq_max)
        if packed:
            logp, lengths = m.prefill_packed(prompts, rows)
        else:
            embeds, lengths = m.embed_batch(prompts)
            logp = m.prefill(embeds, lengths, rows=torch.tensor(rows))
        # Greedy decoding over all 4 cache rows (decode_step's row b is cache row b); the unused row 1
        # decodes garbage in its own row and is never compared.
        full = torch.zeros((4, logp.shape[-1]))
        full[rows] = logp
        pos = torch.zeros(4, dtype=torch.long)
        pos[rows] = lengths
        tokens = []
        for i in range(6):
            tok = full.argmax(-1)
            tokens.append(tok[rows].tolist())
            full = m.decode_step(tok, pos + i)
        caches.append((logp, lengths, m.cache_k.clone(), m.cache_v.clone(), tokens))
    assert emulated_flash, "the packed path did not call flash"
    (lp0, len0, k0, v0, t0), (lp1, len1, k1, v1, t1) = caches
    assert torch.equal(len0, len1)
    assert float((lp0 - lp1).abs().max()) <= LOGP_ATOL
    for row, n in zip(rows, len0.tolist()):
        assert float((k0[:, row, :, :n] - k1[:, row, :, :n]).abs().max()) <= 1e-5
        assert float((v0[:, row, :, :n] - v1[:, row, :, :n]).abs().max()) <= 1e-5
    assert t0 == t1


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "ras"])
def test_backend_tokens_same_packed_or_padded(tiny_model_dir, backend, ref, seq_max, emulated_flash, greedy):
    """The backend with packed prefill (flash emulated) gives every request the tokens of the padded
    backend, through refills (6 requests, 2 rows)."""
    two_rows = TorchLlmBackend(CosyVoice2LM.from_model_dir(tiny_model_dir), max_batch=2, max_seq=seq_max, sync_every=4)
    reqs = [LlmRequest(**{**q.__dict__, "seed": 90 + i}) for i, q in enumerate(_mixed_requests(ref, greedy) * 2)]
    got = {r.index: r.tokens for r in two_rows.generate(reqs)}
    assert emulated_flash, "the packed path did not run"
    assert [got[i] for i in range(6)] == [next(iter(backend.generate([q]))).tokens for q in reqs]


def test_failed_flash_falls_back_to_padded(tiny_model_dir, backend, ref, seq_max, monkeypatch, caplog):
    """A flash call that raises is logged once, turned off, and the backend prefills padded: same tokens."""
    from voxbatch.worker.cosyvoice2 import flash_varlen

    def broken(*args):
        raise RuntimeError("no flash in this build")

    monkeypatch.setattr(flash_varlen, "_DEVICES", ("cpu",))
    monkeypatch.setattr(flash_varlen, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(flash_varlen, "_causal", broken)
    reqs = _mixed_requests(ref, greedy=True)
    fresh = TorchLlmBackend(CosyVoice2LM.from_model_dir(tiny_model_dir), max_batch=4, max_seq=seq_max)
    with caplog.at_level("WARNING"):
        got = {r.index: r.tokens for r in fresh.generate(reqs)}
    assert flash_varlen._causal is False
    assert sum("packed flash attention unavailable" in r.message for r in caplog.records) == 1
    assert got == {r.index: r.tokens for r in backend.generate(reqs)}


@pytest.mark.gpu
def test_placing_rows_never_waits_for_the_gpu(tiny_model_dir, ref, seq_max):
    """CUDA: placing requests in cache rows (prefill, row state, sampler settings) only queues work. With
    CUDA's sync debug mode at "error" any call that waits for the device raises: a Python number
    assigned through a tensor index did (torch_backend._Rows.fill), holding every placement until the
    LLM's stream ran dry."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = CosyVoice2LM.from_model_dir(tiny_model_dir, device="cuda", dtype=torch.bfloat16)
    state = TorchLlmBackend(model, max_batch=4, max_seq=seq_max)._state(4)
    reqs = _mixed_requests(ref, greedy=False)
    state.fill([0, 1, 2], reqs)  # first use: lazy set-up may wait
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.fill([1, 2, 3], reqs)
        state.run(seq_max)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert state.n_out[1:].le(1).all() and state.lengths[1:].gt(0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_packed_prefill_on_gpu_as_close_as_padded(tiny_model_dir, ref, seq_max, dtype, monkeypatch):
    """CUDA, real flash: the packed prefill's log-probs are as close to the fp32 padded prefill as the
    padded prefill in the same dtype is: max abs error <= 2x padded's + 1e-2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from voxbatch.worker.cosyvoice2 import flash_varlen

    monkeypatch.setattr(flash_varlen, "_causal", None)  # resolve afresh: a failure shows here
    prompts, rows = _prompts(ref), [1, 3, 0]
    out = {}
    with torch.inference_mode():
        for name, dt in (("ref", torch.float32), ("padded", dtype), ("packed", dtype)):
            m = CosyVoice2LM.from_model_dir(tiny_model_dir, device="cuda", dtype=dt)
            m.setup_cache(batch_max=4, seq_max=seq_max)
            if name == "packed":
                out[name] = m.prefill_packed(prompts, rows)[0].cpu()
            else:
                embeds, lengths = m.embed_batch(prompts)
                out[name] = m.prefill(embeds, lengths, rows=torch.tensor(rows, device="cuda")).cpu()
    assert flash_varlen._causal not in (None, False), "flash did not run"
    err_padded = float((out["padded"] - out["ref"]).abs().max())
    err_packed = float((out["packed"] - out["ref"]).abs().max())
    assert torch.isfinite(out["packed"]).all()
    assert err_packed <= 2 * err_padded + 1e-2, (err_packed, err_padded)


# -- The decode step's attention on FlashAttention-3 (flash_varlen.DECODE_FA3) -----------------------


def _decode_logp(m: CosyVoice2LM, prompts, rows: list[int], steps: int) -> list[torch.Tensor]:
    """Padded prefill of `prompts` into cache `rows` of a 4-row cache, then `steps` greedy decode steps
    over all 4 rows (decode_step's row b is cache row b; the unused row decodes garbage in its own row):
    each step's log-probs of the prompts' rows, on the CPU in fp32."""
    dev = m.cache_k.device
    embeds, lengths = m.embed_batch(prompts)
    logp = m.prefill(embeds.to(dev), lengths.to(dev), rows=torch.tensor(rows, device=dev))
    full = torch.zeros((4, logp.shape[-1]), device=dev, dtype=logp.dtype)
    full[rows] = logp
    pos = torch.zeros(4, dtype=torch.long, device=dev)
    pos[rows] = lengths.to(dev)
    out = []
    for i in range(steps):
        full = m.decode_step(full.argmax(-1), pos + i)  # the widest kv_len: rows use ~half of it
        out.append(full[rows].float().cpu())
    return out


@torch.inference_mode()
def test_fa3_decode_equals_sdpa_on_cpu(tiny_model_dir, ref, seq_max, monkeypatch):
    """The decode step with DECODE_FA3, its call bound on an op of vLLM 0.26's FA3 schema that computes
    FA3's semantics on CPU (queries varlen, the cache (B, S, KVH, D) cut at seqused_k, grouped-query
    heads): every step's log-probs equal the masked-SDPA step's within LOGP_ATOL over rows of three
    prompt lengths, and every layer of every step took the FA3 call."""
    from tests.test_cosyvoice2_flow import FA3_SCHEMA, _fa3_on_cpu
    from voxbatch.worker.cosyvoice2 import flash_varlen

    lib, op = _fa3_on_cpu("voxbatch_test_fa3_decode", FA3_SCHEMA)
    calls = []
    bound = flash_varlen.bind_fa3_decode(op)

    def counted(*args):
        calls.append(1)
        return bound(*args)

    m = CosyVoice2LM.from_model_dir(tiny_model_dir)
    m.setup_cache(batch_max=4, seq_max=seq_max)
    prompts, rows = _prompts(ref), [2, 0, 3]
    sdpa = _decode_logp(m, prompts, rows, steps=5)
    monkeypatch.setattr(flash_varlen, "_DEVICES", ("cpu",))
    monkeypatch.setattr(flash_varlen, "_DTYPES", (torch.float32,))
    monkeypatch.setattr(flash_varlen, "DECODE_FA3", True)
    monkeypatch.setattr(flash_varlen, "_fa3_decode", counted)
    fa3 = _decode_logp(m, prompts, rows, steps=5)
    assert len(calls) == 5 * m.dims.n_layers
    for got, want in zip(fa3, sdpa):
        assert float((got - want).abs().max()) <= LOGP_ATOL


def test_fa3_decode_declines_where_it_cannot_run(monkeypatch):
    """Off, on CPU tensors, in fp32 or after a failed call: None (the caller's SDPA), nothing tried."""
    from voxbatch.worker.cosyvoice2 import flash_varlen

    q, k = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 5, 8)
    rows = flash_varlen.decode_rows(torch.tensor([3, 1]))
    assert rows[0].tolist() == [0, 1, 2] and rows[1].tolist() == [4, 2] and rows[1].dtype == torch.int32
    assert flash_varlen.decode_attention(q, k, k, rows) is None  # off
    monkeypatch.setattr(flash_varlen, "DECODE_FA3", True)
    monkeypatch.setattr(flash_varlen, "_fa3_decode", lambda *a: pytest.fail("called"))
    assert flash_varlen.decode_attention(q, k, k, rows) is None  # a CPU tensor
    monkeypatch.setattr(flash_varlen, "_DEVICES", ("cpu",))
    assert flash_varlen.decode_attention(q, k, k, rows) is None  # fp32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@torch.inference_mode()
def test_fa3_decode_on_gpu_as_close_as_sdpa(tiny_model_dir, ref, seq_max, dtype, monkeypatch):
    """CUDA, vLLM's FA3 where installed (skipped where not): the decode steps' log-probs in `dtype` are as
    close to the fp32 SDPA steps as SDPA's in that dtype: max abs error <= 2x SDPA's + 1e-2."""
    from voxbatch.worker.cosyvoice2 import flash_varlen

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if flash_varlen.fa3_library() is None or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs vLLM's FlashAttention-3 extension on an sm90 GPU")
    prompts, rows = _prompts(ref), [2, 0, 3]

    def run(dt: torch.dtype, fa3: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(flash_varlen, "DECODE_FA3", fa3)
        m = CosyVoice2LM.from_model_dir(tiny_model_dir).to("cuda", dt)
        m.setup_cache(batch_max=4, seq_max=seq_max)
        return _decode_logp(m, prompts, rows, steps=5)

    want, sdpa, fa3 = run(torch.float32, False), run(dtype, False), run(dtype, True)
    assert callable(flash_varlen._fa3_decode), "the FA3 decode call did not run"
    for w, s_, f in zip(want, sdpa, fa3):
        finite = torch.isfinite(w)
        err_sdpa, err_fa3 = float((s_ - w)[finite].abs().max()), float((f - w)[finite].abs().max())
        assert err_fa3 <= 2 * err_sdpa + 1e-2, (err_fa3, err_sdpa)
