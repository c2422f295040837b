"""The whole book as one .m4b (AAC in an MP4 container) with chapter markers, through ffmpeg.

ffmpeg is optional: `find_ffmpeg()` returns None when it is not on PATH and the assembler then
skips the book. Chapter markers go in through an FFMETADATA file, one `[CHAPTER]` per assembled
chapter with TIMEBASE=1/1000, which ffmpeg's mp4 muxer writes as a chapter track (what audiobook
players read). The input is raw float32 PCM the assembler appended chapter by chapter, so no
container length limit applies (WAV stops at 4 GiB, about 24 h of 24 kHz mono float).
"""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
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
    inp, enc = _audio_args(sample_rate, channels)
    _write_marked(ffmpeg, [*inp, "-i", str(pcm_path)], enc, title, marks, author, out_path)


def _audio_args(sample_rate: int, channels: int) -> tuple[list[str], list[str]]:
    """ffmpeg's input options for our raw PCM and its AAC output options: one place for both paths."""
    return ["-f", "f32le", "-ar", str(sample_rate), "-ac", str(channels)], ["-c:a", "aac", "-b:a", BITRATE]


def _write_marked(ffmpeg: str, audio_in: list[str], codec: list[str], title: str, marks: list[ChapterMark],
                  author: str | None, out_path: Path) -> None:
    """`out_path` (mp4, faststart) from the audio input `audio_in` through `codec`, with the title,
    author and chapter marks from an FFMETADATA file beside it."""
    meta = out_path.with_suffix(".ffmeta")
    meta.write_text(ffmetadata(title, marks, author), encoding="utf-8")
    cmd = [
        ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-y",
        *audio_in, "-f", "ffmetadata", "-i", str(meta),
        "-map", "0:a", "-map_metadata", "1", "-map_chapters", "1",
        *codec, "-movflags", "+faststart", "-f", "mp4", str(out_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FfmpegError(f"ffmpeg failed ({proc.returncode}) writing {out_path.name}: {proc.stderr.strip()[-2000:]}")


class BookEncoder:
    """The book's AAC encoded while it is still being assembled: ffmpeg reads the book's raw PCM from a
    pipe, fed chapter by chapter as each is delivered (`feed`), so that once the last chapter is in only
    its own audio is left to encode and `finish` muxes the AAC with the chapter marks (a stream copy).

    Why: encoding a whole book at the end took 13.6 s for 58 minutes of 24 kHz mono on one core of the
    development machine, after the last segment was stored: most of `voxbatch render`'s wall time on a
    GPU that renders the same book in ~20 s. The AAC stream is what one-shot encoding of the same PCM
    gives (the encoder sees the same samples in the same order; test). The PCM is read from the file the
    assembler appends (`pcm_path`, up to `feed`'s offset, which never goes back: only chapters that
    were delivered whole are fed), by a thread of this object, so a slow encoder holds no one up.
    """

    def __init__(self, ffmpeg: str, pcm_path: Path, sample_rate: int, channels: int, out_dir: Path):
        self.ffmpeg, self.pcm_path = ffmpeg, pcm_path
        self.audio_path = out_dir / "book-audio.m4a"
        inp, enc = _audio_args(sample_rate, channels)
        cmd = [ffmpeg, "-nostdin", "-hide_banner", "-loglevel", "error", "-y", *inp, "-i", "pipe:0",
               "-map", "0:a", *enc, "-f", "mp4", str(self.audio_path)]
        self._log_path = out_dir / "book-encoder.log"
        with open(self._log_path, "wb") as log:  # a file, not a pipe: nothing to drain while it runs
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log)
        self._fed = 0  # bytes of pcm_path handed to ffmpeg
        self._upto: queue.Queue[int | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._pump, name="book-encoder", daemon=True)
        self._thread.start()

    def feed(self, upto: int) -> None:
        """Hand ffmpeg the PCM file's bytes up to offset `upto` (flushed to the file before this call)."""
        self._upto.put(upto)

    def _pump(self) -> None:
        try:
            with open(self.pcm_path, "rb") as f:  # read on from where the last feed stopped
                while (upto := self._upto.get()) is not None:
                    while self._fed < upto:
                        chunk = f.read(min(upto - self._fed, 1 << 22))
                        if not chunk:
                            raise FfmpegError(f"{self.pcm_path.name} ends at {self._fed} bytes, {upto} were fed")
                        self._proc.stdin.write(chunk)
                        self._fed += len(chunk)
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            self._error = e
        finally:
            try:
                self._proc.stdin.close()
            except OSError:
                pass

    def finish(self, title: str, marks: list[ChapterMark], out_path: Path, author: str | None = None) -> None:
        """Wait for the encoder, then write `out_path`: its AAC with the title and chapter marks."""
        self._upto.put(None)
        self._thread.join()
        code = self._proc.wait()
        err = self._log_path.read_text(errors="replace")
        if code != 0 or self._error is not None:
            why = [f"{type(self._error).__name__}: {self._error}"] if self._error is not None else []
            why += [err.strip()[-2000:]] if err.strip() else []
            raise FfmpegError(f"ffmpeg failed ({code}) encoding {out_path.name}: {'; '.join(why)}")
        _write_marked(self.ffmpeg, ["-i", str(self.audio_path)], ["-c", "copy"], title, marks, author, out_path)

    def abort(self) -> None:
        """Stop the encoder (nothing to write: no chapter delivered, or the assembly is given up)."""
        self._upto.put(None)
        self._proc.kill()
        self._thread.join(timeout=5)
        self._proc.wait()
