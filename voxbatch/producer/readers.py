"""Corpus readers: a .txt, .md or .epub file, or a folder of .txt/.md files, to a list of chapters.

Every reader returns `Chapter`s whose `text` is what will be spoken: the chapter's heading line (as it
appears in the source) followed by its paragraphs, paragraphs separated by one blank line ("\\n\\n").
Segmentation never merges across a paragraph break, so paragraph structure survives to the audio.

Input is refused early with a `CorpusError` naming the file (and byte offset or line) rather than turned
into garbage audio hours later on a GPU: binary files, text that is not UTF-8, an empty corpus, a
single line so long that it cannot be real prose, a corpus over `CorpusLimits.max_bytes`, a folder
entry that is a symlink leading out of the folder, and text that is mostly control characters (a few
stray ones are removed: they would be read aloud as noise or silence).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from voxbatch.models import Chapter

MAX_LINE_CHARS = 100_000  # a longer single line is a data file or a broken export, not a book
FRONT_MATTER_TITLE = "Front matter"
TEXT_SUFFIXES = (".txt", ".md", ".markdown")
MARKDOWN_SUFFIXES = (".md", ".markdown")
_WRAP_WIDTH = 100  # lines all shorter than this in a block are taken as hard-wrapped prose


class CorpusError(ValueError):
    """The corpus cannot be read; the message names the file and where."""


@dataclass(frozen=True)
class CorpusLimits:
    """Bounds on what reading a corpus may cost (defaults as in `Settings`; see `from_settings`)."""

    max_bytes: int = 32 * 2**20  # a file, or a folder's files together, as stored on disk
    max_epub_uncompressed_bytes: int = 256 * 2**20  # an EPUB's members inflated, in all
    max_epub_ratio: float = 100.0  # inflated / compressed bytes of one EPUB member over 1 MiB

    @classmethod
    def from_settings(cls, settings) -> "CorpusLimits":
        return cls(settings.max_corpus_bytes, settings.max_epub_uncompressed_bytes, settings.max_epub_ratio)


def check_size(path: Path, size: int, limits: CorpusLimits, what: str = "corpus") -> None:
    if size > limits.max_bytes:
        raise CorpusError(f"{path}: {what} is {size:,} bytes, over the limit of {limits.max_bytes:,} "
                          "(VOXBATCH_MAX_CORPUS_BYTES); split it into several jobs")


def check_corpus(path: Path, limits: CorpusLimits) -> None:
    """The size limits of a corpus file, before anything else opens it (an EPUB's zip directory too)."""
    if path.is_file():
        check_size(path, path.stat().st_size, limits)
        if path.suffix.lower() == ".epub":
            from voxbatch.producer.epub import check_zip

            check_zip(path, limits)


def read_corpus(path: str | Path, limits: CorpusLimits = CorpusLimits(), *, all_spine: bool = False) -> list[Chapter]:
    """Read a corpus and return its chapters in reading order, indexed from 0.

    `all_spine`: EPUB only, also read spine items that readers skip (linear="no", absent from the TOC).
    """
    p = Path(path)
    if p.is_dir():
        return _read_directory(p, limits)
    if not p.is_file():
        raise CorpusError(f"{p}: no such file or directory")
    check_size(p, p.stat().st_size, limits)
    suffix = p.suffix.lower()
    if suffix == ".epub":
        from voxbatch.producer.epub import read_epub  # ebooklib/lxml are loaded only for EPUB corpora

        return read_epub(p, limits, all_spine=all_spine)
    if suffix in TEXT_SUFFIXES:
        text = decode_text(p.read_bytes(), str(p))
        chapters = _split_text(text, str(p), markdown=suffix in MARKDOWN_SUFFIXES, default_title=p.stem)
        return [c.model_copy(update={"index": i}) for i, c in enumerate(chapters)]
    raise CorpusError(
        f"{p}: unsupported corpus type {suffix or '(no suffix)'!r}; expected .txt, .md, .epub or a folder"
    )


# --------------------------------------------------------------------------------------------------------
# Bytes -> text


def decode_text(data: bytes, name: str) -> str:
    """Strict UTF-8 (BOM allowed), line endings to "\\n", with the line-length guard applied."""
    offset = 3 if data.startswith(b"\xef\xbb\xbf") else 0
    nul = data.find(b"\x00", offset)
    if nul >= 0:
        raise CorpusError(f"{name}: binary file, not text (NUL byte at offset {nul})")
    try:
        text = data[offset:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        hint = " (UTF-16 byte-order mark: save the file as UTF-8)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise CorpusError(f"{name}: not UTF-8 text (invalid byte 0x{data[at]:02x} at offset {at}){hint}") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = remove_control_characters(text, name)
    check_line_lengths(text, name)
    return text


# C0 controls but tab and newline, DEL, C1 controls: never prose, and the engine would voice them.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
MAX_CONTROL_SHARE = 0.01  # more than 1% of the characters: a binary or a broken export, not text


def remove_control_characters(text: str, name: str) -> str:
    """Text without control characters; a text made largely of them is refused, naming the first."""
    found = _CONTROL.findall(text)
    if not found:
        return text
    if len(found) > max(16, MAX_CONTROL_SHARE * len(text)):
        at = _CONTROL.search(text)
        raise CorpusError(f"{name}: {len(found)} control characters in {len(text)} (the first, "
                          f"U+{ord(at.group()):04X}, at character {at.start()}); not text")
    return _CONTROL.sub("", text)


def check_line_lengths(text: str, name: str, unit: str = "line") -> None:
    """Refuse a single line (or paragraph, for EPUB) longer than MAX_LINE_CHARS, naming its number."""
    if len(text) <= MAX_LINE_CHARS:
        return
    for number, line in enumerate(text.split("\n"), start=1):
        if len(line) > MAX_LINE_CHARS:
            raise CorpusError(
                f"{name}:{number}: huge {unit} ({len(line)} characters, limit {MAX_LINE_CHARS}); "
                "is this really prose?"
            )


# --------------------------------------------------------------------------------------------------------
# Chapter headings in plain text


_NUM_WORD = (
    r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred)"
)
_NUMBER_WORDS = rf"{_NUM_WORD}(?:[\s-]+(?:and[\s-]+)?{_NUM_WORD})*"
_ROMAN = r"(?=[MDCLXVI])M{0,4}(?:CM|CD|D?C{0,3})(?:XC|XL|L?X{0,3})(?:IX|IV|V?I{0,3})"
_EN_CHAPTER = re.compile(
    rf"(?:chapter|chap\.)\s+(?:\d+|{_ROMAN}|{_NUMBER_WORDS})\.?(?:\s*[:.\-–—]\s*\S.*|\s+\S.*)?",
    re.IGNORECASE,
)
_EN_BARE = re.compile(rf"(?:chapter|chap\.)\s+(?:\d+|{_ROMAN}|{_NUMBER_WORDS})", re.IGNORECASE)
_EN_SPECIAL = re.compile(r"(?:prologue|epilogue|preface|foreword|afterword)(?:\s*[:.\-–—]\s*\S.*)?", re.IGNORECASE)
_ZH_CHAPTER = re.compile(r"第\s*[0-9０-９零〇一二两三四五六七八九十百千万]+\s*[章回节卷](?:[\s:：、.．]*\S.*)?")
_ZH_SPECIAL = re.compile(r"(?:序章|序言|楔子|引子|尾声|后记|终章)(?:[\s:：]+\S.*)?")
_HEADING_MAX_CHARS = 80
_SENTENCE_END = tuple(".!?。！？…")


def chapter_heading(line: str) -> tuple[str, bool] | None:
    """(title, numbered) if the line is a chapter heading like "Chapter 12", "CHAPTER XII", "第十二章 标题".

    Headings are short lines that do not end like a sentence ("Chapter 5 was the best." is prose);
    "Chapter 12." alone is allowed. `numbered` is False for "Prologue"/"序章"-style headings, which only
    count when the book also has numbered chapters.
    """
    s = line.strip()
    if not s or len(s) > _HEADING_MAX_CHARS:
        return None
    for pattern, numbered in ((_EN_CHAPTER, True), (_ZH_CHAPTER, True), (_EN_SPECIAL, False), (_ZH_SPECIAL, False)):
        if pattern.fullmatch(s) is None:
            continue
        if s.endswith(_SENTENCE_END) and not (s.endswith(".") and _EN_BARE.fullmatch(s[:-1])):
            return None
        return s, numbered
    return None


# --------------------------------------------------------------------------------------------------------
# Markdown (markdown-it-py: CommonMark, GFM tables)


_ATX = re.compile(r" {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*")  # "# Heading" lines in plain .txt
_FOOTNOTE_REF = re.compile(r"\[\^[^\]]+\]")
_FOOTNOTE_DEF = re.compile(r"\s*\[\^[^\]]+\]:")  # "[^1]: note": not CommonMark, so a paragraph to drop
_HTML_TAG = re.compile(r"<!--.*?-->|</?[A-Za-z][^>]*>", re.S)
_FRONT_MATTER_LINES = 60  # a YAML block at the very top is looked for this far down


def _inline_lines(inline) -> list[str]:
    """Plain text of one markdown-it inline token, one string per source line: emphasis, code and link
    markup gone (their words kept), images, raw HTML tags and footnote markers dropped."""
    lines, buf, in_image = [], [], 0
    for tok in inline.children or []:
        if tok.type == "image":
            continue  # its alt text is a description of a picture, not prose
        if tok.type in ("softbreak", "hardbreak"):
            lines.append("".join(buf))
            buf = []
        elif tok.type in ("text", "code_inline"):
            buf.append(tok.content)
    lines.append("".join(buf))
    return [_FOOTNOTE_REF.sub("", line).rstrip() for line in lines]


def _markdown_lines(text: str) -> list[_Line]:
    """Source lines of a markdown file as `_Line`s, parsed by markdown-it-py (CommonMark + tables).

    Every source line keeps its number: content lines carry their plain text, headings their level,
    everything else (blank lines, rules, link definitions, fences, front matter) is blank. List items,
    table rows and code lines start paragraphs of their own.
    """
    from markdown_it import MarkdownIt

    raw = text.split("\n")
    out = [_Line(n, "") for n in range(1, len(raw) + 1)]
    first = 0
    if raw and raw[0].strip() == "---":  # YAML front matter block at the very top
        first = next((j + 1 for j in range(1, min(len(raw), _FRONT_MATTER_LINES)) if raw[j].strip() in ("---", "...")), 0)
    tokens = MarkdownIt("commonmark").enable(["table", "strikethrough"]).parse("\n".join(raw[first:]))
    in_item = 0
    cells: list[str] = []
    row_line = 0
    for i, tok in enumerate(tokens):
        if tok.type == "list_item_open":
            in_item += 1
        elif tok.type == "list_item_close":
            in_item -= 1
        elif tok.type == "tr_open":
            cells, row_line = [], first + tok.map[0]
        elif tok.type == "inline" and tokens[i - 1].type in ("th_open", "td_open"):
            cells.append(" ".join(_inline_lines(tok)).strip())
        elif tok.type == "tr_close" and cells:
            out[row_line] = _Line(row_line + 1, ", ".join(c for c in cells if c), starts_paragraph=True)
        elif tok.type == "inline" and tokens[i - 1].type == "heading_open":
            n = first + tok.map[0]
            out[n] = _Line(n + 1, " ".join(_inline_lines(tok)).strip(), level=int(tokens[i - 1].tag[1]))
        elif tok.type == "inline" and tokens[i - 1].type == "paragraph_open":
            if _FOOTNOTE_DEF.match(tok.content):
                continue
            for k, line in enumerate(_inline_lines(tok)):
                n = first + tok.map[0] + k
                out[n] = _Line(n + 1, line, starts_paragraph=bool(in_item) and k == 0)
        elif tok.type in ("fence", "code_block"):
            body = tok.map[0] + (1 if tok.type == "fence" else 0)
            for k, line in enumerate(tok.content.split("\n")[:-1]):
                n = first + body + k
                out[n] = _Line(n + 1, line.strip(), starts_paragraph=True)
        elif tok.type == "html_block":
            for k, line in enumerate(tok.content.split("\n")[:-1]):
                n = first + tok.map[0] + k
                out[n] = _Line(n + 1, " ".join(_HTML_TAG.sub("", line).split()))
    return out


# --------------------------------------------------------------------------------------------------------
# Text -> chapters


class _Line:
    """One source line after markup handling: content, or a heading of some level (0 = chapter line)."""

    __slots__ = ("number", "text", "level", "starts_paragraph")

    def __init__(self, number: int, text: str, level: int | None = None, starts_paragraph: bool = False):
        self.number = number
        self.text = text
        self.level = level
        self.starts_paragraph = starts_paragraph


def _plain_lines(text: str) -> list[_Line]:
    return [_Line(n, line.rstrip()) for n, line in enumerate(text.split("\n"), start=1)]


def _mark_chapter_lines(lines: list[_Line]) -> bool:
    """Mark plain chapter-heading lines as level-0 headings; False when the text has no numbered chapter.

    A heading must follow a blank line (or open the text), so that hard-wrapped prose starting a line
    with "Chapter 5 of the treaty" is not taken for one; Chinese headings may also follow a line that
    ends a sentence, as one-paragraph-per-line novels have no blank lines.
    """
    hits: list[tuple[_Line, str, bool]] = []
    prev = ""
    for ln in lines:
        if ln.level is None and (h := chapter_heading(ln.text)) is not None:
            after_break = not prev.strip() or (bool(_CJK.search(ln.text)) and prev.rstrip().endswith(_CJK_END))
            if after_break:
                hits.append((ln, h[0], h[1]))
        prev = ln.text
    if not any(numbered for _, _, numbered in hits):
        return False
    for ln, title, _ in hits:
        ln.text, ln.level = title, 0
    return True


def _split_level(lines: list[_Line]) -> int | None:
    """The heading level that splits the book: the shallowest with two or more headings, else any."""
    counts: dict[int, int] = {}
    for ln in lines:
        if ln.level is not None and ln.text:
            counts[ln.level] = counts.get(ln.level, 0) + 1
    if not counts:
        return None
    several = [lvl for lvl, n in counts.items() if n >= 2]
    return min(several) if several else min(counts)


def _mark_headings(lines: list[_Line], markdown: bool) -> int | None:
    """Decide which lines are headings; return the level that splits chapters (None: no chapters).

    Markdown headings first (markdown only), then chapter lines ("Chapter 3", "第三章"), then, in
    .txt only, "# Heading" lines (with no other markdown handling).
    """
    level = _split_level(lines) if markdown else None
    if level is not None:
        return level
    for ln in lines:
        ln.level = None  # markdown headings with empty text: plain content
    if _mark_chapter_lines(lines):
        return 0
    if markdown:
        return None
    for ln in lines:
        if (h := _ATX.fullmatch(ln.text)) is not None and h.group(2):
            ln.text, ln.level = h.group(2).strip(), len(h.group(1))
    return _split_level(lines)


def _split_text(text: str, name: str, *, markdown: bool, default_title: str) -> list[Chapter]:
    """Chapters of one decoded text file (indices 0..n-1; the caller renumbers)."""
    if not text.strip():
        raise CorpusError(f"{name}: no text (empty corpus)")
    lines = _markdown_lines(text) if markdown else _plain_lines(text)
    level = _mark_headings(lines, markdown)

    chapters: list[Chapter] = []
    title, source, body = None, f"{name}:1", []

    def flush() -> None:
        paragraphs = _paragraphs(body)
        has_text = any(not p.is_heading for p in paragraphs) or title is not None
        if not has_text:
            return
        chapter_title = title if title is not None else (FRONT_MATTER_TITLE if level is not None else default_title)
        text = "\n\n".join(p.text for p in paragraphs)
        chapters.append(Chapter(index=len(chapters), title=chapter_title, text=text, source=source))

    for ln in lines:
        if level is not None and ln.level == level and ln.text:
            flush()
            title, source, body = ln.text, f"{name}:{ln.number}", [_Line(ln.number, ln.text, level=ln.level)]
        else:
            body.append(ln)
    flush()
    if not chapters or not any(c.text.strip() for c in chapters):
        raise CorpusError(f"{name}: no text (empty corpus)")
    return chapters


class _Paragraph:
    __slots__ = ("text", "is_heading")

    def __init__(self, text: str, is_heading: bool):
        self.text = text
        self.is_heading = is_heading


_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff\u3000-\u303f\uff00-\uffef]")
_CJK_END = tuple("。！？…」』”）；：")


