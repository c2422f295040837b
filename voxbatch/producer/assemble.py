"""Assembly of a finished job: chapter audio, subtitles, the .m4b book and manifest.json.

Called by the `voxbatch.assemble` Celery task once the last segment lands (`assemble_job`), and by
the embedded renderer chapter by chapter as each chapter's segments are all stored, while later
chapters still render (`JobAssembly`). Everything is written under jobs/<id>/ (see voxbatch/keys.py);
the manifest is written last, so its presence means the rest is in place.

Timing is sample-exact. Within a chapter:

    start[0] = lead                        lead  = chapter_lead_ms of silence opening each chapter
    start[i] = start[i-1] + len[i-1] + pause   pause = pause_ms of silence between segments
    chapter length = lead + sum(len) + (n - 1) * pause

with silences rounded to whole samples once, lengths from the decoded segment audio (every format
here decodes to exactly the samples it was given), and seconds in the manifest as samples / rate.
Chapters follow each other in the book with no extra gap (each brings its own lead).

Failures: a chapter with a failed or missing segment (or one that cannot be decoded, or has another
sample rate or channel count than the job) is not assembled: its key is None, it has no subtitles,
it takes no time in the book (start_s is where it would have begun, duration_s 0), its segments are
left out of the manifest's segment list and its failures go into `failed`. The rest of the book is
assembled and the job ends `completed_with_errors`. Chapters without segments also get key None
(and are not errors). Objects from an earlier assembly that this one did not produce (a chapter now
failing, a book now skipped) are deleted, so storage agrees with the manifest.

Memory: one segment's audio at a time. A chapter is streamed into a raw PCM temporary file, then
either encoded in the job's format block by block (no preset) or mastered one file at a time
(producer/mastering.py: the file in memory at 44.1 kHz, <= 120 min), encoded, tagged (mutagen) and
measured again from the decoded file for its QC row; the book is appended to a raw PCM temporary
file for ffmpeg (the mastered audio when a preset is set, at 44.1 kHz mono).
"""

from __future__ import annotations

import re
import logging
import tempfile
import threading
from collections import defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from voxbatch.producer import m4b, qc
from voxbatch.producer.mastering import CEILING_RETRIES, Mastered, Preset, master, preset_for
from voxbatch.producer.subtitles import Cue, samples_to_ms, to_srt, to_vtt
from voxbatch import keys
from voxbatch.audio import AudioDecodeError, clip, content_type, decode, open_writer, probe
from voxbatch.models import (JobSpec, Manifest, ManifestChapter, ManifestItem, ManifestSegment, QcLevels, QcRow,
                             Segment)
from voxbatch.tags import TAGGED_FORMATS, Tags, write_tags
from voxbatch.settings import Settings
from voxbatch.storage import Storage, StorageError

log = logging.getLogger(__name__)

# Segment objects fetched ahead of the one being written: hides S3 round trips (a 10k-segment book
# read one GET at a time spends minutes waiting) while bounding memory to this many encoded segments.
PREFETCH = 8
# The book's .m4b is encoded while chapters are still being added (m4b.BookEncoder): each delivered
# chapter's PCM goes to an ffmpeg that runs beside the assembly, and after the last chapter only its
# own audio is left to encode before the chapter marks are muxed in. False encodes the whole book after
# the last chapter (the benchmark's A/B, bench switch `book_stream`).
BOOK_WHILE_ASSEMBLING = True


class SegmentAudioError(ValueError):
    """A stored segment that cannot go into its chapter (rate or channels differ from the job's)."""


class _ChapterFailed(Exception):
    """A segment found bad while its chapter was being streamed; the chapter is dropped."""

    def __init__(self, segment_id: str, error: str):
        super().__init__(f"segment {segment_id}: {error}")
        self.segment_id = segment_id
        self.error = error


@dataclass
class _Timeline:
    """The job's audio shape, fixed by the caller or by the first segment decoded."""

    sample_rate: int | None
    channels: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)  # items are checked from copy threads

    def check(self, sr: int, channels: int) -> None:
        with self._lock:
            if self.sample_rate is None:
                self.sample_rate = sr
            if self.channels is None:
                self.channels = channels
        if sr != self.sample_rate:
            raise SegmentAudioError(f"sample rate {sr} Hz differs from the job's {self.sample_rate} Hz")
        if channels != self.channels:
            raise SegmentAudioError(f"{channels} channel(s) differ from the job's {self.channels}")

    def samples(self, ms: int) -> int:
        assert self.sample_rate is not None
        return (ms * self.sample_rate + 500) // 1000

    def silence(self, n: int) -> np.ndarray:
        shape = (n,) if self.channels == 1 else (n, self.channels)
        return np.zeros(shape, dtype=np.float32)


