"""The storage key layout, relative to the storage URL's prefix (see DESIGN.md, "Storage layout").

Keys are deterministic from (job, chapter, segment), so a task delivered twice finds the object
its first delivery stored and does not render it again. They are the only way a key is made: a
worker never writes to a key a message names, and a job id that could leave `jobs/<id>/`
("../voices", "a/b") is refused here, whoever passes it.
"""

from __future__ import annotations

import re

from voxbatch.models import JOB_ID_PATTERN, parse_segment_id, segment_id

# Names that become one storage key component (voice names, job ids): no '/', no '..', no markup,
# nothing a shell or a URL would mangle. Checked here, where keys are made, so no caller can forget.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
JOB_ID_RE = re.compile(JOB_ID_PATTERN)  # also a Redis key part: no dots


class BadName(ValueError):
    """A voice name or job id that cannot be a storage key component; the message names it."""


def check_name(kind: str, name: str) -> str:
    """`name` if it is a valid `kind` ("voice", "job id"), else BadName saying what is allowed."""
    job = kind == "job id"
    if not isinstance(name, str) or not (JOB_ID_RE if job else NAME_RE).fullmatch(name) or ".." in name:
        allowed = "letters, digits, '_' or '-'" if job else "letters, digits, '_', '-' or '.'"
        raise BadName(f"{kind} {str(name)[:80]!r}: use 1-64 {allowed}, starting with a letter or digit")
    return name


def _job(job_id: str) -> str:
    return check_name("job id", job_id)


def voice(name: str) -> str:
    return f"voices/{check_name('voice name', name)}.safetensors"


def job_spec(job_id: str) -> str:
    return f"jobs/{_job(job_id)}/job.json"


def segment(job_id: str, chapter: int, index: int, fmt: str) -> str:
    return f"jobs/{_job(job_id)}/segments/{chapter:04d}/{segment_id(chapter, index)}.{fmt}"


def segment_by_id(job_id: str, seg_id: str, fmt: str) -> str:
    """The key of a segment named by its id ("0003-00042"); ValueError for an id `segment_id` cannot make."""
    return segment(job_id, *parse_segment_id(seg_id), fmt)


def segments_prefix(job_id: str) -> str:
    return f"jobs/{_job(job_id)}/segments/"


def chapter_segments_prefix(job_id: str, chapter_index: int) -> str:
    """The segments of one chapter (what `segment` puts there): assembly lists a chapter's alone."""
    return f"jobs/{_job(job_id)}/segments/{chapter_index:04d}/"


def chapter(job_id: str, chapter_index: int, fmt: str) -> str:
    return f"jobs/{_job(job_id)}/chapters/{chapter_index:04d}.{fmt}"


def chapter_part(job_id: str, chapter_index: int, part: int, fmt: str) -> str:
    """A chapter split into several files (a preset's length cap): part 1, 2, ..."""
    return f"jobs/{_job(job_id)}/chapters/{chapter_index:04d}-{part}.{fmt}"


def chapter_files_prefix(job_id: str, chapter_index: int) -> str:
    return f"jobs/{_job(job_id)}/chapters/{chapter_index:04d}"


def cover(job_id: str, ext: str) -> str:
    return f"jobs/{_job(job_id)}/cover.{ext}"


def book(job_id: str) -> str:
    return f"jobs/{_job(job_id)}/book.m4b"


def manifest(job_id: str) -> str:
    return f"jobs/{_job(job_id)}/manifest.json"


def subtitles(job_id: str, chapter_index: int, ext: str, part: int | None = None) -> str:
    name = f"{chapter_index:04d}" if part is None else f"{chapter_index:04d}-{part}"
    return f"jobs/{_job(job_id)}/subtitles/{name}.{ext}"


def subtitles_prefix(job_id: str, chapter_index: int) -> str:
    return f"jobs/{_job(job_id)}/subtitles/{chapter_index:04d}"


def job_prefix(job_id: str) -> str:
    return f"jobs/{_job(job_id)}/"


def item(job_id: str, item_id: str, fmt: str) -> str:
    """Output of one item of a line-item batch; `item_id` was checked safe (`producer.items.ID_RE`)."""
    return f"jobs/{_job(job_id)}/items/{item_id}.{fmt}"


def cache(content_hash: str, fmt: str) -> str:
    """Content-addressed segment audio, shared by every job (see `voxbatch/reuse.py`)."""
    return f"cache/{content_hash}.{fmt}"
