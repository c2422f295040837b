"""Assembly of chapters, subtitles, manifest and the .m4b book, on a real local storage folder.

Segment audio is synthetic: sine tones of known lengths, each at its own frequency, stored with
`voxbatch.audio.encode` exactly as the worker's upload threads store them. Timing is checked to the
sample; subtitles to the millisecond (their resolution); lossless chapter audio sample by sample.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest

from voxbatch.producer import assemble as asm
from voxbatch.producer.subtitles import LINE_WIDTH, display_width, samples_to_ms, srt_time, vtt_time, wrap
from voxbatch import audio, keys
from voxbatch.models import JobSpec, Segment
from voxbatch.settings import Settings
from voxbatch.storage import LocalStorage

SR = 24000
PAUSE_MS = 250
LEAD_MS = 500
PAUSE = PAUSE_MS * SR // 1000  # 6000 samples
LEAD = LEAD_MS * SR // 1000  # 12000 samples

# Segment lengths in samples, per chapter: odd lengths so no boundary lands on a round number.
LENGTHS = [[4801, 3333, 7001], [2999], [5003, 1234]]
TEXTS = {
    (0, 1): "A sentence long enough that a subtitle line has to wrap it once, maybe twice, before it ends.",
    (2, 0): "Fish & chips <b>bold</b> --> arrows",
}


def tone(n: int, freq: float, sr: int = SR) -> np.ndarray:
    return (0.4 * np.sin(2 * np.pi * freq * np.arange(n) / sr)).astype(np.float32)


def seg_freq(ch: int, i: int) -> float:
    return 220.0 + 110.0 * (3 * ch + i)


@pytest.fixture
def storage(tmp_path):
    return LocalStorage(tmp_path / "store")


@pytest.fixture
def settings():
    return Settings(pause_ms=PAUSE_MS, chapter_lead_ms=LEAD_MS, storage_url="file:///unused")


def make_job(storage, fmt="wav", lengths=LENGTHS, skip=(), job_id="job1", sr=SR) -> JobSpec:
    """Store one tone per segment (except ids in `skip`) and return the job's spec."""
    segments = []
    for ch, chapter in enumerate(lengths):
        for i, n in enumerate(chapter):
            seg = Segment(chapter=ch, index=i, text=TEXTS.get((ch, i), f"Chapter {ch}, segment {i}."))
            segments.append(seg)
            if seg.id not in skip:
                storage.put(keys.segment(job_id, ch, i, fmt), audio.encode(tone(n, seg_freq(ch, i), sr), sr, fmt))
    return JobSpec(
        id=job_id,
        name="Test Book; = #1",
        voice="v",
        format=fmt,
        chapters=[f"Chapter {c}" for c in range(len(lengths))],
        segments=segments,
        created_at=0.0,
        source="book.txt",
    )


def expected_starts(lengths: list[int]) -> list[int]:
    starts, pos = [], LEAD
    for n in lengths:
        starts.append(pos)
        pos += n + PAUSE
    return starts


def chapter_length(lengths: list[int]) -> int:
    return LEAD + sum(lengths) + PAUSE * (len(lengths) - 1)


# --- sample-exact chapters and manifest -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_lossless_chapters_are_the_segments_placed_to_the_sample(storage, settings, fmt):
    spec = make_job(storage, fmt)
    manifest = asm.assemble_job(storage, spec, {}, SR, settings)

    assert manifest.state == "completed" and manifest.failed == {}
    assert manifest.sample_rate == SR and manifest.format == fmt
    for ch, lengths in enumerate(LENGTHS):
        got, sr = audio.decode(storage.get(keys.chapter(spec.id, ch, fmt)))
        assert sr == SR
        assert len(got) == chapter_length(lengths)
        # Rebuild the chapter from the stored segments: identical, sample for sample (both PCM_16).
        want = np.zeros(chapter_length(lengths), np.float32)
        for i, (start, n) in enumerate(zip(expected_starts(lengths), lengths)):
            seg, _ = audio.decode(storage.get(keys.segment(spec.id, ch, i, fmt)))
            want[start : start + n] = seg
        np.testing.assert_array_equal(got, want)


