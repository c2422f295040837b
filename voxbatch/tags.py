"""Book metadata written into delivered audio files: ID3 for MP3, MP4 atoms for .m4a/.m4b (mutagen).

Players and storefronts read title, author, album and track number from these tags, and show the
cover from an embedded picture; a file named `0003.mp3` says nothing on its own. Other formats are
left untagged (their metadata is not what audiobook platforms read).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TAGGED_FORMATS = ("mp3", "m4a", "m4b")


@dataclass(frozen=True)
class Tags:
    title: str  # this file: the chapter title (or the book title for the whole book)
    album: str  # the book title
    author: str | None = None
    track: int | None = None  # 1-based position of the file in the book
    track_total: int | None = None
    cover: bytes | None = None  # JPEG or PNG bytes
    cover_mime: str | None = None  # "image/jpeg" | "image/png"
    genre: str = "Audiobook"


def write_tags(path: str | Path, fmt: str, tags: Tags) -> bool:
    """Tag the file at `path` in place; False for formats that are not tagged."""
    if fmt == "mp3":
        _id3(Path(path), tags)
        return True
    if fmt in ("m4a", "m4b"):
        _mp4(Path(path), tags)
        return True
    return False


def _id3(path: Path, t: Tags) -> None:
    from mutagen.id3 import APIC, ID3, TALB, TCON, TIT2, TPE1, TRCK, ID3NoHeaderError

    try:
        id3 = ID3(path)
    except ID3NoHeaderError:
        id3 = ID3()
    id3.add(TIT2(encoding=3, text=t.title))
    id3.add(TALB(encoding=3, text=t.album))
    id3.add(TCON(encoding=3, text=t.genre))
    if t.author:
        id3.add(TPE1(encoding=3, text=t.author))
    if t.track:
        id3.add(TRCK(encoding=3, text=f"{t.track}/{t.track_total}" if t.track_total else str(t.track)))
    if t.cover:
        id3.add(APIC(encoding=3, mime=t.cover_mime or "image/jpeg", type=3, desc="Cover", data=t.cover))
    id3.save(path, v2_version=3)  # ID3v2.3: what most car stereos and older players read


def _mp4(path: Path, t: Tags) -> None:
    from mutagen.mp4 import MP4, MP4Cover

    mp4 = MP4(path)
    mp4["\xa9nam"] = [t.title]
    mp4["\xa9alb"] = [t.album]
    mp4["\xa9gen"] = [t.genre]
    if t.author:
        mp4["\xa9ART"] = [t.author]
        mp4["aART"] = [t.author]
    if t.track:
        mp4["trkn"] = [(t.track, t.track_total or 0)]
    if t.cover:
        kind = MP4Cover.FORMAT_PNG if t.cover_mime == "image/png" else MP4Cover.FORMAT_JPEG
        mp4["covr"] = [MP4Cover(t.cover, imageformat=kind)]
    mp4.save()