@dataclass
class _Placed:
    """One segment as placed in its chapter, in samples."""

    segment: Segment
    key: str
    start: int
    length: int


@dataclass
class _AssembledChapter:
    index: int
    length: int  # samples
    placed: list[_Placed] = field(default_factory=list)


@dataclass(frozen=True)
class _FileCue:
    placed: _Placed
    start_ms: int  # subtitle times, whole milliseconds rounded once
    end_ms: int
    start_s: float  # manifest times
    duration_s: float


@dataclass
class _File:
    """One delivered file of a chapter (a chapter is one file unless a preset caps the length)."""

    key: str
    part: int | None  # None: the chapter's only file, at keys.chapter
    length: int  # samples at the book's rate
    cues: list[_FileCue]  # the segments in this file, timed within it
    qc: QcRow | None = None


class _Pcm:
    """Raw float32 PCM in a temporary file, appended piece by piece (a chapter, or the whole book)."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO = open(path, "wb")

    def mark(self) -> int:
        return self._f.tell()

    def write(self, audio: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(audio, dtype="<f4").tobytes())

    def flush(self) -> None:
        self._f.flush()

    def rewind(self, mark: int) -> None:
        """Drop what a chapter that failed half-way appended."""
        self._f.truncate(mark)
        self._f.seek(mark)

    def close(self) -> None:
        self._f.close()


def _read_pcm(path: Path, channels: int) -> np.ndarray:
    """A raw PCM file as a read-only memory map shaped (T,) or (T, C): nothing loaded until sliced."""
    if path.stat().st_size == 0:
        return np.zeros((0,) if channels == 1 else (0, channels), np.float32)
    m = np.memmap(path, dtype="<f4", mode="r")
    return m if channels == 1 else m.reshape(-1, channels)


def _fetch_ahead(pool: ThreadPoolExecutor, storage: Storage, keys_: list[str]) -> Iterator[tuple[str, Future]]:
    """(key, future of its bytes) in order, with up to PREFETCH GETs in flight."""
    pending: deque[tuple[str, Future]] = deque()
    todo = iter(keys_)
    try:
        for key in todo:
            pending.append((key, pool.submit(storage.get, key)))
            if len(pending) >= PREFETCH:
                break
        while pending:
            key, fut = pending.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(storage.get, nxt)))
            yield key, fut
    finally:
        for _, fut in pending:  # the chapter stopped early: GETs not yet started are not needed
            fut.cancel()


def _segments_by_chapter(spec: JobSpec) -> dict[int, list[Segment]]:
    chapters: dict[int, list[Segment]] = defaultdict(list)
    for seg in spec.segments:
        chapters[seg.chapter].append(seg)
    for segs in chapters.values():
        segs.sort(key=lambda s: s.index)
    return chapters


def _assemble_chapter(
    storage: Storage,
    spec: JobSpec,
    index: int,
    segments: list[Segment],
    timeline: _Timeline,
    settings: Settings,
    pcm: _Pcm,
    pool: ThreadPoolExecutor,
    lead_ms: int,
) -> _AssembledChapter:
    """Stream one chapter's segments into `pcm` (raw float32), placing each at its sample.

    Raises _ChapterFailed naming the first segment that is missing or unusable; the caller drops the
    partial chapter.
    """
    chapter = _AssembledChapter(index=index, length=0)
    seg_keys = [keys.segment(spec.id, s.chapter, s.index, spec.format) for s in segments]
    fetches = _fetch_ahead(pool, storage, seg_keys)
    try:
        for i, (seg, (key, fetched)) in enumerate(zip(segments, fetches)):
            try:
                data = fetched.result()
            except KeyError:
                raise _ChapterFailed(seg.id, f"missing from storage: {storage.describe(key)}") from None
            try:
                audio, sr = decode(data, storage.describe(key))
                timeline.check(sr, 1 if audio.ndim == 1 else audio.shape[1])
            except (AudioDecodeError, SegmentAudioError) as e:
                raise _ChapterFailed(seg.id, str(e)) from e
            audio = clip(audio)  # (T,) or (T, C)
            gap = timeline.silence(timeline.samples(lead_ms if i == 0 else settings.pause_ms))
            pcm.write(gap)
            pcm.write(audio)
            start = chapter.length + len(gap)
            chapter.placed.append(_Placed(seg, key, start, len(audio)))
            chapter.length = start + len(audio)
    finally:
        fetches.close()
    return chapter


def _assemble_and_deliver(storage: Storage, d: _Delivery, index: int, segments: list[Segment], timeline: _Timeline,
                          settings: Settings, pool: ThreadPoolExecutor, title: str, lead_ms: int) -> list[_File]:
    """One chapter (or multi-segment item): segments into raw PCM, then delivered plain or mastered."""
    pcm = _Pcm(d.tmp / f"chapter-{index:04d}.f32")
    try:
        try:
            chapter = _assemble_chapter(storage, d.spec, index, segments, timeline, settings, pcm, pool, lead_ms)
        finally:
            pcm.close()
        if d.preset is None:
            return _deliver_plain(storage, d, chapter, pcm.path, timeline, title)
        return _deliver_mastered(storage, d, chapter, pcm.path, timeline, title, settings)
    finally:
        pcm.path.unlink(missing_ok=True)


def _copy_item(storage: Storage, spec: JobSpec, seg: Segment, item_key: str, timeline: _Timeline) -> _File:
    """A one-segment item is its segment: the object is copied to the item key (server-side on S3, a
    hard link locally; no decode, no re-encode), after the checks a chapter's segments get."""
    key = keys.segment(spec.id, seg.chapter, seg.index, spec.format)
    try:
        info = probe(storage.get(key), storage.describe(key))
        timeline.check(info.sample_rate, info.channels)
        storage.copy(key, item_key)
    except KeyError:
        raise _ChapterFailed(seg.id, f"missing from storage: {storage.describe(key)}") from None
    except (AudioDecodeError, SegmentAudioError) as e:
        raise _ChapterFailed(seg.id, str(e)) from e
    return _File(item_key, None, info.frames, _file_cues([_Placed(seg, key, 0, info.frames)], info.sample_rate))