def _join(a: str, b: str) -> str:
    """Join two wrapped lines: no space between CJK characters, one space otherwise."""
    if _CJK.match(a[-1:]) or _CJK.match(b[:1]):
        return a + b
    return f"{a} {b}"


def _paragraphs(lines: list[_Line]) -> list[_Paragraph]:
    """Group lines into paragraphs.

    Blank lines always separate paragraphs; headings are paragraphs of their own. Inside a block of
    non-blank lines: a block whose lines are all short is hard-wrapped prose and is joined, except where
    a line is indented (old-style paragraph starts) or, for Chinese, where the previous line ends a
    sentence (one-paragraph-per-line novels); a block with long lines has one paragraph per line.
    """
    out: list[_Paragraph] = []
    block: list[_Line] = []

    def flush_block() -> None:
        if not block:
            return
        wrapped = all(len(ln.text) <= _WRAP_WIDTH for ln in block[:-1])
        current = ""
        for k, ln in enumerate(block):
            s = ln.text.strip()
            new = k == 0 or ln.starts_paragraph or not wrapped
            if not new:
                prev = block[k - 1].text.rstrip()
                indented = ln.text[:1] in (" ", "\t", "\u3000")
                cjk_break = bool(_CJK.search(prev)) and prev.endswith(_CJK_END)
                new = indented or cjk_break
            if new:
                if current:
                    out.append(_Paragraph(current, False))
                current = s
            else:
                current = _join(current, s)
        if current:
            out.append(_Paragraph(current, False))
        block.clear()

    for ln in lines:
        if ln.level is not None:
            flush_block()
            if ln.text.strip():
                out.append(_Paragraph(ln.text.strip(), True))
        elif not ln.text.strip():
            flush_block()
        else:
            block.append(ln)
    flush_block()
    return out