def test_manifest_times_are_exact_to_the_sample(storage, settings):
    spec = make_job(storage)
    manifest = asm.assemble_job(storage, spec, {}, None, settings)  # rate taken from the segments

    assert manifest.sample_rate == SR
    assert [s.id for s in manifest.segments] == [s.id for s in spec.segments]
    by_chapter = {}
    for s in manifest.segments:
        by_chapter.setdefault(s.chapter, []).append(s)
    for ch, lengths in enumerate(LENGTHS):
        segs = by_chapter[ch]
        assert [round(s.start_s * SR) for s in segs] == expected_starts(lengths)
        assert [round(s.duration_s * SR) for s in segs] == lengths
        assert [s.key for s in segs] == [keys.segment(spec.id, ch, i, "wav") for i in range(len(lengths))]
        assert all(abs(s.start_s * SR - round(s.start_s * SR)) < 1e-6 for s in segs)

    book_pos = 0
    for ch, lengths in enumerate(LENGTHS):
        c = manifest.chapters[ch]
        assert c.title == f"Chapter {ch}" and c.key == keys.chapter(spec.id, ch, "wav")
        assert round(c.start_s * SR) == book_pos
        assert round(c.duration_s * SR) == chapter_length(lengths)
        book_pos += chapter_length(lengths)

    stored = json.loads(storage.get(keys.manifest(spec.id)))
    assert stored == json.loads(manifest.model_dump_json())


# --- subtitles --------------------------------------------------------------------------------

CUE_TIME = r"(\d{2,}):(\d{2}):(\d{2})[,.](\d{3})"


def parse_cues(text: str, sep: str) -> list[tuple[int, int, list[str]]]:
    cues = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines[0] == "WEBVTT":
            continue
        if sep == ",":
            assert lines[0].isdigit(), f"SRT cue without its number: {block!r}"
            lines = lines[1:]
        m = re.fullmatch(f"{CUE_TIME} --> {CUE_TIME}", lines[0])
        assert m, f"bad timing line {lines[0]!r}"
        assert sep in lines[0] and ({",", "."} - {sep}).pop() not in lines[0]
        g = [int(x) for x in m.groups()]
        to_ms = lambda h, mi, s, ms: ((h * 60 + mi) * 60 + s) * 1000 + ms  # noqa: E731
        cues.append((to_ms(*g[:4]), to_ms(*g[4:]), lines[1:]))
    return cues


