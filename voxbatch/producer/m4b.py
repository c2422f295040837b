"""The whole book as one .m4b (AAC in an MP4 container) with chapter markers, through ffmpeg.

ffmpeg is optional: `find_ffmpeg()` returns None when it is not on PATH and the assembler then
skips the book. Chapter markers go in through an FFMETADATA file, one `[CHAPTER]` per assembled
chapter with TIMEBASE=1/1000, which ffmpeg's mp4 muxer writes as a chapter track (what audiobook
players read). The input is raw float32 PCM the assembler appended chapter by chapter, so no
container length limit applies (WAV stops at 4 GiB, about 24 h of 24 kHz mono float).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Spoken word in AAC-LC: 64 kb/s mono is what audiobook stores ship.
BITRATE = "64k"


class FfmpegError(RuntimeError):
    pass


@dataclass(frozen=True)
class ChapterMark:
    title: str
    start_ms: int
    end_ms: int


def find_ffmpeg() -> str | None:
    return shutil.which("ffmpeg")


def _escape(value: str) -> str:
    # FFMETADATA: '=', ';', '#', '\' and newlines are special and take a backslash.
    out = value
    for ch in ("\\", "=", ";", "#", "\n"):
        out = out.replace(ch, "\\" + ch)
    return out


def ffmetadata(title: str, marks: list[ChapterMark], author: str | None = None) -> str:
    lines = [";FFMETADATA1", f"title={_escape(title)}", f"album={_escape(title)}", "genre=Audiobook"]
    if author:
        lines += [f"artist={_escape(author)}", f"album_artist={_escape(author)}"]
    for m in marks:
        lines += ["[CHAPTER]", "TIMEBASE=1/1000", f"START={m.start_ms}", f"END={m.end_ms}", f"title={_escape(m.title)}"]
    return "\n".join(lines) + "\n"


def encode_m4b(
    ffmpeg: str,
    pcm_path: Path,
    sample_rate: int,
    channels: int,
    title: str,
    marks: list[ChapterMark],
    out_path: Path,
    author: str | None = None,
) -> None:
    """Encode raw float32 little-endian PCM at `pcm_path` into `out_path` with chapter marks."""
    meta = out_path.with_suffix(".ffmeta")
    meta.write_text(ffmetadata(title, marks, author), encoding="utf-8")
    cmd = [
        ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
        "-f", "f32le", "-ar", str(sample_rate), "-ac", str(channels), "-i", str(pcm_path),
        "-f", "ffmetadata", "-i", str(meta),
        "-map", "0:a", "-map_metadata", "1", "-map_chapters", "1",
        "-c:a", "aac", "-b:a", BITRATE, "-movflags", "+faststart",
        "-f", "mp4", str(out_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FfmpegError(f"ffmpeg failed ({proc.returncode}) writing {out_path.name}: {proc.stderr.strip()[-2000:]}")
