"""Where the parity tests look for the official-format fixture, and what they read from it."""

from __future__ import annotations

import pytest

from tests.fixture_facts import FixtureFacts, FixtureNotFound, fixture_path


def _fixture(folder):
    folder.mkdir(parents=True)
    (folder / "reference.npz").write_bytes(b"")
    return folder


def test_voxbatch_fixtures_may_name_the_fixture_or_a_folder_holding_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VOXBATCH_FIXTURES", str(_fixture(tmp_path / "a" / "other-sizes")))
    assert fixture_path() == tmp_path / "a" / "other-sizes"
    monkeypatch.setenv("VOXBATCH_FIXTURES", str(tmp_path / "a"))
    assert fixture_path() == tmp_path / "a" / "other-sizes"  # the one fixture under it
    _fixture(tmp_path / "a" / "cosyvoice2-tiny")
    assert fixture_path() == tmp_path / "a" / "cosyvoice2-tiny"  # the default name wins
    _fixture(tmp_path / "b" / "one")
    _fixture(tmp_path / "b" / "two")
    monkeypatch.setenv("VOXBATCH_FIXTURES", str(tmp_path / "b"))
    with pytest.raises(FixtureNotFound, match="several fixtures"):
        fixture_path()
    monkeypatch.setenv("VOXBATCH_FIXTURES", str(tmp_path / "absent"))
    with pytest.raises(FixtureNotFound, match="no reference.npz"):
        fixture_path()


def test_facts_come_from_the_fixture_files(tiny_facts, ref):
    """Cross-checks between independent files of the fixture (yaml, meta, arrays)."""
    assert tiny_facts.eos_id == tiny_facts.speech_token_size == tiny_facts.stop_ids[0]
    assert ref["llm_greedy_logp"].shape[1] == tiny_facts.llm_vocab
    e2e = tiny_facts.meta["e2e"]
    assert e2e["audio_samples"] == tiny_facts.samples_per_token * e2e["n_speech_tokens"]
    assert ref["hift_wav"].shape[1] == tiny_facts.samples_per_frame * ref["hift_mel"].shape[2]
    assert ref["e2e_prompt_feat"].shape[2] == tiny_facts.n_mels
    assert ref["e2e_embedding"].shape[1] == tiny_facts.spk_embed_dim
    assert tiny_facts.seed_before("hift_wav") != tiny_facts.seed_before("hift_wav_cached")


def test_seed_before_names_the_array_it_cannot_find(tiny_facts):
    facts = FixtureFacts(tiny_facts.path, tiny_facts.meta, tiny_facts.config, tiny_facts.qwen, "| `x` | (1,) | made |")
    with pytest.raises(AssertionError, match="no manual_seed stated for x"):
        facts.seed_before("x")