def _cues(f: _File) -> list[Cue]:
    return [Cue(c.start_ms, c.end_ms, c.placed.segment.text) for c in f.cues]


def _file_cues(placed: list[_Placed], sample_rate: int, first: int = 0, shift_ms: int = 0) -> list[_FileCue]:
    """Cues of segments placed from sample `first` of the chapter on, in a file that starts there and
    has `shift_ms` of room tone put in front (< 0: cut from its silent head)."""
    cues = []
    for p in placed:
        start_ms = max(0, samples_to_ms(p.start - first, sample_rate) + shift_ms)  # a cut head: never < 0
        end_ms = max(start_ms, samples_to_ms(p.start - first + p.length, sample_rate) + shift_ms)
        start_s = max(0.0, (p.start - first) / sample_rate + shift_ms / 1000)
        cues.append(_FileCue(p, start_ms, end_ms, start_s, p.length / sample_rate))
    return cues


@dataclass
class _Delivery:
    """What every chapter file of a job shares: format, preset, tags, the book being appended to."""

    spec: JobSpec
    preset: Preset | None
    fmt: str
    title: str
    chapters_total: int
    cover: tuple[bytes, str] | None
    book: _Pcm | None
    tmp: Path

    def tags(self, title: str, track: int) -> Tags:
        cover, mime = self.cover or (None, None)
        return Tags(title=title, album=self.title, author=self.spec.author, track=track,
                    track_total=self.chapters_total, cover=cover, cover_mime=mime)


