"""Assembly of a finished job: chapter audio, subtitles, the .m4b book and manifest.json.

Called by the `voxbatch.assemble` Celery task once the last segment lands, and by the embedded
renderer. Everything is written under jobs/<id>/ (see voxbatch/keys.py); the manifest is written
last, so its presence means the rest is in place.

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

Memory: one segment's audio at a time. A chapter is streamed into a temporary file in the job's
format and uploaded whole; the book is appended to a raw PCM temporary file for ffmpeg.
"""

from __future__ import annotations

import logging
import tempfile
from collections import defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from voxbatch.producer import m4b
from voxbatch.producer.subtitles import Cue, samples_to_ms, to_srt, to_vtt
from voxbatch import keys
from voxbatch.audio import AudioDecodeError, clip, content_type, decode, open_writer
from voxbatch.models import JobSpec, Manifest, ManifestChapter, ManifestSegment, Segment
from voxbatch.settings import Settings
from voxbatch.storage import Storage, StorageError

log = logging.getLogger(__name__)

# Segment objects fetched ahead of the one being written: hides S3 round trips (a 10k-segment book
# read one GET at a time spends minutes waiting) while bounding memory to this many encoded segments.
PREFETCH = 8


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

    def check(self, sr: int, channels: int) -> None:
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


class _BookPcm:
    """The book's audio as raw float32 PCM in a temporary file, appended chapter by chapter."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO = open(path, "wb")

    def mark(self) -> int:
        return self._f.tell()

    def write(self, audio: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(audio, dtype="<f4").tobytes())

    def rewind(self, mark: int) -> None:
        """Drop what a chapter that failed half-way appended."""
        self._f.truncate(mark)
        self._f.seek(mark)

    def close(self) -> None:
        self._f.close()


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
    out_path: Path,
    book: _BookPcm | None,
    pool: ThreadPoolExecutor,
) -> _AssembledChapter:
    """Stream one chapter's segments into `out_path` (and the book), placing each at its sample.

    Raises _ChapterFailed naming the first segment that is missing or unusable; the caller drops the
    partial chapter.
    """
    chapter = _AssembledChapter(index=index, length=0)
    writer = None
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
            if writer is None:
                writer = open_writer(out_path, timeline.sample_rate, timeline.channels, spec.format)
            gap = timeline.silence(timeline.samples(settings.chapter_lead_ms if i == 0 else settings.pause_ms))
            for piece in (gap, audio):
                writer.write(piece)
                if book is not None:
                    book.write(piece)
            start = chapter.length + len(gap)
            chapter.placed.append(_Placed(seg, key, start, len(audio)))
            chapter.length = start + len(audio)
    finally:
        fetches.close()
        if writer is not None:
            writer.close()
    return chapter


def _cues(chapter: _AssembledChapter, sample_rate: int) -> list[Cue]:
    return [
        Cue(samples_to_ms(p.start, sample_rate), samples_to_ms(p.start + p.length, sample_rate), p.segment.text)
        for p in chapter.placed
    ]


def _write_book(
    storage: Storage,
    spec: JobSpec,
    ffmpeg: str,
    book: _BookPcm,
    timeline: _Timeline,
    assembled: dict[int, _AssembledChapter],
    book_start: dict[int, int],
    tmp: Path,
) -> str:
    """Encode the book's PCM into an .m4b with one marker per assembled chapter; return its key."""
    sr = timeline.sample_rate
    marks = [
        m4b.ChapterMark(
            spec.chapters[index],
            samples_to_ms(book_start[index], sr),
            samples_to_ms(book_start[index] + chapter.length, sr),
        )
        for index, chapter in assembled.items()
    ]
    out = tmp / "book.m4b"
    m4b.encode_m4b(ffmpeg, book.path, sr, timeline.channels, spec.name, marks, out)
    storage.put_file(keys.book(spec.id), out, content_type("m4b"))
    return keys.book(spec.id)


