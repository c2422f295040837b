"""Corpus readers: every input kind, encodings, and the refusals (which must name file and place)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from voxbatch.producer.readers import MAX_LINE_CHARS, CorpusError, chapter_heading, natural_key, read_corpus

BOOK_TXT = """\
The Lighthouse
by A. Writer

Chapter 1

It was a dark and stormy
night. The rain fell on
the harbour.

The keeper slept.

CHAPTER II. The Lamp

Chapter 5 was the best part of the book, he said.

Chapter III

Morning came.
"""


def write(tmp_path: Path, name: str, data: str | bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_txt_chapters_arabic_and_roman(tmp_path):
    chapters = read_corpus(write(tmp_path, "book.txt", BOOK_TXT))
    assert [c.title for c in chapters] == ["Front matter", "Chapter 1", "CHAPTER II. The Lamp", "Chapter III"]
    assert [c.index for c in chapters] == [0, 1, 2, 3]
    front, one, two, three = chapters
    assert front.text == "The Lighthouse by A. Writer"
    # The heading is spoken; hard-wrapped lines are joined; blank lines separate paragraphs.
    assert one.text == "Chapter 1\n\nIt was a dark and stormy night. The rain fell on the harbour.\n\nThe keeper slept."
    # A prose line starting with "Chapter 5" is not a heading.
    assert "Chapter 5 was the best part" in two.text
    assert three.text == "Chapter III\n\nMorning came."
    assert one.source.endswith("book.txt:4") and two.source.endswith("book.txt:12")


def test_txt_without_front_matter_or_headings(tmp_path):
    chapters = read_corpus(write(tmp_path, "a.txt", "Chapter One: Start\n\nHello.\n\nChapter Two\n\nBye.\n"))
    assert [c.title for c in chapters] == ["Chapter One: Start", "Chapter Two"]
    hashes = read_corpus(write(tmp_path, "h.txt", "# One\n\nA *b*.\n\n# Two\n\nC.\n"))
    assert [(c.title, c.text) for c in hashes] == [("One", "One\n\nA *b*."), ("Two", "Two\n\nC.")]
    plain = read_corpus(write(tmp_path, "notes.txt", "Just a note.\nOn two lines.\n"))
    assert len(plain) == 1 and plain[0].title == "notes" and plain[0].text == "Just a note. On two lines."


@pytest.mark.parametrize(
    "line, title",
    [
        ("Chapter 12", "Chapter 12"),
        ("CHAPTER XII", "CHAPTER XII"),
        ("Chapter Twelve: The Storm", "Chapter Twelve: The Storm"),
        ("Chapter twenty-one", "Chapter twenty-one"),
        ("Chapter 12.", "Chapter 12."),
        ("第十二章", "第十二章"),
        ("第12章 标题", "第12章 标题"),
        ("  第一百零三章：归来", "第一百零三章：归来"),
        ("Chapter 5 was the best.", None),
        ("Chapter did not matter", None),
        ("chapters of life", None),
        ("第三章说的是什么呢？", None),
    ],
)
def test_chapter_heading_patterns(line, title):
    got = chapter_heading(line)
    assert (got[0] if got else None) == title


def test_bom_and_crlf_and_cr(tmp_path):
    body = "Chapter 1\r\n\r\nLine one\r\ncontinues.\r\n\r\nChapter 2\r\n\r\nEnd.\r\n"
    chapters = read_corpus(write(tmp_path, "bom.txt", b"\xef\xbb\xbf" + body.encode()))
    assert [c.title for c in chapters] == ["Chapter 1", "Chapter 2"]
    assert chapters[0].text == "Chapter 1\n\nLine one continues."
    assert "\r" not in "".join(c.text for c in chapters) and "\ufeff" not in chapters[0].title
    old_mac = read_corpus(write(tmp_path, "cr.txt", body.replace("\r\n", "\r")))
    assert [c.text for c in old_mac] == [c.text for c in chapters]


def test_chinese_chapters(tmp_path):
    text = "序\n\n第一章 初见\n他来了。\n她走了。\n第二章\n又是一天，\n阳光明媚。\n"
    chapters = read_corpus(write(tmp_path, "zh.txt", text))
    assert [c.title for c in chapters] == ["Front matter", "第一章 初见", "第二章"]
    # One paragraph per line when lines end sentences; hard-wrapped lines are joined without a blank.
    assert chapters[1].text == "第一章 初见\n\n他来了。\n\n她走了。"
    assert chapters[2].text == "第二章\n\n又是一天，阳光明媚。"


def test_markdown_headings_pick_the_splitting_level(tmp_path):
    md = """\