def _deliver_plain(storage: Storage, d: _Delivery, chapter: _AssembledChapter, pcm_path: Path,
                   timeline: _Timeline, title: str) -> list[_File]:
    """No preset: the chapter as assembled, in the job's format, streamed block by block."""
    sr = timeline.sample_rate
    audio = _read_pcm(pcm_path, timeline.channels)
    out_path = d.tmp / f"chapter-{chapter.index:04d}.{d.fmt}"
    block = sr * 60
    with open_writer(out_path, sr, timeline.channels, d.fmt) as writer:
        for i in range(0, len(audio), block):
            piece = np.asarray(audio[i:i + block])
            writer.write(piece)
            if d.book is not None:
                d.book.write(piece)
    del audio
    write_tags(out_path, d.fmt, d.tags(title, chapter.index + 1))
    items = d.spec.kind == "items"
    key = keys.item(d.spec.id, title, d.fmt) if items else keys.chapter(d.spec.id, chapter.index, d.fmt)
    storage.put_file(key, out_path, content_type(d.fmt))
    out_path.unlink()
    return [_File(key, None, chapter.length, _file_cues(chapter.placed, sr))]


def _split_points(chapter: _AssembledChapter, sample_rate: int, max_s: float, pads_s: float) -> list[int]:
    """Sample positions where each file of the chapter starts: at segment ends, so no file (with its
    room tone) runs over `max_s` unless one segment alone does."""
    starts = [0]
    for prev, nxt in zip(chapter.placed, chapter.placed[1:]):
        end = nxt.start + nxt.length  # this file, if it took `nxt` too
        if (end - starts[-1]) / sample_rate + pads_s > max_s:
            starts.append(prev.start + prev.length)
    return starts


def _master_file(audio: np.ndarray, sr: int, d: _Delivery, out_path: Path, seed: int, tags: Tags,
                 max_file_s: float) -> tuple[Mastered, QcLevels, dict[str, bool]]:
    """Master, encode, tag and measure one file; lower the ceiling and redo when encoding pushed peaks over."""
    preset = d.preset
    offset = 0.0
    for attempt in range(CEILING_RETRIES + 1):
        mastered = master(audio, sr, preset, ceiling_offset_db=offset, seed=seed)
        with open_writer(out_path, preset.sample_rate, 1, preset.fmt, kbps=preset.kbps) as w:
            w.write(mastered.audio)
        decoded, got_sr = decode(out_path.read_bytes(), out_path.name)
        levels = qc.measure(decoded, got_sr)
        facts = {"format": preset.fmt, "kbps": preset.kbps, "sample_rate": got_sr,
                 "channels": 1 if decoded.ndim == 1 else decoded.shape[1], "max_file_s": max_file_s}
        checks = qc.check(preset.name, levels, facts)
        over = max(levels.peak_dbfs - qc.PEAK_LIMIT_DB.get(preset.name, 0.0),
                   levels.true_peak_dbtp - qc.TRUE_PEAK_LIMIT_DB.get(preset.name, 0.0))
        if all(checks.values()) or over <= 0 or attempt == CEILING_RETRIES:
            break
        offset += over + 0.3
    write_tags(out_path, preset.fmt, tags)
    return mastered, levels, checks


def _deliver_mastered(storage: Storage, d: _Delivery, chapter: _AssembledChapter, pcm_path: Path,
                      timeline: _Timeline, title: str, settings: Settings) -> list[_File]:
    """A preset: split at segment boundaries where needed, master each file, encode, tag, QC."""
    preset = d.preset
    sr = timeline.sample_rate
    audio = _read_pcm(pcm_path, timeline.channels)
    pads = (preset.head_s or 0.0) + (preset.tail_s or 0.0)
    starts = _split_points(chapter, sr, settings.master_max_file_s, pads)
    bounds = list(zip(starts, starts[1:] + [chapter.length]))
    files: list[_File] = []
    for k, (lo, hi) in enumerate(bounds, start=1):
        part = None if len(bounds) == 1 else k
        key = (keys.chapter(d.spec.id, chapter.index, preset.fmt) if part is None
               else keys.chapter_part(d.spec.id, chapter.index, part, preset.fmt))
        out_path = d.tmp / f"chapter-{chapter.index:04d}-{k}.{preset.fmt}"
        piece = np.asarray(audio[lo:hi])
        file_title = title if part is None else f"{title} ({part}/{len(bounds)})"
        mastered, levels, checks = _master_file(piece, sr, d, out_path, seed=chapter.index * 1000 + k,
                                                tags=d.tags(file_title, chapter.index + 1),
                                                max_file_s=settings.master_max_file_s)
        if d.book is not None:
            d.book.write(mastered.audio)
        source = qc.measure(piece, sr)
        storage.put_file(key, out_path, content_type(preset.fmt))
        out_path.unlink()
        cues = _file_cues([p for p in chapter.placed if lo <= p.start < hi], sr, lo,
                          round(mastered.head_pad_s * 1000))
        row = QcRow(chapter=chapter.index, part=k, key=key, format=preset.fmt, sample_rate=preset.sample_rate,
                    channels=1, kbps=preset.kbps, levels=levels, source_levels=source, gain_db=mastered.gain_db,
                    checks=checks, passed=all(checks.values()))
        if not row.passed:
            log.warning("job %s: %s fails %s: %s", d.spec.id, key, preset.name,
                        ", ".join(n for n, ok in checks.items() if not ok))
        files.append(_File(key, part, len(mastered.audio), cues, row))
    return files


