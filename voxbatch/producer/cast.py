"""Multi-voice scripts: `--cast "Alice=voiceA,Bob=voiceB"`.

With a cast, a paragraph that begins with `Name:` (a cast name exactly as written, case-sensitive,
then a colon) is spoken by that name's voice, without the prefix; every other paragraph by the job's
voice (the narrator). A name not in the cast is left as text. Paragraphs are segmentation units, so
a change of speaker is always a segment boundary.
"""

from __future__ import annotations

import re

from voxbatch.reuse import is_builtin_voice
from voxbatch.voice import NAME_RE

MAX_CAST = 256
_NAME = re.compile(r"[^\s=,:][^=,:]{0,63}")


class CastError(ValueError):
    """A `--cast` value that cannot be parsed; the message names the entry."""


def parse_cast(value: str | None) -> dict[str, str]:
    """"Alice=voiceA, Bob=voiceB" -> {"Alice": "voiceA", "Bob": "voiceB"} (blanks around entries ignored)."""
    cast: dict[str, str] = {}
    for entry in (value or "").split(","):
        if not entry.strip():
            continue
        name, sep, voice = (part.strip() for part in entry.partition("="))
        if not sep:
            raise CastError(f"--cast entry {entry.strip()!r}: expected Name=voice")
        if not _NAME.fullmatch(name):
            raise CastError(f"--cast entry {entry.strip()!r}: a name is 1-64 characters without '=', ',' or ':'")
        if not (NAME_RE.fullmatch(voice) or is_builtin_voice(voice)):
            raise CastError(f"--cast entry {entry.strip()!r}: {voice!r} is not a voice name")
        if name in cast:
            raise CastError(f"--cast names {name!r} twice")
        cast[name] = voice
    if len(cast) > MAX_CAST:
        raise CastError(f"--cast has {len(cast)} names, at most {MAX_CAST}")
    return cast


def speaker(paragraph: str, cast: dict[str, str]) -> tuple[str | None, str]:
    """(voice, text without the prefix) for a paragraph starting `Name:`, else (None, paragraph)."""
    head, colon, rest = paragraph.partition(":")
    if colon and head in cast:
        return cast[head], rest.strip()
    return None, paragraph
