"""SRT and WebVTT subtitles for an assembled chapter: one cue per segment.

Cue times come from the assembler's sample positions, converted to whole milliseconds once
(`samples_to_ms`), so the SRT, the VTT and the m4b chapter markers round the same way.
"""

from __future__ import annotations

import re
import textwrap
import unicodedata
from dataclasses import dataclass

# Subtitle guidelines (BBC, Netflix) cap a line at about 42 characters; widths are in display columns,
# where a CJK character takes two (Netflix's Chinese guideline: 16 characters a line, we allow 21).
LINE_WIDTH = 42
# Punctuation that must not open a line (kinsoku): it stays with the character before it.
_NO_LINE_START = set("，。！？、；：」』）》〉】”’…—,.!?;:)]}")
_UNIT = re.compile(r"\s+|[^\s]")


@dataclass(frozen=True)
class Cue:
    start_ms: int
    end_ms: int
    text: str


def samples_to_ms(samples: int, sample_rate: int) -> int:
    """A sample position in whole milliseconds, rounded half up, in integer arithmetic."""
    return (samples * 1000 * 2 + sample_rate) // (2 * sample_rate)


def _clock(ms: int, sep: str) -> str:
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt_time(ms: int) -> str:
    """HH:MM:SS,mmm (hours grow past two digits for very long chapters)."""
    return _clock(ms, ",")


def vtt_time(ms: int) -> str:
    """HH:MM:SS.mmm (WebVTT allows the hours; writing them always keeps both files alike)."""
    return _clock(ms, ".")


def display_width(text: str) -> int:
    """Columns a string takes on screen: East Asian wide and full-width characters count two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _is_wide(c: str) -> bool:
    return unicodedata.east_asian_width(c) in "WF"


def _units(text: str) -> list[str]:
    """Breakable units: a wide character (with any closing punctuation after it), or a run of narrow
    non-blank characters (a word), or a blank."""
    out: list[str] = []
    for tok in _UNIT.findall(text):
        if out and tok in _NO_LINE_START:
            out[-1] += tok
        elif out and not tok.isspace() and not _is_wide(tok) and not out[-1].isspace() and not _is_wide(out[-1][-1]):
            out[-1] += tok  # extend a narrow word
        else:
            out.append(tok)
    return out


def _greedy(units: list[str], width: int) -> list[str]:
    lines: list[str] = []
    line = ""
    for u in units:
        if u.isspace():
            if line:
                line += " "
            continue
        if line and display_width(line + u) > width:
            lines.append(line.rstrip())
            line = u
        else:
            line += u
    if line.strip():
        lines.append(line.rstrip())
    return lines


def _wrap_wide(text: str, width: int) -> list[str]:
    units = _units(text)
    lines = _greedy(units, width)
    if len(lines) <= 1:
        return lines
    narrow = -(-display_width(text) // len(lines))
    for w in range(narrow, width):
        balanced = _greedy(units, w)
        if len(balanced) == len(lines):
            return balanced
    return lines


def wrap(text: str, width: int = LINE_WIDTH) -> list[str]:
    """Lines of at most `width` display columns, balanced so the last line is not a lone word.

    Whitespace (newlines included) collapses, which also keeps a cue free of the blank lines
    that would end it early in both formats. Text with wide characters (Chinese, Japanese) breaks
    between any two of them by display width (a CJK character is two columns), never before a
    closing punctuation mark.
    """
    words = " ".join(text.split())
    if any(_is_wide(c) for c in words):
        return _wrap_wide(words, width)
    lines = textwrap.wrap(words, width=width, break_long_words=True, break_on_hyphens=False)
    if len(lines) <= 1:
        return lines
    # The narrowest width that still needs no more lines spreads the words evenly.
    narrow = -(-len(words) // len(lines))
    for w in range(narrow, width):
        balanced = textwrap.wrap(words, width=w, break_long_words=True, break_on_hyphens=False)
        if len(balanced) == len(lines):
            return balanced
    return lines


def _vtt_escape(line: str) -> str:
    # "&" first; escaping ">" also keeps "-->" out of the cue text.
    return line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_srt(cues: list[Cue]) -> str:
    blocks = [
        f"{i}\n{srt_time(c.start_ms)} --> {srt_time(c.end_ms)}\n" + "\n".join(wrap(c.text)) + "\n"
        for i, c in enumerate(cues, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(cues: list[Cue]) -> str:
    blocks = ["WEBVTT\n"]
    blocks += [
        f"{vtt_time(c.start_ms)} --> {vtt_time(c.end_ms)}\n" + "\n".join(_vtt_escape(x) for x in wrap(c.text)) + "\n"
        for c in cues
    ]
    return "\n".join(blocks)