def _write_book(
    storage: Storage,
    d: _Delivery,
    ffmpeg: str,
    book_rate: int,
    book_channels: int,
    assembled: dict[int, int],
    book_start: dict[int, int],
    encoder: m4b.BookEncoder | None = None,
) -> str:
    """Encode the book's PCM into an .m4b with one marker per assembled chapter (through `encoder`
    where it has been encoding the PCM as chapters came); return its key."""
    spec = d.spec
    marks = [
        m4b.ChapterMark(
            spec.chapters[index],
            samples_to_ms(book_start[index], book_rate),
            samples_to_ms(book_start[index] + length, book_rate),
        )
        for index, length in assembled.items()
    ]
    out = d.tmp / "book.m4b"
    if encoder is not None:
        encoder.finish(d.title, marks, out, author=spec.author)
    else:
        m4b.encode_m4b(ffmpeg, d.book.path, book_rate, book_channels, d.title, marks, out, author=spec.author)
    cover, mime = d.cover or (None, None)
    write_tags(out, "m4b", Tags(title=d.title, album=d.title, author=spec.author, cover=cover, cover_mime=mime))
    storage.put_file(keys.book(spec.id), out, content_type("m4b"))
    return keys.book(spec.id)


MAX_COVER_BYTES = 10 * 1024 * 1024


def _load_cover(storage: Storage, spec: JobSpec) -> tuple[bytes, str] | None:
    """The job's cover image (stored at submit from the EPUB), if any and of a sane size."""
    if not spec.cover_key:
        return None
    try:
        data = storage.get(spec.cover_key)
    except KeyError:
        log.warning("job %s: cover %s missing; files go out without it", spec.id, spec.cover_key)
        return None
    if len(data) > MAX_COVER_BYTES:
        return None
    mime = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "image/jpeg"
    return data, mime


def _delete_except(storage: Storage, listing: list[str], prefix: str, keep: set[str]) -> None:
    """Remove objects whose key starts with `prefix` (from `listing`) that this assembly did not produce."""
    for key in listing:
        if key.startswith(prefix) and key not in keep:
            storage.delete(key)


