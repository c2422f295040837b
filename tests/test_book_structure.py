"""Books as readers see them (issue 14): EPUB reading order, emphasis as plain text, book metadata,
and the mastering limiter's ceiling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from voxbatch.producer.epub import plain_emphasis
from voxbatch.producer.metadata import markdown_title, read_metadata
from voxbatch.producer.readers import read_corpus


def write_epub(path: Path, *, spine: list, toc: list[str]) -> Path:
    """An EPUB whose documents are named by `spine` entries: "name" or ("name", "no") for linear="no"."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("voxbatch-structure")
    book.set_title("Structure")
    book.set_language("en")
    items = {}
    for entry in spine:
        name = entry if isinstance(entry, str) else entry[0]
        item = epub.EpubHtml(title=name, file_name=f"{name}.xhtml", lang="en")
        item.content = f"<html><body><p>Text of {name}, with *stars* and **more**.</p><p>* * *</p></body></html>"
        items[name] = item
        book.add_item(item)
    book.toc = [epub.Link(f"{name}.xhtml", name.title(), name) for name in toc]
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", *[(items[e[0]].id, "no") if isinstance(e, tuple) else items[e] for e in spine]]
    epub.write_epub(str(path), book)
    return path


def test_epub_pages_readers_skip_are_not_chapters(tmp_path):
    path = write_epub(tmp_path / "b.epub", spine=[("cover", "no"), "copyright", "one", "one_split", "two", "ads"],
                      toc=["one", "two"])
    chapters = read_corpus(path)
    assert [c.title for c in chapters] == ["One", "Two"]
    # The split file continues chapter one; the untitled trailing page continues the last chapter.
    assert "Text of one_split" in chapters[0].text and "Text of ads" in chapters[1].text
    text = " ".join(c.text for c in chapters)
    assert "cover" not in text and "copyright" not in text
    # Emphasis markers are gone, the words stay; a "* * *" scene break is not a paragraph.
    assert "*" not in text and "with stars and more." in text

    everything = read_corpus(path, all_spine=True)
    assert [c.source.rsplit("#", 1)[1] for c in everything] == [
        "cover.xhtml", "copyright.xhtml", "one.xhtml", "one_split.xhtml", "two.xhtml", "ads.xhtml"]


def test_epub_without_toc_entries_keeps_every_linear_page(tmp_path):
    path = write_epub(tmp_path / "b.epub", spine=[("cover", "no"), "one", "two"], toc=[])
    assert [c.source.rsplit("#", 1)[1] for c in read_corpus(path)] == ["one.xhtml", "two.xhtml"]


@pytest.mark.parametrize("raw, plain", [
    ("He was *very* tired.", "He was very tired."),
    ("A **bold** move and __another__ one.", "A bold move and another one."),
    ("snake_case_name and 2*3*4 stay", "snake_case_name and 2*3*4 stay"),
    ("~~struck~~ words", "struck words"),
    ("* * *", None),
    ("⁂", None),
])
def test_emphasis_becomes_plain_text(raw, plain):
    assert plain_emphasis(raw) == plain


@pytest.mark.parametrize("text, title", [
    ("# Harbour Tales\n\n## One\n\nText.\n\n## Two\n\nText.\n", "Harbour Tales"),  # the only H1
    ("# One\n\nText.\n\n# Two\n\nText.\n", None),  # H1s are the chapters: no book title
    ("## Book *Title*\n\n### One\n\nA.\n\n### Two\n\nB.\n", "Book Title"),  # first heading above chapters
    ("No headings at all.\n", None),
])
def test_markdown_title(text, title):
    assert markdown_title(text) == title


def test_epub_metadata_and_cover(tmp_path):
    from tests.test_delivery import write_epub_with_cover

    png = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # the type comes from the bytes, not the file name
    meta = read_metadata(write_epub_with_cover(tmp_path / "m.epub", png))
    assert (meta.title, meta.author, meta.cover, meta.cover_ext) == ("The Lighthouse Keeper", "Mara Quill", png, "png")


def test_limiter_holds_its_ceiling_without_clipping():
    from voxbatch.producer.mastering import limit

    sr = 44100
    t = np.arange(sr) / sr
    x = (np.sin(2 * np.pi * 220 * t) * np.where(t < 0.5, 0.2, 1.5)).astype(np.float32)  # quiet, then 3.5 dB over
    y = limit(x, sr, -3.0)
    assert np.abs(y).max() <= 10 ** (-3 / 20) + 1e-6
    np.testing.assert_allclose(y[: sr // 2 - 2000], x[: sr // 2 - 2000], atol=1e-6)  # under the ceiling: untouched
    # Gain, not clipping: on a steady loud tone every sample is scaled by the same gain (no flat tops).
    k = slice(int(0.6 * sr), int(0.9 * sr))
    big = np.abs(x[k]) > 0.1
    gain = y[k][big] / x[k][big]
    assert gain.std() < 1e-3 and gain.mean() == pytest.approx(10 ** (-3 / 20) / 1.5, rel=1e-3)
