"""EPUB corpora: spine documents to chapters, titles from the table of contents (NCX or nav).

HTML becomes text with one paragraph per block element (and per <br>); scripts, styles and the head
are skipped; the navigation document and spine items with no text (cover images) are left out.
A document that several TOC entries point into (anchors) is one chapter, titled by its first entry.

An EPUB is an untrusted zip: its sizes are checked from the central directory before anything is
inflated (`check_zip`), documents are decoded by the encoding they declare (BOM, XML declaration,
<meta charset>), and any malformed container, OPF or NCX becomes one `CorpusError` naming the file.
"""

from __future__ import annotations

import codecs
import re
import zipfile
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath

import ebooklib
from ebooklib import epub

from voxbatch.producer.readers import CorpusError, CorpusLimits, check_line_lengths, remove_control_characters
from voxbatch.models import Chapter

_RATIO_FLOOR_BYTES = 2**20  # small members (CSS, a blank page) may compress very well; only big ones count


class _HtmlText(HTMLParser):
    """HTML body to paragraphs: block elements and <br> end a paragraph; script/style/head are skipped."""

    BLOCKS = frozenset(
        "p div h1 h2 h3 h4 h5 h6 li ul ol dl dt dd blockquote pre section article aside header footer "
        "table tr td th caption figure figcaption hr br title body html".split()
    )
    SKIP = frozenset("script style head svg math nav".split())  # <nav>: landmarks/page lists, not prose
    HEADINGS = frozenset("h1 h2 h3".split())

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.first_heading: str | None = None
        self._buf: list[str] = []
        self._skip = 0
        self._heading: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.SKIP:
            self._skip += 1
        elif tag in self.BLOCKS:
            self._end_paragraph()
            if tag in self.HEADINGS and self.first_heading is None:
                self._heading = []

    def handle_startendtag(self, tag: str, attrs: list) -> None:
        if tag in self.BLOCKS:
            self._end_paragraph()

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            if tag in self.HEADINGS and self._heading is not None:
                self.first_heading = " ".join("".join(self._heading).split()) or None
                self._heading = None
            self._end_paragraph()

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        self._buf.append(data)
        if self._heading is not None:
            self._heading.append(data)

    def _end_paragraph(self) -> None:
        text = " ".join("".join(self._buf).split())
        self._buf.clear()
        if text:
            self.paragraphs.append(text)

    def close(self) -> None:
        super().close()
        self._end_paragraph()


def html_to_paragraphs(html: str) -> tuple[list[str], str | None]:
    """(paragraphs, first h1-h3 text) of an XHTML document."""
    parser = _HtmlText()
    parser.feed(html)
    parser.close()
    return parser.paragraphs, parser.first_heading


def _toc_titles(toc: list) -> dict[str, str]:
    """Document href (no fragment) -> TOC title pointing into it.

    Leaf entries win over sections: a "Part One" section whose href is also its first chapter's file
    should not rename that chapter. Within each kind, the first entry for a file wins.
    """
    leaves: dict[str, str] = {}
    sections: dict[str, str] = {}

    def add(into: dict[str, str], entry: object) -> None:
        href, title = getattr(entry, "href", None), getattr(entry, "title", None)
        if href and title and title.strip():
            into.setdefault(_norm_href(href), title.strip())

    def walk(entries: object) -> None:
        # ebooklib gives a lone empty Link instead of a list for an empty NCX navMap.
        for entry in entries if isinstance(entries, (list, tuple)) else [entries]:
            if isinstance(entry, (tuple, list)):
                add(sections, entry[0])
                walk(entry[1])
            else:
                add(leaves, entry)

    walk(toc)
    return {**sections, **leaves}


def _norm_href(href: str) -> str:
    return str(PurePosixPath(href.split("#", 1)[0]))


def check_zip(path: Path, limits: CorpusLimits) -> None:
    """Refuse a zip bomb from its central directory, before inflating anything.

    zipfile stops inflating a member at the size its directory entry declares (and then fails its
    CRC), so the declared sizes bound what reading can cost."""
    try:
        with zipfile.ZipFile(path) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise CorpusError(f"{path}: not a readable EPUB ({type(e).__name__}: {e})") from None
    total = sum(m.file_size for m in members)
    if total > limits.max_epub_uncompressed_bytes:
        raise CorpusError(f"{path}: EPUB inflates to {total:,} bytes, over the limit of "
                          f"{limits.max_epub_uncompressed_bytes:,} (VOXBATCH_MAX_EPUB_UNCOMPRESSED_BYTES)")
    for m in members:
        ratio = m.file_size / max(m.compress_size, 1)
        if m.file_size > _RATIO_FLOOR_BYTES and ratio > limits.max_epub_ratio:
            raise CorpusError(f"{path}#{m.filename}: inflates {ratio:.0f}x ({m.compress_size:,} -> "
                              f"{m.file_size:,} bytes), over the limit of {limits.max_epub_ratio:.0f}x "
                              "(VOXBATCH_MAX_EPUB_RATIO): a zip bomb, not a book")