class JobAssembly:
    """One job's assembly: chapter by chapter in reading order, then the book and the manifest.

    `add(index, failed)` assembles chapter `index` (always the next one) once each of its segments is
    finished, stored or failed for good (`failed`: the job's failures so far); `finish(failed, reused)`
    writes the book and the manifest once every chapter is in. `assemble_job` adds them all at once
    (the assembler task, after the last segment); `voxbatch render` adds each chapter while later ones
    still render (voxbatch/embedded.py), so little is left to do once the last segment is stored.
    Chapters go in order because each is appended to the book's PCM as it is delivered. Used as a
    context manager: leaving it removes the temporary folder, whether or not `finish` ran.
    """

    def __init__(self, storage: Storage, spec: JobSpec, sample_rate: int | None, settings: Settings):
        self.storage, self.spec, self.settings = storage, spec, settings
        self.items = spec.kind == "items"
        self.preset = None if self.items else preset_for(spec.preset, spec.format)  # line items go as rendered
        self.by_chapter = _segments_by_chapter(spec)
        self.timeline = _Timeline(sample_rate)
        self.ffmpeg = None if self.items else m4b.find_ffmpeg()
        if self.ffmpeg is None and not self.items:
            log.info("job %s: ffmpeg not on PATH, skipping the .m4b book", spec.id)
        # Listed before this assembly writes anything: what is here and not produced again goes.
        self.earlier = storage.list(keys.job_prefix(spec.id) + "chapters/") + storage.list(
            keys.job_prefix(spec.id) + "subtitles/")
        self.failed: dict[str, str] = {}  # found here: missing from storage, or unusable in its chapter
        self.delivered: dict[int, list[_File]] = {}
        self.book_start: dict[int, int] = {}  # chapter index -> first sample in the book (book rate)
        self.book_length = 0
        self._next = 0  # the chapter `add` takes next
        self._copies: dict[int, Future] = {}  # one-segment items being copied, delivered by `finish`
        self._tmp = tempfile.TemporaryDirectory(prefix=f"voxbatch-assemble-{spec.id}-")
        tmp = Path(self._tmp.name)
        self.d = _Delivery(spec=spec, preset=self.preset, fmt=self.preset.fmt if self.preset else spec.format,
                           title=spec.title or spec.name, chapters_total=len(spec.chapters),
                           cover=_load_cover(storage, spec), book=_Pcm(tmp / "book.f32") if self.ffmpeg else None,
                           tmp=tmp)
        self._encoder: m4b.BookEncoder | None = None  # the book's AAC, encoded as chapters are delivered
        self._encoder_failed = False
        self._pool = ThreadPoolExecutor(PREFETCH, thread_name_prefix="assemble-get")
        self._copier = ThreadPoolExecutor(PREFETCH, thread_name_prefix="assemble-copy")

    def __enter__(self) -> "JobAssembly":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._encoder is not None:  # finish() did not take it: the book is not written
            self._encoder.abort()
            self._encoder = None
        self._pool.shutdown(cancel_futures=True)
        self._copier.shutdown(cancel_futures=True)
        if self.d.book:
            self.d.book.close()
        self._tmp.cleanup()

    @property
    def chapters_added(self) -> int:
        return self._next

    def add(self, index: int, failed: dict[str, str]) -> None:
        """Assemble chapter `index`, whose segments are all finished; `failed` maps the job's failed
        segment ids to their errors (a chapter with one of them, or with one missing, is not assembled)."""
        if index != self._next:
            raise ValueError(f"job {self.spec.id}: chapter {index} added before chapter {self._next}")
        self._next += 1
        spec, storage, fmt = self.spec, self.storage, self.spec.format
        title = spec.chapters[index]
        self.book_start[index] = self.book_length
        segments = self.by_chapter.get(index, [])
        stored = set(storage.list(keys.chapter_segments_prefix(spec.id, index))) if segments else set()
        for seg in segments:
            key = keys.segment(spec.id, seg.chapter, seg.index, fmt)
            if seg.id not in failed and key not in stored:
                self.failed[seg.id] = f"missing from storage: {storage.describe(key)}"
        if not segments or any(s.id in failed or s.id in self.failed for s in segments):
            self._deliver(index, [])
            return
        if self.items and fmt not in TAGGED_FORMATS and len(segments) == 1:
            self._copies[index] = self._copier.submit(_copy_item, storage, spec, segments[0],
                                                      keys.item(spec.id, title, fmt), self.timeline)
            return
        book = self.d.book
        mark = book.mark() if book else 0
        try:
            files = _assemble_and_deliver(storage, self.d, index, segments, self.timeline, self.settings, self._pool,
                                          title, 0 if self.items else self.settings.chapter_lead_ms)
        except _ChapterFailed as e:
            self._chapter_failed(index, e)
            files = []
            if book:
                book.rewind(mark)
        self._deliver(index, files)
        if files:
            self._encode_book()

    def _book_format(self) -> tuple[int, int]:
        """The book's sample rate and channels: the preset's (mono), else the segments'."""
        sr = self.timeline.sample_rate or 0
        return (self.preset.sample_rate, 1) if self.preset else (sr, self.timeline.channels or 1)

    def _encode_book(self) -> None:
        """BOOK_WHILE_ASSEMBLING: hand the book's PCM so far (whole delivered chapters) to its encoder."""
        book = self.d.book
        if not BOOK_WHILE_ASSEMBLING or book is None or self.ffmpeg is None or self._encoder_failed:
            return
        book.flush()
        if self._encoder is None:
            rate, channels = self._book_format()
            try:
                self._encoder = m4b.BookEncoder(self.ffmpeg, book.path, rate, channels, self.d.tmp)
            except OSError as e:  # ffmpeg gone since it was found: the book is encoded at the end, as before
                log.warning("job %s: the book's encoder did not start (%s); encoding it after the last chapter",
                            self.spec.id, e)
                self._encoder_failed = True
                return
        self._encoder.feed(book.mark())

    def _chapter_failed(self, index: int, e: _ChapterFailed) -> None:
        self.failed[e.segment_id] = e.error
        log.warning("job %s: chapter %d not assembled: %s", self.spec.id, index, e)

    def _deliver(self, index: int, files: list[_File]) -> None:
        """Record a chapter's files, write its subtitles, remove what an earlier assembly left for it."""
        spec, storage = self.spec, self.storage
        if files:
            self.delivered[index] = files
        if self.items:
            if not files:  # not assembled: remove what an earlier assembly may have left
                storage.delete(keys.item(spec.id, spec.chapters[index], spec.format))
            return
        produced: set[str] = set()
        for f in files:
            produced.add(f.key)
            cues = _cues(f)
            for ext, text in (("srt", to_srt(cues)), ("vtt", to_vtt(cues))):
                sub_key = keys.subtitles(spec.id, index, ext, f.part)
                storage.put(sub_key, text.encode(), content_type(ext))
                produced.add(sub_key)
            self.book_length += f.length
        _delete_except(storage, self.earlier, keys.chapter_files_prefix(spec.id, index), produced)
        _delete_except(storage, self.earlier, keys.subtitles_prefix(spec.id, index), produced)

    def finish(self, failed: dict[str, str], reused: set[str] | frozenset[str] = frozenset()) -> Manifest:
        """The book and manifest.json, once every chapter is added; `failed` is the job's final failures."""
        spec, storage, d, preset, items = self.spec, self.storage, self.d, self.preset, self.items
        if self._next != len(spec.chapters):
            raise ValueError(f"job {spec.id}: {len(spec.chapters) - self._next} chapters not added")
        for index, copy in sorted(self._copies.items()):
            try:
                files = [copy.result()]
            except _ChapterFailed as e:
                self._chapter_failed(index, e)
                files = []
            self._deliver(index, files)
        self._copies.clear()
        failed = {**failed, **self.failed}
        stray = [s for s in spec.segments if s.chapter >= len(spec.chapters) and s.id not in failed]
        if stray:  # segments of no chapter are never assembled; stored or not, say which are missing
            stored = set(storage.list(keys.segments_prefix(spec.id)))
            for seg in stray:
                key = keys.segment(spec.id, seg.chapter, seg.index, spec.format)
                if key not in stored:
                    failed[seg.id] = f"missing from storage: {storage.describe(key)}"
        if d.book:
            d.book.close()
        delivered, book_start = self.delivered, self.book_start
        sr = self.timeline.sample_rate or 0
        book_rate, book_channels = self._book_format()
        book_key = None
        if d.book and delivered:
            lengths = {i: sum(f.length for f in files) for i, files in delivered.items()}
            encoder, self._encoder = self._encoder, None
            book_key = _write_book(storage, d, self.ffmpeg, book_rate, book_channels, lengths, book_start, encoder)
        elif not items:
            storage.delete(keys.book(spec.id))

        manifest = Manifest(
            job_id=spec.id,
            name=spec.name,
            state="completed_with_errors" if failed else "completed",
            sample_rate=sr,
            format=spec.format,
            chapters=[] if items else [
                ManifestChapter(
                    index=index,
                    title=title,
                    key=delivered[index][0].key if index in delivered else None,
                    start_s=book_start[index] / book_rate if book_rate else 0.0,
                    duration_s=sum(f.length for f in delivered.get(index, [])) / book_rate if book_rate else 0.0,
                    files=[f.key for f in delivered.get(index, [])],
                )
                for index, title in enumerate(spec.chapters)
            ],
            segments=[
                ManifestSegment(
                    id=c.placed.segment.id,
                    chapter=c.placed.segment.chapter,
                    text=c.placed.segment.text,
                    key=c.placed.key,
                    start_s=c.start_s,
                    duration_s=c.duration_s,
                    voice=spec.voice_of(c.placed.segment),
                    reused=c.placed.segment.id in reused,
                    chapter_file=None if items else f.key,
                )
                for index in sorted(delivered)
                for f in delivered[index]
                for c in f.cues
            ],
            failed=dict(sorted(failed.items())),
            book_key=book_key,
            items=_manifest_items(spec, self.by_chapter, delivered, failed, sr) if items else [],
            reused=len(reused & {s.id for s in spec.segments}),
            preset=spec.preset if preset else "none",
            chapter_format=d.fmt,
            title=d.title,
            author=spec.author,
            qc=[f.qc for index in sorted(delivered) for f in delivered[index] if f.qc is not None],
        )
        storage.put(keys.manifest(spec.id), manifest.model_dump_json(indent=2).encode(), content_type("json"))
        return manifest


