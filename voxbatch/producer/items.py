"""Line-item batches: a `.jsonl` or `.csv` corpus, one item per line/row, one output file per item.

Columns (JSON keys, or the CSV header row):

    id     required  unique, safe as a file name: 1-128 of A-Z a-z 0-9 _ . -, starting with a letter
                     or digit (ids differing only in case are duplicates: they collide on macOS/Windows)
    text   required  what to say (normalized, lexicon applied, segmented like a paragraph)
    voice  optional  voice profile name (default: the job's --voice)
    speed  optional  speaking rate, 0.25 < speed <= 4
    seed   optional  sampling seed, 0 <= seed < 2**32 (default: derived from the content)

Every row is checked before anything is stored or queued; the first bad one is refused with its line
number. The item's audio lands at `jobs/<job>/items/<id>.<fmt>` (voxbatch/keys.py).
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from voxbatch.producer.readers import MAX_LINE_CHARS, decode_text
from voxbatch.reuse import is_builtin_voice
from voxbatch.voice import NAME_RE

ITEM_SUFFIXES = (".jsonl", ".csv")
MAX_ITEMS = 1_000_000
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class ItemError(ValueError):
    """A bad row; the message names the file and line."""


class Item(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    text: str = Field(min_length=1, max_length=MAX_LINE_CHARS)
    voice: str | None = None
    speed: float | None = Field(None, gt=0.25, le=4.0)
    seed: int | None = Field(None, ge=0, lt=2**32)
    line: int = Field(0, exclude=True)  # where it was read (set by the reader, not a column)

    @field_validator("id")
    @classmethod
    def _safe_id(cls, v: str) -> str:
        if not ID_RE.fullmatch(v):
            raise ValueError("must be 1-128 of A-Z a-z 0-9 _ . -, starting with a letter or digit")
        return v

    @field_validator("voice")
    @classmethod
    def _voice_name(cls, v: str | None) -> str | None:
        if v is not None and not (NAME_RE.fullmatch(v) or is_builtin_voice(v)):
            raise ValueError("not a voice name")
        return v


def _rows(text: str, suffix: str, name: str):
    """(line number, dict) per item; blank JSONL lines are skipped, CSV needs a header with id, text."""
    if suffix == ".jsonl":
        for number, line in enumerate(text.split("\n"), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ItemError(f"{name}:{number}: not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ItemError(f"{name}:{number}: expected a JSON object, got {type(row).__name__}")
            yield number, row
        return
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    try:
        header = reader.fieldnames or []
        if "id" not in header or "text" not in header:
            raise ItemError(f"{name}:1: the CSV header must name the columns id and text, got {header}")
        start = reader.line_num + 1
        for row in reader:
            if None in row:
                raise ItemError(f"{name}:{start}: more fields than the header has columns")
            yield start, {k: v for k, v in row.items() if v not in (None, "") or k in ("id", "text")}
            start = reader.line_num + 1
    except csv.Error as e:
        raise ItemError(f"{name}:{reader.line_num}: bad CSV ({e})") from None


def read_items(path: str | Path) -> list[Item]:
    """Every item of a .jsonl/.csv corpus, validated; ItemError naming the first bad line."""
    p = Path(path)
    if not p.is_file():
        raise ItemError(f"{p}: no such file")
    text = decode_text(p.read_bytes(), str(p))
    items: list[Item] = []
    first_line: dict[str, int] = {}
    for number, row in _rows(text, p.suffix.lower(), str(p)):
        try:
            item = Item.model_validate({**row, "line": number})
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or "row"
            raise ItemError(f"{p}:{number}: {field}: {err['msg']}") from None
        folded = item.id.lower()
        if folded in first_line:
            raise ItemError(f"{p}:{number}: duplicate id {item.id!r} (first on line {first_line[folded]})")
        first_line[folded] = number
        items.append(item)
        if len(items) > MAX_ITEMS:
            raise ItemError(f"{p}:{number}: more than {MAX_ITEMS} items")
    if not items:
        raise ItemError(f"{p}: no items")
    return items
