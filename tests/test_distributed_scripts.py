"""Podcasts, catalogs and corrections on the distributed path: CLI -> Redis -> real `voxbatch worker`
and `voxbatch assembler` processes (tone engine) -> SeaweedFS S3. The embedded twins are in
test_scripts.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests import corpora
from tests.test_distributed import Cluster, cluster  # noqa: F401 - the fixture
from tests.test_scripts import LEXICON_TSV, tone_audio
from voxbatch import keys
from voxbatch.audio import decode
from voxbatch.producer.lexicon import load_lexicon

pytestmark = pytest.mark.integration


def finished_manifest(c: Cluster, job_id: str):
    status = c.wait_finished(job_id, timeout_s=300)
    assert status.state == "completed", status
    return c.manifest(job_id), status


def test_cast_and_line_items(cluster, tmp_path):
    c = cluster
    c.start("worker")
    c.start("assembler")
    cast = ",".join(f"{k}={v}" for k, v in corpora.PODCAST_CAST.items())
    podcast = corpora.write_podcast(tmp_path / "ep.md")

    # A cast voice that does not exist: refused before anything is stored or queued.
    proc = c.cli("submit", str(podcast), "--voice", "tone", "--cast", "Alice=tone:alice,Bob=nobody", check=False)
    assert proc.returncode == 2 and "voice 'nobody' not found" in proc.stderr
    assert c.storage.list("") == [] and all(c.jobs.status(j).name != "ep" for j in c.jobs.job_ids())

    job = c.submit(podcast, "--cast", cast)
    m, _ = finished_manifest(c, job)
    assert {s.voice for s in m.segments} == {"tone", "tone:alice", "tone:bob"}
    assert not any(s.text.startswith(("Alice:", "Bob:")) for s in m.segments)
    for s in m.segments:  # each segment was rendered in its speaker's voice
        audio, _ = decode(c.storage.get(s.key), s.key)
        np.testing.assert_allclose(audio, tone_audio(s.text, s.voice), atol=1e-4)

    # 1,000 line items -> 1,000 files named by id.
    c.env["VOXBATCH_BATCH_SIZE"] = "32"  # the producer's; the worker runs 4 tasks at once
    items = c.submit(corpora.write_items(tmp_path / "prompts.jsonl", 1000))
    m, _ = finished_manifest(c, items)
    ids = [f"item-{n:05d}" for n in range(1000)]
    assert [i.id for i in m.items] == ids and all(i.status == "done" for i in m.items)
    assert c.storage.list(f"jobs/{items}/items/") == [keys.item(items, i, "wav") for i in ids]
    assert m.chapters == [] and not c.storage.exists(keys.book(items))
    audio, sr = decode(c.storage.get(m.items[7].key), "item")
    assert len(audio) / sr == pytest.approx(m.items[7].duration_s, abs=1e-3)

    # A bad row: the submit fails naming its line; nothing is stored or queued.
    objects, jobs = c.storage.list(""), set(c.jobs.job_ids())
    bad = tmp_path / "bad.jsonl"
    rows = (tmp_path / "prompts.jsonl").read_text().splitlines()[:5]
    rows.insert(3, json.dumps({"id": "item-00001", "text": "a duplicate id"}))
    bad.write_text("\n".join(rows) + "\n")
    proc = c.cli("submit", str(bad), "--voice", "tone", check=False)
    assert proc.returncode == 2
    assert "bad.jsonl:4: duplicate id 'item-00001' (first on line 2)" in proc.stderr
    assert c.storage.list("") == objects and set(c.jobs.job_ids()) == jobs


def test_lexicon_and_rerender_only_what_changed(cluster, tmp_path):
    c = cluster
    c.start("worker")
    c.start("assembler")
    book = corpora.write_txt(tmp_path / "book.txt")
    first = c.submit(book)
    m1, _ = finished_manifest(c, first)
    assert m1.reused == 0

    # A lexicon changes the spoken text of exactly the segments holding its terms.
    (tmp_path / "lex.tsv").write_text(LEXICON_TSV)
    lexicon = load_lexicon(tmp_path / "lex.tsv")
    lexed = c.submit(book, "--lexicon", str(tmp_path / "lex.tsv"))
    ml, _ = finished_manifest(c, lexed)
    assert [s.text for s in ml.segments] == [lexicon.apply(s.text) for s in m1.segments]
    changed = {a.id for a, b in zip(m1.segments, ml.segments) if a.text != b.text}
    assert changed and all(s.reused == (s.id not in changed) for s in ml.segments)  # the rest came from the cache
    assert c.spec(lexed).lexicon_sha256 == lexicon.sha256

    # One paragraph edited, submitted again: only its segments render; chapters and book are right.
    chapters, _ = corpora.edit_one_paragraph()
    corpora.write_txt(book, chapters)
    second = c.submit(book)
    m2, status = finished_manifest(c, second)
    old = {s.text for s in m1.segments}
    new = [s.id for s in m2.segments if s.text not in old]
    assert new and [s.id for s in m2.segments if not s.reused] == new
    assert status.reused == m2.reused == len(m2.segments) - len(new)
    assert f"{m2.reused}" in c.cli("status", second).stdout.split("reused")[1].split("\n")[0]
    full = c.submit(book, "--no-reuse")
    mf, _ = finished_manifest(c, full)
    assert mf.reused == 0
    for x, y in zip(m2.chapters, mf.chapters, strict=True):
        assert c.storage.get(x.key) == c.storage.get(y.key)
    if m2.book_key:
        assert len(c.storage.get(m2.book_key)) > 0

    # Another voice reuses nothing.
    other = c.cli("submit", str(book), "--voice", "tone:other").stdout.strip().splitlines()[-1]
    mo, _ = finished_manifest(c, other)
    assert mo.reused == 0 and {s.voice for s in mo.segments} == {"tone:other"}