def assemble_job(
    storage: Storage,
    spec: JobSpec,
    failed: dict[str, str],
    sample_rate: int | None,
    settings: Settings,
    reused: set[str] | frozenset[str] = frozenset(),
) -> Manifest:
    """Assemble every chapter whose segments all rendered, then the book and the manifest.

    A line-item batch (`spec.kind == "items"`) is assembled the same way with each item as a chapter
    written to `keys.item` (no lead silence, no subtitles, no book), listed in `manifest.items`.
    `reused` holds the ids of segments whose audio came from the content cache (manifest `reused`).

    `failed` maps segment id -> last error (from the job state); segments neither failed nor in
    storage are added to it as missing. `sample_rate` is the engine's output rate when known;
    with None the first segment decoded sets it (0 in the manifest when no segment could be read).
    A preset (spec.preset) masters each chapter file and adds a QC row per file to the manifest.
    """
    with JobAssembly(storage, spec, sample_rate, settings) as assembly:
        for index in range(len(spec.chapters)):
            assembly.add(index, failed)
        return assembly.finish(failed, reused)


def _manifest_items(spec: JobSpec, by_chapter: dict[int, list[Segment]], delivered: dict[int, list[_File]],
                    failed: dict[str, str], sr: int) -> list[ManifestItem]:
    """Every item id of a line-item batch -> its file, duration and status (the first error if failed)."""
    out = []
    for index, item_id in enumerate(spec.chapters):
        if index in delivered:
            out.append(ManifestItem(id=item_id, key=delivered[index][0].key,
                                    duration_s=delivered[index][0].length / sr, status="done"))
        else:
            error = next((failed[s.id] for s in by_chapter.get(index, []) if s.id in failed), "not assembled")
            out.append(ManifestItem(id=item_id, key=None, duration_s=0.0, status="failed", error=error))
    return out


