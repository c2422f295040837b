"""Book metadata for delivery: title, author and cover, read from the corpus itself.

  EPUB      dc:title and dc:creator from the package document; the cover image from the manifest item
            marked `properties="cover-image"` (EPUB 3) or named by `<meta name="cover">` (EPUB 2)
  Markdown  the title is the document's only H1 (a book whose chapters are H2s), else its first
            heading when that heading is not one of the chapter headings; no author
  text      nothing (the job name is the title)

`--title` / `--author` override what is read. Titles and authors are single lines of bounded length;
a cover over MAX_COVER_BYTES or not JPEG/PNG is ignored (the files ship without one).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

MAX_FIELD_CHARS = 300
MAX_COVER_BYTES = 10 * 1024 * 1024
MARKDOWN_SUFFIXES = (".md", ".markdown")


@dataclass(frozen=True)
class BookMeta:
    title: str | None = None
    author: str | None = None
    cover: bytes | None = None
    cover_ext: str | None = None  # "jpg" | "png"


def _clean(value: str | None) -> str | None:
    if not value:
        return None
    text = " ".join(value.split())[:MAX_FIELD_CHARS]
    return text or None


def image_ext(data: bytes) -> str | None:
    """"jpg" or "png" from the bytes themselves (never from a name the file claims)."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def read_metadata(path: str | Path) -> BookMeta:
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".epub":
        return epub_metadata(p)
    if p.is_file() and p.suffix.lower() in MARKDOWN_SUFFIXES:
        return BookMeta(title=markdown_title(p.read_text(encoding="utf-8-sig", errors="replace")))
    return BookMeta()


def markdown_title(text: str) -> str | None:
    """The only H1, else the first heading if a shallower level than the chapters' (markdown-it-py)."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(text)
    headings: list[tuple[int, str]] = []
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open" and i + 1 < len(tokens):
            inline = tokens[i + 1]
            words = "".join(c.content for c in (inline.children or []) if c.type in ("text", "code_inline"))
            headings.append((int(tok.tag[1]), words))
    h1 = [t for level, t in headings if level == 1]
    if len(h1) == 1:
        return _clean(h1[0])
    if headings:
        level, first = headings[0]
        if sum(1 for lv, _ in headings if lv == level) == 1 and len(headings) > 1:
            return _clean(first)
    return None


def epub_metadata(path: Path) -> BookMeta:
    from ebooklib import epub

    try:
        book = epub.read_epub(str(path), options={"ignore_ncx": False})
    except (zipfile.BadZipFile, epub.EpubException, KeyError, OSError, ValueError):
        return BookMeta()  # the reader reports what is wrong with the file

    def first(name: str) -> str | None:
        values = book.get_metadata("DC", name)
        return _clean(values[0][0]) if values else None

    cover = _epub_cover(book)
    return BookMeta(title=first("title"), author=first("creator"), cover=cover,
                    cover_ext=image_ext(cover) if cover else None)


def _epub_cover(book) -> bytes | None:
    import ebooklib

    candidates = []
    for item in book.get_items():
        if item.get_type() == ebooklib.ITEM_COVER or "cover-image" in (getattr(item, "properties", None) or []):
            candidates.append(item)
    for value, attrs in book.get_metadata("OPF", "cover"):
        item = book.get_item_with_id((attrs or {}).get("content", ""))
        if item is not None:
            candidates.append(item)
    for item in candidates:
        data = item.get_content()
        if data and len(data) <= MAX_COVER_BYTES and image_ext(data):
            return data
    return None
