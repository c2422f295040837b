"""Delivery presets end to end: `voxbatch render --preset acx|podcast` and `voxbatch qc`.

Every chapter file is measured here independently of the code under test: ffmpeg decodes it to raw
float32, numpy computes RMS, peak, the noise floor (quietest 500 ms) and the room tone at head and
tail, ffprobe reads codec, bit rate, rate, channels and every packet's size (CBR: each 192 kb/s frame
at 44.1 kHz is 626 or 627 bytes), pyloudnorm the loudness, and scipy's polyphase resampler the true
peak (the code under test oversamples with soxr). The tone engine makes the audio unless a test says
otherwise; the tiny CosyVoice2 checkpoint (random weights: noise, not speech) is the second source.
"""

from __future__ import annotations

import json
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.test_distributed import cluster  # noqa: F401 - the real-services fixture
from voxbatch.models import Manifest

RATE = 44100
BOOK_MD = """\
# Harbour Tales

## The Boat

The boat came in at dawn. Gulls circled the mast and the crew pulled the ropes tight. Nobody on the pier
said a word.

The fisherman counted twelve crates of herring and smiled.

## The Market

By nine the market was full. Voices rose over the stalls, and the smell of bread filled the square.
"""

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "ffprobe"], capture_output=True).returncode != 0, reason="needs ffmpeg/ffprobe"
)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: dict | None = None, check: bool = True) -> Result:
    """`voxbatch ARGS` in this process (typer's runner: the real command, exit code and output, without
    paying a fresh interpreter's imports per call on a 2-core CI box)."""
    from typer.testing import CliRunner

    from voxbatch.cli import app

    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "120", **(env or {})})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    result = Result(r.exit_code, r.stdout, r.stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"voxbatch {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def render(corpus: Path, out: Path, *args: str, env: dict | None = None, exit_code: int = 0) -> tuple[Path, Manifest]:
    proc = cli("render", str(corpus), "--out", str(out), *args, env=env, check=exit_code == 0)
    assert proc.returncode == exit_code, proc.stdout + proc.stderr
    (job_dir,) = list((out / "jobs").iterdir())
    return job_dir, Manifest.model_validate_json((job_dir / "manifest.json").read_text())


# --- independent measurement -------------------------------------------------------------------


def ffprobe(path: Path) -> dict:
    out = subprocess.run(["ffprobe", "-v", "error", "-show_streams", "-show_format", "-show_chapters",
                          "-show_entries", "packet=size", "-of", "json", str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def pcm(path: Path) -> np.ndarray:
    raw = subprocess.run(["ffmpeg", "-v", "error", "-i", str(path), "-f", "f32le", "-ac", "1", "-"],
                         capture_output=True, check=True).stdout
    return np.frombuffer(raw, dtype="<f4").astype(np.float64)


def dbfs(power: float) -> float:
    return 10 * np.log10(max(power, 1e-30))


def levels(x: np.ndarray) -> dict:
    win = RATE // 100  # 10 ms
    power = (x[: len(x) // win * win] ** 2).reshape(-1, win).mean(axis=1)
    loud = np.flatnonzero(power > 10 ** (-50 / 10))
    half_s = np.convolve(power, np.ones(50) / 50, mode="valid")
    return {
        "rms": dbfs(np.mean(x**2)),
        "peak": 20 * np.log10(np.abs(x).max()),
        "floor": dbfs(half_s.min()),
        "head": loud[0] * win / RATE,
        "tail": (len(x) - (loud[-1] + 1) * win) / RATE,
    }


def true_peak(x: np.ndarray) -> float:
    from scipy.signal import resample_poly

    return 20 * np.log10(np.abs(resample_poly(x, 4, 1)).max())


def lufs(x: np.ndarray) -> float:
    import pyloudnorm

    return pyloudnorm.Meter(RATE).integrated_loudness(x)


def check_mp3(path: Path, kbps: int) -> np.ndarray:
    probe = ffprobe(path)
    (stream,) = [s for s in probe["streams"] if s["codec_type"] == "audio"]
    assert stream["codec_name"] == "mp3"
    assert int(stream["sample_rate"]) == RATE and stream["channels"] == 1
    assert int(stream["bit_rate"]) == kbps * 1000
    frame = 144 * kbps * 1000 // RATE
    sizes = {int(p["size"]) for p in probe["packets"]}
    assert sizes <= {frame, frame + 1}, f"not CBR {kbps} kb/s: packet sizes {sorted(sizes)}"
    return pcm(path)


def check_acx_file(path: Path) -> dict:
    lv = levels(check_mp3(path, 192))
    assert -23 <= lv["rms"] <= -18, lv
    assert lv["peak"] <= -3, lv
    assert lv["floor"] <= -60, lv
    assert 0.5 <= lv["head"] <= 1.0, lv
    assert 1.0 <= lv["tail"] <= 5.0, lv
    return lv


# --- acx ----------------------------------------------------------------------------------------


@pytest.fixture
def book_md(tmp_path) -> Path:
    path = tmp_path / "harbour.md"
    path.write_text(BOOK_MD, encoding="utf-8")
    return path


def test_acx_on_the_tone_engine(book_md, tmp_path):
    job_dir, manifest = render(book_md, tmp_path / "out", "--preset", "acx", "--author", "Ann Writer")

    # Credits are chapters of their own, spoken by the job's voice; the markdown H1 is the title.
    titles = [c.title for c in manifest.chapters]
    assert titles == ["Opening Credits", "The Boat", "The Market", "Closing Credits"]
    assert manifest.title == "Harbour Tales" and manifest.author == "Ann Writer"
    assert [s.text for s in manifest.segments if s.chapter == 0] == ["Harbour Tales. Written by Ann Writer."]
    for chapter in manifest.chapters:
        assert chapter.key.endswith(".mp3") and chapter.files == [chapter.key]
        lv = check_acx_file(job_dir.parent.parent / chapter.key)
        row = next(r for r in manifest.qc if r.key == chapter.key)
        assert row.passed and all(row.checks.values())
        assert abs(row.levels.rms_db - lv["rms"]) < 0.1 and abs(row.levels.head_s - lv["head"]) < 0.02
    tags = ffprobe(job_dir / "chapters" / "0001.mp3")["format"]["tags"]
    assert (tags["title"], tags["album"], tags["artist"], tags["track"]) == ("The Boat", "Harbour Tales",
                                                                             "Ann Writer", "2/4")
    # Subtitles follow the room tone put in front of the chapter.
    srt = (job_dir / "subtitles" / "0001.srt").read_text()
    first = next(s for s in manifest.segments if s.chapter == 1)
    assert first.chapter_file == manifest.chapters[1].key
    h, m, rest = srt.split("\n")[1].split(" --> ")[0].split(":")
    assert abs(float(rest.replace(",", ".")) - first.start_s) < 0.002

    proc = cli("qc", manifest.job_id, "--out", str(tmp_path / "out"))
    assert "0001.mp3" in proc.stdout and "pass" in proc.stdout and "FAIL" not in proc.stdout


def test_qc_exit_code_follows_the_rules(book_md, tmp_path):
    # A 3 s lead before each chapter is cut to ACX's head room tone (only silence is ever cut), but a
    # 3 s cap on file length cannot be met by files whose one segment alone is longer: flagged, exit 1.
    env = {"VOXBATCH_CHAPTER_LEAD_MS": "3000", "VOXBATCH_MASTER_MAX_FILE_S": "3"}
    job_dir, manifest = render(book_md, tmp_path / "out", "--preset", "acx", env=env,
                               exit_code=1)  # render itself says the delivery is not within the preset
    assert manifest.qc and not all(r.passed for r in manifest.qc)
    for r in manifest.qc:
        assert r.checks["length"] is (r.levels.duration_s <= 3.0) and r.passed is r.checks["length"]
        assert r.checks["room_tone_head"] and 0.5 <= levels(pcm(job_dir.parent.parent / r.key))["head"] <= 1.0
        if r.part == 1:  # the chapter's first file opened with the 3 s lead
            assert r.source_levels.head_s >= 3.0
    first = next(s for s in manifest.segments if s.chapter == 1)
    assert 0.5 <= first.start_s <= 1.0  # cues moved with the cut
    proc = cli("qc", manifest.job_id, "--out", str(tmp_path / "out"), check=False)
    assert proc.returncode == 1
    assert "FAIL" in proc.stdout and "length (no file over 120 minutes" in proc.stdout
    missing = cli("qc", "nosuchjob", "--out", str(tmp_path / "out"), check=False)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr


def test_acx_splits_long_chapters_at_segment_boundaries(tmp_path):
    text = "# Long\n\n" + "\n\n".join(f"Paragraph {i} tells a short part of a long story." for i in range(8))
    corpus = tmp_path / "long.md"
    corpus.write_text(text, encoding="utf-8")
    job_dir, manifest = render(corpus, tmp_path / "out", "--preset", "acx", env={"VOXBATCH_MASTER_MAX_FILE_S": "12"})

    (body,) = [c for c in manifest.chapters if c.title == "Long"]
    assert len(body.files) >= 2 and body.key == body.files[0]
    segs = [s for s in manifest.segments if s.chapter == body.index]
    assert [s.chapter_file for s in segs] == sorted(s.chapter_file for s in segs)  # in order, none split
    for key in body.files:
        lv = check_acx_file(job_dir.parent.parent / key)
        assert len(pcm(job_dir.parent.parent / key)) / RATE <= 12.0, lv


# --- podcast ------------------------------------------------------------------------------------


def test_podcast_on_the_tone_engine(book_md, tmp_path):
    job_dir, manifest = render(book_md, tmp_path / "out", "--preset", "podcast")
    assert [c.title for c in manifest.chapters] == ["The Boat", "The Market"]  # no credits
    for chapter in manifest.chapters:
        x = check_mp3(job_dir.parent.parent / chapter.key, 128)
        assert abs(lufs(x) + 16) <= 1.0
        assert true_peak(x) <= -1.0
    assert cli("qc", manifest.job_id, "--out", str(tmp_path / "out")).returncode == 0


def test_podcast_m4a_chapters_and_book(book_md, tmp_path):
    job_dir, manifest = render(book_md, tmp_path / "out", "--preset", "podcast", "--format", "m4a")
    assert manifest.format == "m4a" and manifest.chapter_format == "m4a"
    for chapter in manifest.chapters:
        path = job_dir.parent.parent / chapter.key
        stream = [s for s in ffprobe(path)["streams"] if s["codec_type"] == "audio"][0]
        assert stream["codec_name"] == "aac" and int(stream["sample_rate"]) == RATE
        x = pcm(path)
        assert abs(lufs(x) + 16) <= 1.0 and true_peak(x) <= -1.0
    assert all(r.passed for r in manifest.qc)


# --- the tiny CosyVoice2 model ------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["acx", "podcast"])
def test_presets_on_the_tiny_model(preset, tiny_model_dir, book_md, tmp_path):
    meta = json.loads((tiny_model_dir / "reference_meta.json").read_text())
    out = tmp_path / "out"
    env = {"VOXBATCH_STORAGE_URL": out.resolve().as_uri()}
    cli("voice", "add", "v1", "--wav", str(tiny_model_dir / "prompt_24k.wav"), "--text",
        meta["e2e"]["prompt_text"], "--model-dir", str(tiny_model_dir), env=env)
    job_dir, manifest = render(book_md, out, "--voice", "v1", "--engine", "cosyvoice2", "--model-dir",
                               str(tiny_model_dir), "--max-tokens", "25", "--preset", preset)
    assert manifest.state == "completed", manifest.failed
    for chapter in manifest.chapters:
        path = job_dir.parent.parent / chapter.key
        if preset == "acx":
            check_acx_file(path)
        else:
            x = check_mp3(path, 128)
            assert abs(lufs(x) + 16) <= 1.0 and true_peak(x) <= -1.0


# --- book metadata in the m4b -------------------------------------------------------------------


def jpeg() -> bytes:
    """A real 8x8 JPEG (ffmpeg makes it), so players and ffprobe accept the cover."""
    return subprocess.run(["ffmpeg", "-v", "error", "-f", "lavfi", "-i", "color=c=red:s=8x8", "-frames:v", "1",
                           "-f", "mjpeg", "-"], capture_output=True, check=True).stdout


def write_epub_with_cover(path: Path, cover: bytes) -> Path:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("voxbatch-cover-test")
    book.set_title("The Lighthouse Keeper")
    book.add_author("Mara Quill")
    book.set_language("en")
    book.set_cover("cover.jpg", cover, create_page=False)
    cover_page = epub.EpubHtml(title="Cover", file_name="cover.xhtml")
    cover_page.content = "<html><body><p>Cover art by the lighthouse society.</p></body></html>"
    chapters = []
    for i, (title, text) in enumerate([("The Lamp", "The lamp was lit at *dusk* every day."),
                                        ("The Fog", "Fog rolled in. The **horn** sounded twice.")], 1):
        c = epub.EpubHtml(title=title, file_name=f"ch{i}.xhtml", lang="en")
        c.content = f"<html><body><h1>{title}</h1><p>{text}</p></body></html>"
        chapters.append(c)
    for item in (cover_page, *chapters):
        book.add_item(item)
    book.toc = chapters
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = [(cover_page.id, "no"), "nav", *chapters]
    epub.write_epub(str(path), book)
    with zipfile.ZipFile(path) as z:  # the fixture really marks the cover page non-linear
        opf = next(n for n in z.namelist() if n.endswith(".opf"))
        assert 'linear="no"' in z.read(opf).decode()
    return path


def test_m4b_carries_title_author_cover_and_no_cover_chapter(tmp_path):
    cover = jpeg()
    corpus = write_epub_with_cover(tmp_path / "lighthouse.epub", cover)
    job_dir, manifest = render(corpus, tmp_path / "out", "--preset", "acx")

    assert [c.title for c in manifest.chapters] == ["Opening Credits", "The Lamp", "The Fog", "Closing Credits"]
    spoken = " ".join(s.text for s in manifest.segments)
    assert "*" not in spoken and "asterisk" not in spoken and "lighthouse society" not in spoken
    probe = ffprobe(job_dir / "book.m4b")
    tags = probe["format"]["tags"]
    assert tags["title"] == "The Lighthouse Keeper" and tags["artist"] == "Mara Quill"
    assert [c["tags"]["title"] for c in probe["chapters"]] == [c.title for c in manifest.chapters]
    pics = [s for s in probe["streams"] if s.get("disposition", {}).get("attached_pic") == 1]
    assert len(pics) == 1 and pics[0]["codec_name"] == "mjpeg"

    from mutagen.id3 import ID3
    from mutagen.mp4 import MP4

    assert bytes(MP4(job_dir / "book.m4b")["covr"][0]) == cover
    id3 = ID3(job_dir / "chapters" / "0001.mp3")
    assert id3.getall("APIC")[0].data == cover and str(id3["TPE1"]) == "Mara Quill"

    # With --epub-all-spine the non-linear cover page is read like any other page.
    _, everything = render(corpus, tmp_path / "all", "--epub-all-spine")
    assert any("lighthouse society" in s.text for s in everything.segments)


# --- the distributed path: submit -> workers (mp3 segments) -> S3 -> assembler masters ------------


def test_submit_with_acx_through_workers_and_the_assembler(cluster, book_md, tmp_path):
    cluster.start("worker")
    cluster.start("assembler")
    job_id = cluster.submit(book_md, "--preset", "acx", "--format", "mp3", "--author", "Ann Writer")
    assert cluster.wait_finished(job_id).state == "completed"
    manifest = cluster.manifest(job_id)
    assert manifest.preset == "acx" and manifest.format == "mp3" and len(manifest.chapters) == 4
    seg = manifest.segments[0]
    assert seg.key.endswith(".mp3")  # the workers stored MP3 segments at the engine's rate
    seg_path = tmp_path / "seg.mp3"
    seg_path.write_bytes(cluster.storage.get(seg.key))
    assert len(pcm(seg_path)) == pytest.approx(seg.duration_s * 24000, abs=1)  # gapless: exact length
    for chapter in manifest.chapters:
        path = tmp_path / chapter.key.rsplit("/", 1)[-1]
        path.write_bytes(cluster.storage.get(chapter.key))
        check_acx_file(path)
    assert cluster.cli("qc", job_id).returncode == 0  # reads the manifest from S3