_XML_DECL = re.compile(rb"""^\s*<\?xml[^>]*?encoding\s*=\s*["']([A-Za-z0-9._:-]+)["']""")
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9._:-]+)""", re.IGNORECASE)


def declared_encoding(raw: bytes) -> str:
    """The encoding an XHTML document declares: BOM, then XML declaration, then <meta charset>; UTF-8."""
    for bom, enc in ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if raw.startswith(bom):
            return enc
    head = raw[:1024]
    m = _XML_DECL.match(head) or _META_CHARSET.search(head)
    return m.group(1).decode("ascii").lower() if m else "utf-8"


def decode_document(raw: bytes, where: str) -> str:
    encoding = declared_encoding(raw)
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise CorpusError(f"{where}: declares unknown encoding {encoding!r}") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        bad = f"invalid byte 0x{raw[e.start]:02x} at offset {e.start}"
        raise CorpusError(f"{where}: not {encoding} text as it declares ({bad})") from None


# Emphasis written as markup characters inside the text (EPUBs converted from markdown): the words stay,
# the markers go, so nothing reads "asterisk"; a paragraph of only such characters is a scene break.
_EMPHASIS = [
    (re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1"), r"\2"),
    (re.compile(r"(?<![\w*])([*_])(?=\S)(.+?)(?<=\S)\1(?![\w*])"), r"\2"),
    (re.compile(r"~~(?=\S)(.+?)(?<=\S)~~"), r"\1"),
]
_SCENE_BREAK = re.compile(r"[\s*#~_=\-•·⁂]+")


def plain_emphasis(paragraph: str) -> str | None:
    """The paragraph without emphasis markers; None when nothing but break symbols is left."""
    for pattern, repl in _EMPHASIS:
        paragraph = pattern.sub(repl, paragraph)
    return None if _SCENE_BREAK.fullmatch(paragraph) else paragraph


def _reading_order(book, titles: dict[str, str], all_spine: bool) -> list[tuple[object, bool]]:
    """(document, starts a chapter) in the order a reading system shows them.

    Readers skip spine items marked linear="no" (covers, pop-ups) and show no entry for documents the
    table of contents leaves out. So, unless `all_spine`: linear="no" items are dropped; documents
    before the first TOC entry (cover, title and copyright pages) are dropped; a document after a TOC
    entry that the TOC does not name continues the chapter before it (a chapter split over several
    files, as converters write them): never a chapter of its own, and no text of a chapter is lost
    (trailing pages such as ads are read at the end of the last chapter, rather than risk dropping
    the real end of a split last chapter). A book without a usable TOC keeps one chapter per document.
    """
    docs = []
    for idref, linear in book.spine:
        item = book.get_item_with_id(idref)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT or isinstance(item, epub.EpubNav):
            continue
        if linear == "no" and not all_spine:
            continue
        docs.append(item)
    in_toc = [_norm_href(item.get_name()) in titles for item in docs]
    if all_spine or not any(in_toc):
        return [(item, True) for item in docs]
    first = in_toc.index(True)
    return list(zip(docs, in_toc))[first:]


def read_epub(path: Path, limits: CorpusLimits = CorpusLimits(), *, all_spine: bool = False) -> list[Chapter]:
    """Chapters of an EPUB in reading order (`_reading_order`), titles from the TOC (else the first
    heading, else the file name); `all_spine` makes every spine document with text a chapter."""
    name = str(path)
    check_zip(path, limits)
    try:
        book = epub.read_epub(str(path), options={"ignore_ncx": False})
        titles = _toc_titles(book.toc)
    except Exception as e:  # noqa: BLE001 - ebooklib meets a malformed OPF/NCX with whatever it trips on
        # (XMLSyntaxError, KeyError, AttributeError, IndexError, TypeError...): all mean "not readable".
        raise CorpusError(f"{name}: not a readable EPUB ({type(e).__name__}: {e})") from None
    chapters: list[Chapter] = []
    for item, starts in _reading_order(book, titles, all_spine):
        where = f"{name}#{item.get_name()}"
        raw = item.content if isinstance(item.content, bytes) else item.get_content()  # as stored, not re-serialized
        html = remove_control_characters(decode_document(raw, where), where)
        paragraphs, heading = html_to_paragraphs(html)
        paragraphs = [p for p in map(plain_emphasis, paragraphs) if p]
        if not paragraphs:
            continue  # cover images, empty nav pages
        if not starts and chapters:  # the rest of the chapter before, in its own file
            prev = chapters[-1]
            chapters[-1] = prev.model_copy(update={"text": prev.text + "\n\n" + "\n\n".join(paragraphs)})
            continue
        text = "\n".join(paragraphs)
        check_line_lengths(text, where, unit="paragraph")
        title = titles.get(_norm_href(item.get_name())) or heading or PurePosixPath(item.get_name()).stem
        chapters.append(Chapter(index=len(chapters), title=title, text="\n\n".join(paragraphs), source=where))
    if not chapters:
        raise CorpusError(f"{name}: no text (empty corpus: no spine document has text)")
    return chapters
