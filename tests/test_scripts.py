"""Podcasts, catalogs and corrections on the embedded default (`voxbatch render`, tone engine):
multi-voice scripts (--cast), line-item batches (.jsonl/.csv), pronunciation lexicons (--lexicon) and
re-rendering only what changed (the content-addressed segment cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import corpora
from voxbatch import keys
from voxbatch.audio import decode
from voxbatch.models import Manifest, SynthesisParams, content_seed
from voxbatch.producer.lexicon import load_lexicon
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage
from voxbatch.worker.engine import SynthesisRequest
from voxbatch.embedded import render_local
from voxbatch.worker.tone import SAMPLE_RATE, ToneEngine

REPO = Path(__file__).resolve().parents[1]
LEXICON_TSV = "# names and acronyms\nherring\tHERRING fish\npier\tjetty\n"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "voxbatch.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VOXBATCH_ENGINE": "tone"})


def render(path: Path, out: Path, voice: str = "tone", **options) -> Manifest:
    settings = Settings(engine="tone", storage_url=out.resolve().as_uri(), batch_size=4)
    return render_local(path, out, voice, settings, **options)


def tone_audio(text: str, voice: str) -> np.ndarray:
    """What the tone engine makes for a segment in a voice, with the seed the producer derives."""
    seed = content_seed(text, voice, SynthesisParams())
    return next(iter(ToneEngine().synthesize([SynthesisRequest("x", text, voice, seed)]))).audio


def test_cast_speaks_each_paragraph_in_its_speakers_voice(tmp_path):
    out = tmp_path / "out"
    m = render(corpora.write_podcast(tmp_path / "ep.md"), out, cast=corpora.PODCAST_CAST)
    assert m.state == "completed"
    voices = [s.voice for s in m.segments]
    assert set(voices) == {"tone", "tone:alice", "tone:bob"}
    by_voice = {v: [s.text for s in m.segments if s.voice == v] for v in set(voices)}
    assert by_voice["tone:alice"][0].startswith("Hello everyone, I am Alice.")
    assert by_voice["tone:bob"] == ["And I am Bob. I counted twelve crates of herring on the pier."]
    assert not any(s.text.startswith(("Alice:", "Bob:")) for s in m.segments)  # prefixes not spoken
    assert any(s.text.startswith("Mallory:") and s.voice == "tone" for s in m.segments)  # not in the cast
    storage = LocalStorage(out)
    for s in m.segments:  # the voice reached the engine: each segment is that voice's tone
        audio, sr = decode(storage.get(s.key), s.key)
        assert sr == SAMPLE_RATE
        np.testing.assert_allclose(audio, tone_audio(s.text, s.voice), atol=1e-4)
    chapter, _ = decode(storage.get(m.chapters[0].key), "chapter")  # one chapter mixes all three voices
    assert len(chapter) / SAMPLE_RATE == pytest.approx(m.chapters[0].duration_s, abs=1e-3)


def test_unknown_cast_voice_is_refused_before_anything_is_stored(tmp_path):
    out = tmp_path / "out"
    proc = cli("render", str(corpora.write_podcast(tmp_path / "ep.md")), "--out", str(out),
               "--cast", "Alice=tone:alice,Bob=nosuchvoice")
    assert proc.returncode == 2
    assert "voice 'nosuchvoice' not found" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "jobs").exists()
    proc = cli("render", str(tmp_path / "ep.md"), "--out", str(out), "--cast", "Alice")
    assert proc.returncode == 2 and "expected Name=voice" in proc.stderr


def test_thousand_item_batch_makes_one_file_per_id(tmp_path):
    out = tmp_path / "out"
    m = render(corpora.write_items(tmp_path / "prompts.jsonl", 1000), out)
    assert m.state == "completed" and m.chapters == [] and m.book_key is None
    assert [i.id for i in m.items] == [f"item-{n:05d}" for n in range(1000)]
    files = sorted(p.name for p in (out / "jobs" / m.job_id / "items").iterdir())
    assert files == [f"item-{n:05d}.wav" for n in range(1000)]
    storage = LocalStorage(out)
    for item in m.items[:25]:
        assert item.status == "done" and item.key == keys.item(m.job_id, item.id, "wav")
        audio, sr = decode(storage.get(item.key), item.key)
        assert len(audio) / sr == pytest.approx(item.duration_s, abs=1e-3)
    assert {s.voice for s in m.segments if s.chapter % 10 == 0} == {"tone:ivr"}
    assert {s.voice for s in m.segments if s.chapter % 10 != 0} == {"tone"}
    assert not (out / "jobs" / m.job_id / "chapters").exists()


def test_csv_items_with_speed_and_seed(tmp_path):
    corpus = tmp_path / "lines.csv"
    corpus.write_text('id,text,speed,seed\nwelcome,"Welcome, caller.",,\nbye,Goodbye.,1.5,42\n', encoding="utf-8")
    m = render(corpus, tmp_path / "out")
    assert [(i.id, i.status) for i in m.items] == [("welcome", "done"), ("bye", "done")]
    spec = json.loads((tmp_path / "out" / "jobs" / m.job_id / "job.json").read_text())
    assert spec["kind"] == "items" and spec["segments"][1]["speed"] == 1.5 and spec["segments"][1]["seed"] == 42


@pytest.mark.parametrize("rows, line, problem", [
    (['{"id": "a", "text": "One."}', '{"id": "b", "text": "Two."}', '{"id": "a", "text": "Again."}'], 3,
     "duplicate id 'a' (first on line 1)"),
    (['{"id": "a", "text": "One."}', '{"id": "../x", "text": "Escape."}'], 2, "id:"),
    (['{"id": "a", "text": "One."}', '', '{"id": "b"}'], 3, "text: Field required"),
    (['{"id": "a", "text": "One.", "speed": 9}'], 1, "speed:"),
    (['{"id": "a", "text": "One."}', '{"id": "b", "text": "Two."'], 2, "not JSON"),
])
def test_bad_item_row_fails_with_its_line_and_stores_nothing(tmp_path, rows, line, problem):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    proc = cli("render", str(corpus), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    assert f"bad.jsonl:{line}: " in proc.stderr and problem in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "jobs").exists() and not (out / "cache").exists()


def test_lexicon_changes_exactly_the_segments_with_its_terms(tmp_path):
    book = corpora.write_txt(tmp_path / "book.txt")
    plain = render(book, tmp_path / "plain")
    (tmp_path / "lex.tsv").write_text(LEXICON_TSV, encoding="utf-8")
    lexed = render(book, tmp_path / "lexed", lexicon=tmp_path / "lex.tsv")
    lexicon = load_lexicon(tmp_path / "lex.tsv")
    assert len(plain.segments) == len(lexed.segments)
    changed = [a.id for a, b in zip(plain.segments, lexed.segments) if a.text != b.text]
    with_terms = [s.id for s in plain.segments if any(t in s.text.split(" ") or f"{t}." in s.text for t, _ in lexicon.entries)]
    assert changed == with_terms and changed
    for a, b in zip(plain.segments, lexed.segments):
        assert b.text == lexicon.apply(a.text)
    assert any("HERRING fish" in s.text for s in lexed.segments) and not any(" pier" in s.text for s in lexed.segments)
    spec = json.loads((tmp_path / "lexed" / "jobs" / lexed.job_id / "job.json").read_text())
    assert spec["lexicon_sha256"] == lexicon.sha256
    # The W3C PLS form of the same lexicon gives the same spoken text.
    (tmp_path / "lex.pls").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<lexicon version="1.0" '
        'xmlns="http://www.w3.org/2005/01/pronunciation-lexicon" alphabet="ipa" xml:lang="en">\n'
        '<lexeme><grapheme>herring</grapheme><alias>HERRING fish</alias></lexeme>\n'
        '<lexeme><grapheme>pier</grapheme><alias>jetty</alias></lexeme>\n</lexicon>\n', encoding="utf-8")
    pls = render(book, tmp_path / "pls", lexicon=tmp_path / "lex.pls")
    assert [s.text for s in pls.segments] == [s.text for s in lexed.segments]


def test_edited_book_renders_only_the_changed_segments(tmp_path):
    out = tmp_path / "out"
    book = corpora.write_txt(tmp_path / "book.txt")
    first = render(book, out)
    assert first.reused == 0 and not any(s.reused for s in first.segments)
    chapters, edited = corpora.edit_one_paragraph()
    corpora.write_txt(book, chapters)
    second = render(book, out)
    old = {(s.text, s.voice) for s in first.segments}
    changed = [s.id for s in second.segments if (s.text, s.voice) not in old]
    assert changed and all(s.chapter == 1 for s in second.segments if s.id in changed)
    assert [s.id for s in second.segments if not s.reused] == changed
    assert second.reused == len(second.segments) - len(changed)
    # Chapters and book from reused + new segments equal a full render of the edited book.
    full = render(book, tmp_path / "full", reuse=False)
    assert full.reused == 0
    a, b = LocalStorage(out), LocalStorage(tmp_path / "full")
    for x, y in zip(second.chapters, full.chapters, strict=True):
        assert a.get(x.key) == b.get(y.key) and x.duration_s == y.duration_s
    if second.book_key:  # ffmpeg present
        assert (out / second.book_key).stat().st_size > 0
        import subprocess as sp

        probe = sp.run(["ffprobe", "-v", "error", "-show_chapters", "-of", "json", str(out / second.book_key)],
                       capture_output=True, text=True)
        if probe.returncode == 0:
            assert len(json.loads(probe.stdout)["chapters"]) == 3
    # Rendered again (the CLI says how many were reused): everything reused; --no-reuse renders
    # everything; another voice reuses nothing.
    proc = cli("render", str(book), "--out", str(out))
    assert proc.returncode == 0 and f"({len(second.segments)} reused, 0 rendered)" in proc.stdout
    assert render(book, out, reuse=False).reused == 0
    other = render(book, out, voice="tone:other")
    assert other.reused == 0 and {s.voice for s in other.segments} == {"tone:other"}


def test_render_ends_in_one_line_and_exit_1_when_its_engine_is_lost():
    """What `voxbatch render` does when the pipeline reports a lost engine (a CUDA kernel fault mid-job):
    one line on stderr saying what failed and that the stored segments stay, exit 1, no traceback."""
    code = "from voxbatch.embedded import _engine_lost; _engine_lost('AcceleratorError: CUDA error: an illegal memory access')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "illegal memory access" in proc.stderr and "stored so far are kept" in proc.stderr
    assert "Traceback" not in proc.stderr