@pytest.mark.parametrize("ext, sep", [("srt", ","), ("vtt", ".")])
def test_subtitles_parse_back_to_the_segment_times(storage, settings, ext, sep):
    spec = make_job(storage)
    asm.assemble_job(storage, spec, {}, SR, settings)

    for ch, lengths in enumerate(LENGTHS):
        text = storage.get(keys.subtitles(spec.id, ch, ext)).decode()
        if ext == "vtt":
            assert text.startswith("WEBVTT\n\n")
        cues = parse_cues(text, sep)
        assert len(cues) == len(lengths)
        for i, ((start_ms, end_ms, lines), start, n) in enumerate(zip(cues, expected_starts(lengths), lengths)):
            assert start_ms == samples_to_ms(start, SR)
            assert end_ms == samples_to_ms(start + n, SR)
            assert abs(start_ms / 1000 - start / SR) <= 0.0005
            if ext == "vtt":
                assert "-->" not in " ".join(lines) and "<b>" not in " ".join(lines)
                lines = [x.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&") for x in lines]
            assert all(0 < len(line) <= LINE_WIDTH for line in lines)
            assert " ".join(lines) == TEXTS.get((ch, i), f"Chapter {ch}, segment {i}.")


def test_subtitle_formatting_details():
    assert srt_time(3 * 3_600_000 + 25 * 60_000 + 7_089) == "03:25:07,089"
    assert vtt_time(59_999) == "00:00:59.999"
    assert vtt_time(100 * 3_600_000) == "100:00:00.000"
    # Half a millisecond rounds up; integer arithmetic, no float drift at 10 hours.
    assert samples_to_ms(12, 24000) == 1 and samples_to_ms(11, 24000) == 0
    assert samples_to_ms(10 * 3600 * 24000 + 1, 24000) == 36_000_000
    # Greedy wrapping at 42 would leave "word" alone on the second line; balanced splits 5 + 4.
    assert wrap("word " * 9) == ["word word word word word", "word word word word"]
    lines = wrap("word " * 30)
    assert len(lines) == 4 and all(len(x) <= LINE_WIDTH for x in lines) and len(lines[-1]) >= 20
    cjk = wrap("一" * 100)  # no spaces: broken by display width (2 columns a character), still balanced
    assert "".join(cjk) == "一" * 100 and [len(x) for x in cjk] == [20, 20, 20, 20, 20]
    # Issue 14: a 43-character Chinese cue was one line; now lines fit 42 columns, punctuation never opens one.
    cue = "午后，风暴来了。雨点敲打着屋顶，街道在几分钟内就空了。雨停以后，全镇的人都出来看海。"
    lines = wrap(cue)
    assert "".join(lines) == cue and len(lines) == 2
    assert all(display_width(x) <= LINE_WIDTH for x in lines)
    assert not any(x[0] in "，。" for x in lines)
    mixed = wrap("我用 iPhone 15 Pro Max 拍了很多张照片，然后发给了远方的朋友们看看。")
    assert all(display_width(x) <= LINE_WIDTH for x in mixed) and "iPhone" in "".join(mixed)
    assert wrap("two\n\nparagraphs") == ["two paragraphs"]  # no blank line inside a cue


# --- failures ---------------------------------------------------------------------------------


def test_failed_and_missing_segments_drop_only_their_chapters(storage, settings):
    lengths = [[1000, 1100], [1200], [1300, 1400], [1500]]
    spec = make_job(storage, lengths=lengths, skip={"0000-00001", "0002-00000"})
    # A chapter that an earlier assembly produced must not survive a failing one.
    storage.put(keys.chapter(spec.id, 0, "wav"), b"stale")
    storage.put(keys.subtitles(spec.id, 0, "srt"), b"stale")

    manifest = asm.assemble_job(storage, spec, {"0000-00001": "CUDA OOM after 3 attempts"}, SR, settings)

    assert manifest.state == "completed_with_errors"
    assert manifest.failed["0000-00001"] == "CUDA OOM after 3 attempts"
    assert manifest.failed["0002-00000"].startswith("missing from storage: ")
    assert set(manifest.failed) == {"0000-00001", "0002-00000"}
    assert [c.key is None for c in manifest.chapters] == [True, False, True, False]
    assert not storage.exists(keys.chapter(spec.id, 0, "wav"))
    assert not storage.exists(keys.subtitles(spec.id, 0, "srt"))
    assert not storage.exists(keys.chapter(spec.id, 2, "wav"))
    assert {s.chapter for s in manifest.segments} == {1, 3}
    # Assembled chapters follow each other in the book; dropped ones take no time.
    c1, c3 = manifest.chapters[1], manifest.chapters[3]
    assert c1.start_s == 0.0 and round(c1.duration_s * SR) == LEAD + 1200
    assert round(c3.start_s * SR) == LEAD + 1200 and manifest.chapters[2].duration_s == 0.0
    assert audio.probe(storage.get(c3.key)).frames == LEAD + 1500


def test_unreadable_or_mismatched_segment_drops_its_chapter(storage, settings):
    spec = make_job(storage, lengths=[[1000], [1000], [1000]])
    storage.put(keys.segment(spec.id, 1, 0, "wav"), b"not audio at all")
    storage.put(keys.segment(spec.id, 2, 0, "wav"), audio.encode(tone(1000, 440, 16000), 16000, "wav"))

    manifest = asm.assemble_job(storage, spec, {}, SR, settings)

    assert [c.key is not None for c in manifest.chapters] == [True, False, False]
    assert "cannot decode audio" in manifest.failed["0001-00000"]
    assert "0001-00000.wav" in manifest.failed["0001-00000"]
    assert "16000 Hz" in manifest.failed["0002-00000"]
    assert manifest.state == "completed_with_errors"


# --- formats ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", audio.supported_formats())
def test_each_format_round_trips_and_assembles(storage, settings, fmt):
    x = tone(4801, 440.0)
    data = audio.encode(x, SR, fmt)
    y, sr = audio.decode(data)
    info = audio.probe(data)
    assert sr == SR and y.dtype == np.float32
    if fmt == "m4a":  # AAC decodes with its last frame's padding (voxbatch/audio.py)
        assert len(x) <= len(y) == info.frames < len(x) + 1024 + 1024
        y = y[: len(x)]
    else:
        assert len(y) == len(x) == info.frames  # exact length, lossy codecs included
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(y, x, atol=1 / 32768 + 1e-7)  # PCM_16 quantization
    else:
        # Lossy: past the codec's start-up, the tone comes back close (SNR > 15 dB).
        err = y[960:-960] - x[960:-960]
        assert 10 * np.log10(np.sum(x[960:-960] ** 2) / np.sum(err**2)) > 15
    assert audio.content_type(fmt).startswith("audio/")

    spec = make_job(storage, fmt)
    manifest = asm.assemble_job(storage, spec, {}, SR, settings)
    for ch, lengths in enumerate(LENGTHS):
        frames = audio.probe(storage.get(manifest.chapters[ch].key)).frames
        if fmt == "m4a":  # every segment and the chapter carry up to one AAC frame of padding
            assert chapter_length(lengths) <= frames <= chapter_length(lengths) + 1024 * (len(lengths) + 2)
        else:
            assert frames == chapter_length(lengths)
        assert manifest.chapters[ch].key.endswith(f".{fmt}")


def test_opus_names_the_problem_for_rates_it_cannot_take():
    if "opus" not in audio.supported_formats():
        with pytest.raises(audio.AudioFormatError, match="opus"):
            audio.encode(tone(100, 440), SR, "opus")
    with pytest.raises(audio.AudioFormatError, match="opus.*22050"):
        audio.encode(tone(100, 440, 22050), 22050, "opus")
    with pytest.raises(audio.AudioFormatError, match="aiff"):
        audio.encode(tone(100, 440), SR, "aiff")


# --- the .m4b book ----------------------------------------------------------------------------


def test_m4b_has_aac_and_a_chapter_marker_per_assembled_chapter(storage, settings, tmp_path):
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        pytest.skip("ffmpeg/ffprobe not on PATH (Debian: apt-get install -y ffmpeg)")
    spec = make_job(storage, skip={"0001-00000"})  # chapter 1 missing: two markers, not three
    manifest = asm.assemble_job(storage, spec, {}, SR, settings)
    assert manifest.book_key == keys.book(spec.id)

    path = tmp_path / "book.m4b"
    path.write_bytes(storage.get(manifest.book_key))
    probe = json.loads(
        subprocess.run(
            ["ffprobe", "-v", "error", "-print_format", "json", "-show_chapters", "-show_format", "-show_streams", str(path)],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    assert [s["codec_name"] for s in probe["streams"] if s["codec_type"] == "audio"] == ["aac"]
    assert "mp4" in probe["format"]["format_name"]
    assert probe["format"]["tags"]["title"] == spec.name  # FFMETADATA escaping round-trips

    chapters = probe["chapters"]
    assert [c["tags"]["title"] for c in chapters] == ["Chapter 0", "Chapter 2"]
    len0, len2 = chapter_length(LENGTHS[0]), chapter_length(LENGTHS[2])
    assert [c["time_base"] for c in chapters] == ["1/1000", "1/1000"]
    assert [(c["start"], c["end"]) for c in chapters] == [
        (0, samples_to_ms(len0, SR)),
        (samples_to_ms(len0, SR), samples_to_ms(len0 + len2, SR)),
    ]
    assert manifest.chapters[2].start_s == len0 / SR
    # AAC pads to whole 1024-sample frames; the edit list trims it back to about the PCM length.
    assert abs(float(probe["format"]["duration"]) - (len0 + len2) / SR) < 0.05


def _book_pcm(storage, key: str, tmp_path, name: str) -> np.ndarray:
    """A stored .m4b's audio decoded to float32 by ffmpeg (what a player hears)."""
    path = tmp_path / f"{name}.m4b"
    path.write_bytes(storage.get(key))
    raw = subprocess.run(["ffmpeg", "-nostdin", "-v", "error", "-i", str(path), "-f", "f32le", "-"],
                         check=True, capture_output=True).stdout
    return np.frombuffer(raw, dtype="<f4")


def test_the_book_encoded_while_chapters_come_is_the_book_encoded_at_the_end(storage, settings, tmp_path, monkeypatch):
    """BOOK_WHILE_ASSEMBLING: the encoder has chapter 0's PCM before chapter 1 is added, and the book it
    writes decodes to the same samples, with the same chapter marks and tags, as the book encoded in one
    go after the last chapter (the AAC encoder saw the same PCM in the same order)."""
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        pytest.skip("ffmpeg/ffprobe not on PATH (Debian: apt-get install -y ffmpeg)")
    spec = make_job(storage, skip={"0001-00000"})  # chapter 1 missing: it is not in the book either
    books = {}
    for streamed in (True, False):
        monkeypatch.setattr(asm, "BOOK_WHILE_ASSEMBLING", streamed)
        with asm.JobAssembly(storage, spec, SR, settings) as assembly:
            assembly.add(0, {})
            if streamed:
                assert assembly._encoder is not None
                fed_after_first = assembly.d.book.mark()
            else:
                assert assembly._encoder is None
            for index in range(1, len(spec.chapters)):
                assembly.add(index, {})
            manifest = assembly.finish({})
        probe = json.loads(subprocess.run(
            ["ffprobe", "-v", "error", "-print_format", "json", "-show_chapters", "-show_format", "-"],
            input=storage.get(manifest.book_key), check=True, capture_output=True).stdout)
        books[streamed] = (_book_pcm(storage, manifest.book_key, tmp_path, str(streamed)),
                           [(c["start"], c["end"], c["tags"]["title"]) for c in probe["chapters"]],
                           probe["format"]["tags"]["title"])
    assert fed_after_first == 4 * chapter_length(LENGTHS[0])  # chapter 0 went to the encoder when it was added
    assert np.array_equal(books[True][0], books[False][0]) and len(books[True][0]) > 0
    assert books[True][1] == books[False][1] and [t for *_, t in books[True][1]] == ["Chapter 0", "Chapter 2"]
    assert books[True][2] == books[False][2] == spec.name


def test_a_book_encoder_that_fails_names_the_book_and_one_given_up_is_stopped(tmp_path):
    """An encoder fed past the end of its PCM (the assembler's file truncated under it) fails with an
    error naming the book at `finish`; one aborted (the assembly closed without finishing) exits."""
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg not on PATH (Debian: apt-get install -y ffmpeg)")
    from voxbatch.producer import m4b

    pcm = tmp_path / "book.f32"
    pcm.write_bytes(np.zeros(SR, dtype="<f4").tobytes())
    enc = m4b.BookEncoder(shutil.which("ffmpeg"), pcm, SR, 1, tmp_path)
    enc.feed(8 * SR)  # twice what the file holds
    with pytest.raises(m4b.FfmpegError, match=r"book\.m4b.*ends at"):
        enc.finish("T", [m4b.ChapterMark("c", 0, 1000)], tmp_path / "book.m4b")
    enc = m4b.BookEncoder(shutil.which("ffmpeg"), pcm, SR, 1, tmp_path)
    enc.feed(4 * SR)
    enc.abort()
    assert enc._proc.poll() is not None


def test_a_book_encoder_that_cannot_start_leaves_the_book_to_the_end(storage, settings, monkeypatch):
    """ffmpeg found at the start but not runnable when the first chapter is in: the book is still
    written, encoded after the last chapter as before."""
    if shutil.which("ffmpeg") is None or shutil.which("ffprobe") is None:
        pytest.skip("ffmpeg/ffprobe not on PATH (Debian: apt-get install -y ffmpeg)")
    from voxbatch.producer import m4b

    def broken(*args, **kwargs):
        raise FileNotFoundError("ffmpeg")

    monkeypatch.setattr(m4b, "BookEncoder", broken)
    spec = make_job(storage)
    manifest = asm.assemble_job(storage, spec, {}, SR, settings)
    assert manifest.book_key == keys.book(spec.id) and storage.get(manifest.book_key)[4:8] == b"ftyp"


def test_without_ffmpeg_the_book_is_skipped(storage, settings, tmp_path, monkeypatch):
    spec = make_job(storage, lengths=[[1000]])
    storage.put(keys.book(spec.id), b"a book from an earlier assembly")
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a machine without ffmpeg

    manifest = asm.assemble_job(storage, spec, {}, SR, settings)

    assert manifest.book_key is None and manifest.state == "completed"
    assert not storage.exists(keys.book(spec.id))
    assert manifest.chapters[0].key is not None


# --- fetch ------------------------------------------------------------------------------------


def test_fetch_job_mirrors_the_job_folder(storage, settings, tmp_path):
    spec = make_job(storage)
    storage.put(keys.job_spec(spec.id), spec.model_dump_json().encode())
    make_job(storage, job_id="other")  # not fetched
    asm.assemble_job(storage, spec, {}, SR, settings)

    out = tmp_path / "out"
    n, skipped = asm.fetch_job(storage, spec.id, out)

    job_keys = storage.list(keys.job_prefix(spec.id))
    assert skipped == [] and n == len(job_keys) and n == sum(1 for p in out.rglob("*") if p.is_file())
    for key in job_keys:
        assert (out / key.removeprefix(keys.job_prefix(spec.id))).read_bytes() == storage.get(key)
    assert (out / "manifest.json").is_file() and (out / "chapters" / "0000.wav").is_file()
    assert not list(out.rglob("*.part"))