# A fetched key becomes a path below --out: printable, no backslash, so it cannot steer the terminal
# or the path (S3 allows any bytes in a key, "../" and escape sequences included).
_SAFE_NAME = re.compile(r"[^\x00-\x1f\x7f-\x9f\\]+")


def fetch_job(storage: Storage, job_id: str, out_dir: str | Path) -> tuple[int, list[str]]:
    """Download every object under jobs/<id>/ into `out_dir`, keeping the layout below the job.

    `out_dir/manifest.json`, `out_dir/chapters/0000.wav`, ... Each file appears whole or not at
    all (written beside its final name, then renamed). A key that cannot be a file there (it would
    land outside `out_dir`, or collides with a folder) or that vanished is skipped, and the rest
    fetched. Returns (files written, one line per key skipped).
    """
    out = Path(out_dir).resolve()
    prefix = keys.job_prefix(job_id)
    count, skipped = 0, []
    for key in storage.list(prefix):
        rest = key[len(prefix):]
        if not _SAFE_NAME.fullmatch(rest) or any(part in ("", ".", "..") for part in rest.split("/")):
            skipped.append(f"skipped {ascii(storage.describe(key))}: not a safe file name")
            continue
        target = (out / rest).resolve()
        if out not in target.parents:
            skipped.append(f"skipped {storage.describe(key)}: it would land outside {out}")
            continue
        try:
            storage.get_file(key, target)
        except KeyError:
            skipped.append(f"skipped {storage.describe(key)}: gone before it was fetched")
            continue
        except StorageError as e:  # a local store's symlink leading out of its root
            skipped.append(f"skipped {storage.describe(key)}: {e}")
            continue
        except OSError as e:  # a key that is also a folder ("a" and "a/b"), a name the OS refuses
            skipped.append(f"skipped {storage.describe(key)}: cannot write {target} ({e.strerror or e})")
            continue
        count += 1
    return count, skipped