# --------------------------------------------------------------------------------------------------------
# Folder: one chapter per file


def natural_key(name: str) -> list[tuple[int, int | str]]:
    """Sort key putting "2.txt" before "10.txt": digit runs compare as numbers."""
    return [(0, int(part)) if part.isdigit() else (1, part.casefold()) for part in re.split(r"(\d+)", name) if part]


def _inside(folder: Path, entry: Path) -> Path:
    """`entry`, refused when it is a symlink that leads out of `folder` (a corpus folder is untrusted:
    a link to /etc/passwd or ~/.aws/credentials would be read aloud and stored)."""
    if entry.is_symlink():
        target = entry.resolve()
        if folder.resolve() not in target.parents:
            raise CorpusError(f"{entry}: symlink to {target}, outside the corpus folder; refused")
    return entry


def _read_directory(folder: Path, limits: CorpusLimits = CorpusLimits()) -> list[Chapter]:
    entries = [f for f in folder.iterdir() if not f.name.startswith(".") and f.suffix.lower() in TEXT_SUFFIXES]
    files = sorted((f for f in entries if _inside(folder, f).is_file()), key=lambda f: natural_key(f.name))
    if not files:
        raise CorpusError(f"{folder}: no .txt or .md files in this folder")
    check_size(folder, sum(f.stat().st_size for f in files), limits, what="folder's text")
    chapters = []
    for index, f in enumerate(files):
        text = decode_text(f.read_bytes(), str(f))
        if not text.strip():
            raise CorpusError(f"{f}: no text (empty file)")
        markdown = f.suffix.lower() in MARKDOWN_SUFFIXES
        lines = _markdown_lines(text) if markdown else _plain_lines(text)
        _mark_headings(lines, markdown)
        title = next((ln.text for ln in lines if ln.level is not None and ln.text), f.stem)
        body = "\n\n".join(p.text for p in _paragraphs(lines))
        if not body.strip():
            raise CorpusError(f"{f}: no text (empty file)")
        chapters.append(Chapter(index=index, title=title, text=body, source=str(f)))
    return chapters