def assemble_job(
    storage: Storage,
    spec: JobSpec,
    failed: dict[str, str],
    sample_rate: int | None,
    settings: Settings,
) -> Manifest:
    """Assemble every chapter whose segments all rendered, then the book and the manifest.

    `failed` maps segment id -> last error (from the job state); segments neither failed nor in
    storage are added to it as missing. `sample_rate` is the engine's output rate when known;
    with None the first segment decoded sets it (0 in the manifest when no segment could be read).
    """
    failed = dict(failed)
    fmt = spec.format
    by_chapter = _segments_by_chapter(spec)
    stored = set(storage.list(keys.job_prefix(spec.id) + "segments/"))
    for seg in spec.segments:
        key = keys.segment(spec.id, seg.chapter, seg.index, fmt)
        if seg.id not in failed and key not in stored:
            failed[seg.id] = f"missing from storage: {storage.describe(key)}"

    timeline = _Timeline(sample_rate)
    ffmpeg = m4b.find_ffmpeg()
    if ffmpeg is None:
        log.info("job %s: ffmpeg not on PATH, skipping the .m4b book", spec.id)
    assembled: dict[int, _AssembledChapter] = {}
    book_start: dict[int, int] = {}  # chapter index -> first sample in the book
    book_length = 0

    with tempfile.TemporaryDirectory(prefix=f"voxbatch-assemble-{spec.id}-") as tmp_dir:
        tmp = Path(tmp_dir)
        book = _BookPcm(tmp / "book.f32") if ffmpeg else None
        pool = ThreadPoolExecutor(PREFETCH, thread_name_prefix="assemble-get")
        try:
            for index, title in enumerate(spec.chapters):
                book_start[index] = book_length
                segments = by_chapter.get(index, [])
                chapter_key = keys.chapter(spec.id, index, fmt)
                if segments and not any(s.id in failed for s in segments):
                    out_path = tmp / f"chapter-{index:04d}.{fmt}"
                    mark = book.mark() if book else 0
                    try:
                        chapter = _assemble_chapter(
                            storage, spec, index, segments, timeline, settings, out_path, book, pool
                        )
                    except _ChapterFailed as e:
                        failed[e.segment_id] = e.error
                        log.warning("job %s: chapter %d not assembled: %s", spec.id, index, e)
                        if book:
                            book.rewind(mark)
                    else:
                        storage.put_file(chapter_key, out_path, content_type(fmt))
                        sr = timeline.sample_rate
                        cues = _cues(chapter, sr)
                        for ext, text in (("srt", to_srt(cues)), ("vtt", to_vtt(cues))):
                            storage.put(keys.subtitles(spec.id, index, ext), text.encode(), content_type(ext))
                        assembled[index] = chapter
                        book_length += chapter.length
                        out_path.unlink()
                        continue
                # Not assembled: remove what an earlier assembly of this job may have left.
                for key in (chapter_key, keys.subtitles(spec.id, index, "srt"), keys.subtitles(spec.id, index, "vtt")):
                    storage.delete(key)  # both backends accept a missing key
        finally:
            pool.shutdown(cancel_futures=True)
            if book:
                book.close()

        sr = timeline.sample_rate or 0
        book_key = None
        if book and assembled:
            book_key = _write_book(storage, spec, ffmpeg, book, timeline, assembled, book_start, tmp)
        else:
            storage.delete(keys.book(spec.id))

    manifest = Manifest(
        job_id=spec.id,
        name=spec.name,
        state="completed_with_errors" if failed else "completed",
        sample_rate=sr,
        format=fmt,
        chapters=[
            ManifestChapter(
                index=index,
                title=title,
                key=keys.chapter(spec.id, index, fmt) if index in assembled else None,
                start_s=book_start[index] / sr if sr else 0.0,
                duration_s=assembled[index].length / sr if index in assembled else 0.0,
            )
            for index, title in enumerate(spec.chapters)
        ],
        segments=[
            ManifestSegment(
                id=p.segment.id,
                chapter=p.segment.chapter,
                text=p.segment.text,
                key=p.key,
                start_s=p.start / sr,
                duration_s=p.length / sr,
            )
            for index in sorted(assembled)
            for p in assembled[index].placed
        ],
        failed=dict(sorted(failed.items())),
        book_key=book_key,
    )
    storage.put(keys.manifest(spec.id), manifest.model_dump_json(indent=2).encode(), content_type("json"))
    return manifest


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
        target = (out / key[len(prefix):]).resolve()
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