---
title: front matter yaml is skipped
---
# The Book

An *introduction* with a [link](https://example.com) and ![img](x.png).

## First

Para **one**.

- item a
- item b

### A subsection

More `code` here.

## Second

```
# not a heading
```

| a | b |
|---|---|
| 1 | 2 |
"""
    chapters = read_corpus(write(tmp_path, "book.md", md))
    assert [c.title for c in chapters] == ["Front matter", "First", "Second"]
    front, first, second = chapters
    assert front.text == "The Book\n\nAn introduction with a link and ."
    assert first.text == "First\n\nPara one.\n\nitem a\n\nitem b\n\nA subsection\n\nMore code here."
    assert second.text == "Second\n\n# not a heading\n\na, b\n\n1, 2"
    assert first.source.endswith("book.md:8")


def test_markdown_title_only_front_matter_is_dropped(tmp_path):
    md = "# Book Title\n\n## One\n\nA.\n\n## Two\n\nB.\n"
    assert [c.title for c in read_corpus(write(tmp_path, "b.markdown", md))] == ["One", "Two"]
    h1 = "# One\n\nA.\n\n# Two\n\nB.\n\n## Two point five\n\nC.\n"
    chapters = read_corpus(write(tmp_path, "c.md", h1))
    assert [c.title for c in chapters] == ["One", "Two"] and chapters[1].text.endswith("Two point five\n\nC.")


def test_directory_natural_sort_and_titles(tmp_path):
    d = tmp_path / "book"
    d.mkdir()
    write(d, "10.txt", "Chapter 10\n\nTen.\n")
    write(d, "2.txt", "Chapter 2: Two\n\nTwo.\n")
    write(d, "1.md", "Some text before.\n\n# The Beginning\n\nOne.\n")
    write(d, "3-untitled.txt", "No heading here.\n")
    write(d, "4.txt", "# Hash Title\n\nFour.\n")
    write(d, "notes.json", "{}")  # ignored: not a text chapter
    write(d, ".hidden.txt", "ignored")
    chapters = read_corpus(d)
    assert [c.title for c in chapters] == ["The Beginning", "Chapter 2: Two", "3-untitled", "Hash Title", "Chapter 10"]
    assert [c.index for c in chapters] == [0, 1, 2, 3, 4]
    assert chapters[0].text == "Some text before.\n\nThe Beginning\n\nOne."
    assert chapters[4].source.endswith("10.txt")
    assert sorted(["10.txt", "2.txt", "1.txt", "b2.md", "b10.md"], key=natural_key) == ["1.txt", "2.txt", "10.txt", "b2.md", "b10.md"]


def _make_epub(path: Path, with_toc: bool = True) -> None:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("voxbatch-test")
    book.set_title("Test Book")
    book.set_language("en")
    cover = epub.EpubHtml(title="Cover", file_name="cover.xhtml")
    cover.content = '<html><body><img src="cover.jpg" alt=""/></body></html>'
    docs = []
    for i in (1, 2, 3):
        doc = epub.EpubHtml(title=f"Chapter {i}", file_name=f"text/ch{i}.xhtml", lang="en")
        doc.content = (
            f"<html><head><title>ignored</title><style>p {{}}</style></head><body>"
            f"<h1>Heading {i}</h1><p>First paragraph of {i}.</p>"
            f"<p>Second <b>bold</b> &amp; <i>more</i>.<br/>After a break.</p><script>var x = 1;</script>"
            f"</body></html>"
        )
        docs.append(doc)
    for item in [cover, *docs]:
        book.add_item(item)
    if with_toc:
        book.toc = [
            epub.Link("text/ch1.xhtml", "One: Arrival", "c1"),
            (epub.Section("Part Two"), [epub.Link("text/ch2.xhtml#start", "Two: Storm", "c2"), epub.Link("text/ch3.xhtml", "Three: Calm", "c3")]),
        ]
    else:
        book.toc = []
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", cover, *docs]
    epub.write_epub(str(path), book)


def test_epub_spine_order_toc_titles_and_paragraphs(tmp_path):
    path = tmp_path / "book.epub"
    _make_epub(path)
    chapters = read_corpus(path)
    assert [c.title for c in chapters] == ["One: Arrival", "Two: Storm", "Three: Calm"]
    assert [c.index for c in chapters] == [0, 1, 2]
    assert chapters[1].text == "Heading 2\n\nFirst paragraph of 2.\n\nSecond bold & more.\n\nAfter a break."
    assert chapters[2].source == f"{path}#text/ch3.xhtml"


def test_epub_without_toc_uses_headings(tmp_path):
    path = tmp_path / "notoc.epub"
    _make_epub(path, with_toc=False)
    assert [c.title for c in read_corpus(path)] == ["Heading 1", "Heading 2", "Heading 3"]


def test_binary_file_refused_with_offset(tmp_path):
    path = write(tmp_path, "book.txt", b"Chapter 1\n\nText\x00\x01\x02")
    with pytest.raises(CorpusError, match=r"book\.txt: binary file, not text \(NUL byte at offset 15\)"):
        read_corpus(path)


def test_invalid_utf8_refused_with_offset(tmp_path):
    data = "Chapter 1\n\nCafé ok. ".encode() + b"\xff bad"
    path = write(tmp_path, "book.txt", data)
    with pytest.raises(CorpusError, match=rf"book\.txt: not UTF-8 text \(invalid byte 0xff at offset {len(data) - 5}\)"):
        read_corpus(path)
    latin1 = write(tmp_path, "latin.md", "# Caf\xe9\n".encode("latin-1"))
    with pytest.raises(CorpusError, match=r"latin\.md: not UTF-8 text \(invalid byte 0xe9 at offset 5\)"):
        read_corpus(latin1)


def test_invalid_utf8_after_bom_reports_file_offset(tmp_path):
    path = write(tmp_path, "bom.txt", b"\xef\xbb\xbfab\xc3(")
    with pytest.raises(CorpusError, match=r"invalid byte 0xc3 at offset 5"):
        read_corpus(path)


@pytest.mark.parametrize("content", ["", "   \n\n\t\n", "\ufeff"])
def test_empty_corpus_refused(tmp_path, content):
    path = write(tmp_path, "empty.txt", content)
    with pytest.raises(CorpusError, match=r"empty\.txt: no text"):
        read_corpus(path)


def test_empty_file_in_directory_refused(tmp_path):
    write(tmp_path, "1.txt", "One.")
    write(tmp_path, "2.txt", "")
    with pytest.raises(CorpusError, match=r"2\.txt: no text"):
        read_corpus(tmp_path)


def test_huge_line_refused_with_line_number(tmp_path):
    text = "Chapter 1\n\nShort line.\n" + "x" * (MAX_LINE_CHARS + 1) + "\nAfter.\n"
    with pytest.raises(CorpusError, match=rf"huge\.txt:4: huge line \({MAX_LINE_CHARS + 1} characters"):
        read_corpus(write(tmp_path, "huge.txt", text))
    ok = "y" * MAX_LINE_CHARS + "\n"
    assert len(read_corpus(write(tmp_path, "ok.txt", ok))[0].text) == MAX_LINE_CHARS


def test_unsupported_and_missing_paths(tmp_path):
    with pytest.raises(CorpusError, match=r"book\.pdf: unsupported"):
        read_corpus(write(tmp_path, "book.pdf", "%PDF"))
    with pytest.raises(CorpusError, match=r"nope\.txt: no such file"):
        read_corpus(tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match=r"bad\.epub: not a readable EPUB"):
        read_corpus(write(tmp_path, "bad.epub", b"PK\x03\x04 not really a zip"))


def test_producer_modules_import_without_torch():
    code = (
        "import sys\n"
        "import voxbatch.producer.readers, voxbatch.producer.normalize, voxbatch.producer.segment\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
