"""Pronunciation lexicons (`--lexicon FILE`): say a term as written differently.

Two formats, both (term, replacement) pairs applied after text normalization and before segmentation,
whole-word and case-sensitive:

- `.tsv`: `term<TAB>replacement` per line; blank lines and lines starting with `#` are skipped.
- `.pls`: a W3C Pronunciation Lexicon Specification file's alias entries
  (`<lexeme><grapheme>SQL</grapheme><alias>sequel</alias></lexeme>`, every grapheme of a lexeme maps
  to its alias); lexemes with only a `<phoneme>` are ignored (CosyVoice2 reads text, not phonemes).

"Whole word" means a term that starts (ends) with a letter or digit must not have one right before
(after) it; Chinese and Japanese characters count as their own words, so a polyphone written as
`行长<TAB>航长` matches inside a sentence. Longer terms win over shorter ones that overlap them.
The entries' hash goes into the job spec: a changed lexicon changes the spoken text, which the
segment cache (voxbatch/reuse.py) then renders anew only where it changed.
"""

from __future__ import annotations

import hashlib
import json
import re
from xml.parsers import expat
from dataclasses import dataclass
from pathlib import Path

MAX_BYTES = 4 << 20
MAX_ENTRIES = 100_000
MAX_TERM_CHARS = 200
# Letters and digits that are not CJK: the characters a whole-word term must not touch.
_WORD = r"[^\W_\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]"
_WORD_RE = re.compile(_WORD)


class LexiconError(ValueError):
    """A lexicon file that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Lexicon:
    entries: tuple[tuple[str, str], ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.entries, ensure_ascii=False).encode()).hexdigest()

    def __post_init__(self) -> None:
        alternatives = []
        for term, _ in sorted(self.entries, key=lambda e: -len(e[0])):
            left = f"(?<!{_WORD})" if _WORD_RE.match(term[0]) else ""
            right = f"(?!{_WORD})" if _WORD_RE.match(term[-1]) else ""
            alternatives.append(left + re.escape(term) + right)
        object.__setattr__(self, "_pattern", re.compile("|".join(alternatives)) if alternatives else None)
        object.__setattr__(self, "_map", dict(self.entries))

    def apply(self, text: str) -> str:
        if self._pattern is None:  # type: ignore[attr-defined]
            return text
        return self._pattern.sub(lambda m: self._map[m.group(0)], text)  # type: ignore[attr-defined]


def load_lexicon(path: str | Path) -> Lexicon:
    p = Path(path)
    if not p.is_file():
        raise LexiconError(f"{p}: no such lexicon file")
    if p.stat().st_size > MAX_BYTES:
        raise LexiconError(f"{p}: {p.stat().st_size} bytes, a lexicon is at most {MAX_BYTES}")
    data = p.read_bytes()
    suffix = p.suffix.lower()
    if suffix == ".tsv":
        pairs = _read_tsv(data, str(p))
    elif suffix == ".pls":
        pairs = _read_pls(data, str(p))
    else:
        raise LexiconError(f"{p}: unsupported lexicon type {suffix or '(no suffix)'!r}; expected .tsv or .pls")
    return _checked(pairs, str(p))


def _checked(pairs: list[tuple[int, str, str]], name: str) -> Lexicon:
    if not pairs:
        raise LexiconError(f"{name}: no entries")
    if len(pairs) > MAX_ENTRIES:
        raise LexiconError(f"{name}: {len(pairs)} entries, at most {MAX_ENTRIES}")
    seen: dict[str, int] = {}
    for line, term, replacement in pairs:
        if not term:
            raise LexiconError(f"{name}:{line}: empty term")
        if len(term) > MAX_TERM_CHARS or len(replacement) > MAX_TERM_CHARS:
            raise LexiconError(f"{name}:{line}: term or replacement longer than {MAX_TERM_CHARS} characters")
        if term in seen:
            raise LexiconError(f"{name}:{line}: term {term!r} already defined on line {seen[term]}")
        seen[term] = line
    return Lexicon(tuple((term, replacement) for _, term, replacement in pairs))


def _read_tsv(data: bytes, name: str) -> list[tuple[int, str, str]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LexiconError(f"{name}: not UTF-8 text (invalid byte at offset {e.start})") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 2:
            raise LexiconError(f"{name}:{number}: expected term<TAB>replacement, got {len(fields)} field(s)")
        pairs.append((number, fields[0].strip(), fields[1].strip()))
    return pairs


def _read_pls(data: bytes, name: str) -> list[tuple[int, str, str]]:
    """(line of the lexeme, grapheme, alias) for every grapheme of a lexeme with an alias."""
    if b"<!ENTITY" in data:  # entity expansion is the XML bomb; a PLS file never needs entities
        raise LexiconError(f"{name}: XML entity declarations are not accepted")
    parser = expat.ParserCreate(namespace_separator="}")
    pairs: list[tuple[int, str, str]] = []
    lexeme: dict | None = None  # the open <lexeme>: line, graphemes, aliases
    text: list[str] | None = None  # characters of the open <grapheme>/<alias>
    tags: list[str] = []

    def start(tag: str, _attrs) -> None:
        nonlocal lexeme, text
        local = tag.rsplit("}", 1)[-1]
        if not tags and local != "lexicon":
            raise LexiconError(f"{name}:{parser.CurrentLineNumber}: root element <{local}>, expected a PLS <lexicon>")
        tags.append(local)
        if local == "lexeme":
            lexeme = {"line": parser.CurrentLineNumber, "grapheme": [], "alias": []}
        elif local in ("grapheme", "alias") and lexeme is not None:
            text = []

    def end(tag: str) -> None:
        nonlocal lexeme, text
        local = tags.pop()
        if local in ("grapheme", "alias") and lexeme is not None and text is not None:
            lexeme[local].append("".join(text).strip())
            text = None
        elif local == "lexeme" and lexeme is not None:
            if not lexeme["grapheme"]:
                raise LexiconError(f"{name}:{lexeme['line']}: <lexeme> without a <grapheme>")
            if lexeme["alias"]:
                pairs.extend((lexeme["line"], g, lexeme["alias"][0]) for g in lexeme["grapheme"])
            lexeme = None

    def chars(data_: str) -> None:
        if text is not None:
            text.append(data_)

    parser.StartElementHandler, parser.EndElementHandler, parser.CharacterDataHandler = start, end, chars
    try:
        parser.Parse(data, True)
    except expat.ExpatError as e:
        raise LexiconError(f"{name}:{e.lineno}: not well-formed XML ({expat.errors.messages[e.code]})") from None
    if not pairs:
        raise LexiconError(f"{name}: no <alias> entries (phoneme-only lexemes are not used)")
    return pairs
