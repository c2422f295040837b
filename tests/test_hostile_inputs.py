"""Hostile inputs and outages through the real CLI (`python -m voxbatch.cli` subprocesses), against
real Redis and SeaweedFS S3: every refusal is one line on stderr naming the file, name or service,
with a true exit code (2: bad input or unreachable service, 1: a job or fetch that did less than
asked), no traceback, no secret, and nothing stored. A good job submitted afterwards completes.

`render` is interrupted with SIGINT (tone engine, slowed with VOXBATCH_TONE_RTF) and run again: it
stops within 2 s, and the re-run renders only the segments the first run did not store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tests import corpora
from voxbatch import testing_services as services
from voxbatch.jobstate import RedisJobStore

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "voxbatch.cli"]
# Wide enough that tables and lines do not wrap the words the tests look for (one row narrows it).
BASE_ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("VOXBATCH_", "AWS_"))}, "COLUMNS": "250"}
# No credentials from this machine's files or an instance metadata service: only what a row sets.
NO_AMBIENT_AWS = {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                  "AWS_EC2_METADATA_DISABLED": "true"}


def as_in_a_terminal() -> None:
    """Child-side (Popen preexec_fn): Ctrl-C reaches the command as it does in a terminal. A child
    inherits an ignored or blocked SIGINT from whatever ran the tests (a CI runner, an earlier test's
    library), and then never sees the SIGINT these tests send."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env={**BASE_ENV, **NO_AMBIENT_AWS, **env}, cwd=services.REPO,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess, code: int, *names: str) -> str:
    """The refusal: exit `code`, exactly one line on stderr that names every one of `names`, no traceback."""
    everything = proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == code, f"exit {proc.returncode}, wanted {code}:\n{everything}"
    assert "Traceback" not in everything, everything
    assert len(lines) == 1 and lines[0].startswith("error: "), everything
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"
    assert services.S3_SECRET not in everything and "hunter2" not in everything
    return lines[0]


def stored(env: dict[str, str]) -> list[str]:
    """Every object in the row's bucket (the S3 rows' "nothing stored")."""
    import boto3

    bucket = env["VOXBATCH_STORAGE_URL"].removeprefix("s3://").split("/")[0]
    s3 = boto3.client("s3", endpoint_url=env["VOXBATCH_S3_ENDPOINT"], aws_access_key_id=services.S3_KEY,
                      aws_secret_access_key=services.S3_SECRET, region_name="us-east-1")
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]


def rewrite_zip(src: Path, dst: Path, replace: dict[str, bytes] | None = None, add: dict[str, bytes] | None = None) -> Path:
    """A copy of a zip (an EPUB) with some members replaced or added."""
    replace, add = replace or {}, add or {}
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_STORED if info.filename == "mimetype" else zipfile.ZIP_DEFLATED
            zout.writestr(info.filename, replace.get(info.filename, zin.read(info.filename)), method)
        for name, data in add.items():
            zout.writestr(name, data, zipfile.ZIP_DEFLATED)
    return dst


# --------------------------------------------------------------------------------------------------------
# Bad corpora: (id, make(tmp_path) -> (path, env), words the one error line must hold)


def _symlink_out(tmp: Path):
    folder = tmp / "book"
    folder.mkdir()
    (folder / "1.txt").write_text("Chapter one is fine.\n")
    secret = tmp / "secret.txt"
    secret.write_text("The password is hunter2.\n")
    (folder / "2.txt").symlink_to(secret)
    return folder, {}


def _control_chars(tmp: Path):
    path = tmp / "ctrl.txt"
    path.write_text("Chapter 1\n\nHello.\n" + "\x07\x1b\x08" * 7000 + "\n", encoding="utf-8")
    return path, {}


def _zip_bomb(tmp: Path):
    book = corpora.write_epub(tmp / "plain.epub")
    return rewrite_zip(book, tmp / "bomb.epub", add={"EPUB/bomb.xhtml": b" " * (4 * 2**20)}), {}


def _epub_too_big(tmp: Path):
    return corpora.write_epub(tmp / "big.epub"), {"VOXBATCH_MAX_EPUB_UNCOMPRESSED_BYTES": "2000"}


def _malformed_opf(tmp: Path):
    book = corpora.write_epub(tmp / "plain.epub")
    return rewrite_zip(book, tmp / "opf.epub", {"EPUB/content.opf": b"<package><broken"}), {}


def _malformed_ncx(tmp: Path):
    book = corpora.write_epub(tmp / "plain.epub")
    return rewrite_zip(book, tmp / "ncx.epub", {"EPUB/toc.ncx": b"<ncx><navMap><navPoint"}), {}


def _corpus_bytes(tmp: Path):
    return corpora.write_txt(tmp / "large.txt"), {"VOXBATCH_MAX_CORPUS_BYTES": "200"}


def _too_many_segments(tmp: Path):
    return corpora.write_txt(tmp / "many.txt"), {"VOXBATCH_MAX_SEGMENTS_PER_JOB": "3"}


def _job_spec_bytes(tmp: Path):
    return corpora.write_txt(tmp / "spec.txt"), {"VOXBATCH_MAX_JOB_SPEC_BYTES": "300"}


def _uncuttable_segment(tmp: Path):
    path = tmp / "run.txt"
    path.write_text("Chapter 1\n\nFine.\n\n" + "x" * 3000 + ".\n", encoding="utf-8")
    return path, {}


BAD_CORPORA = [
    ("symlink leaving the folder", _symlink_out, ["2.txt", "symlink", "outside the corpus folder"]),
    ("control characters", _control_chars, ["ctrl.txt", "control characters"]),
    ("zip bomb EPUB", _zip_bomb, ["bomb.epub#EPUB/bomb.xhtml", "zip bomb", "VOXBATCH_MAX_EPUB_RATIO"]),
    ("EPUB over the inflated limit", _epub_too_big, ["big.epub", "VOXBATCH_MAX_EPUB_UNCOMPRESSED_BYTES"]),
    ("malformed OPF", _malformed_opf, ["opf.epub", "not a readable EPUB"]),
    ("malformed NCX", _malformed_ncx, ["ncx.epub", "not a readable EPUB"]),
    ("corpus over the byte limit", _corpus_bytes, ["large.txt", "VOXBATCH_MAX_CORPUS_BYTES"]),
    ("too many segments", _too_many_segments, ["many.txt", "VOXBATCH_MAX_SEGMENTS_PER_JOB"]),
    ("job.json over the limit", _job_spec_bytes, ["spec.txt", "VOXBATCH_MAX_JOB_SPEC_BYTES"]),
    ("segment with no place to cut", _uncuttable_segment, ["run.txt", "segment 0000-0000", "VOXBATCH_MAX_SEGMENT_CHARS"]),
]


@pytest.mark.parametrize("make,names", [pytest.param(m, n, id=i) for i, m, n in BAD_CORPORA])
def test_bad_corpus_is_refused_in_one_line_and_stores_nothing(s3_env, tmp_path, make, names):
    path, env = make(tmp_path)
    jobs = RedisJobStore.from_url(s3_env["VOXBATCH_BROKER_URL"])
    before = jobs.r.zcard("vb:jobs")
    one_line_error(cli({**s3_env, **env}, "submit", str(path), "--voice", "tone"), 2, *names)
    assert stored(s3_env) == [] and jobs.r.zcard("vb:jobs") == before


def test_declared_epub_encoding_is_honoured(tmp_path):
    from voxbatch.producer.readers import read_corpus

    book = corpora.write_epub(tmp_path / "plain.epub")
    with zipfile.ZipFile(book) as z:
        xhtml = z.read("EPUB/chap01.xhtml").decode()
    latin = xhtml.replace("encoding='utf-8'", "encoding='iso-8859-1'").replace("The boat", "Café crème. The boat")
    chapters = read_corpus(rewrite_zip(book, tmp_path / "latin.epub", {"EPUB/chap01.xhtml": latin.encode("latin-1")}))
    assert "Café crème. The boat" in chapters[0].text and "\ufffd" not in chapters[0].text


def test_a_few_control_characters_are_removed(tmp_path):
    from voxbatch.producer.readers import read_corpus

    path = tmp_path / "few.txt"
    path.write_text("Chapter 1\n\nA bell\x07 rang\x1b once.\n", encoding="utf-8")
    assert read_corpus(path)[0].text == "Chapter 1\n\nA bell rang once."


# --------------------------------------------------------------------------------------------------------
# Bad names and markup


def test_bad_names_are_refused_in_one_line(s3_env, tmp_path):
    book = corpora.write_txt(tmp_path / "book.txt")
    for args, names in [
        (["submit", str(book), "--voice", "../x"], ["voice name '../x'"]),
        (["submit", str(book), "--voice", "[/bold]"], ["voice name '[/bold]'"]),
        (["status", "[/bold]"], ["job id '[/bold]'"]),
        (["status", "../../etc"], ["job id '../../etc'"]),
        (["cancel", "a/b"], ["job id 'a/b'"]),
        (["retry", "a b"], ["job id 'a b'"]),
        (["fetch", "", "--out", str(tmp_path / "f")], ["job id ''"]),
        (["fetch", "/", "--out", str(tmp_path / "f")], ["job id '/'"]),
        (["voice", "add", "../x", "--wav", "p.wav", "--text", "hi"], ["voice name '../x'"]),
        (["render", str(book), "--out", str(tmp_path / "r"), "--voice", "../x"], ["voice name '../x'"]),
        (["status", "nosuchjob"], ["nosuchjob"]),
        (["cancel", "nosuchjob"], ["nosuchjob"]),
    ]:
        one_line_error(cli(s3_env, *args), 2, *names)
    assert not (tmp_path / "f").exists()
    assert stored(s3_env) == []


def test_markup_in_names_and_paths_is_printed_as_written(s3_env, tmp_path, cluster_procs):
    """A job name and an --out path holding rich markup are text: status, jobs, fetch and render
    print them as written and exit 0."""
    book = corpora.write_txt(tmp_path / "book.txt")
    env = cluster_procs(s3_env)
    name = "[/bold][red]x[/red]"
    submit = cli(env, "submit", str(book), "--voice", "tone", "--name", name)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().splitlines()[-1]
    status = cli(env, "status", job_id, "--watch")
    assert status.returncode == 0 and name in status.stdout, status.stdout + status.stderr
    listing = cli(env, "jobs")
    assert listing.returncode == 0 and job_id in listing.stdout and "[/bold]" in listing.stdout, listing.stdout
    out = tmp_path / "[/bold]out"
    fetch = cli(env, "fetch", job_id, "--out", str(out))
    assert fetch.returncode == 0 and str(out) in fetch.stdout.replace("\n", ""), fetch.stdout + fetch.stderr
    assert (out / "manifest.json").is_file()
    render = cli({}, "render", str(book), "--out", str(tmp_path / "[red]r[/red]"))
    assert render.returncode == 0 and "[red]r[/red]" in render.stdout.replace("\n", ""), render.stdout + render.stderr


# --------------------------------------------------------------------------------------------------------
# Outages and bad settings


@pytest.fixture
def password_redis(tmp_path):
    """A second redis-server that wants a password (the session one has none)."""
    import shutil

    binary = shutil.which("redis-server") or services.missing("redis-server")
    port = services.free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--requirepass", "right-password", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    services.wait_until(lambda: redis.Redis(port=port, password="right-password").ping(), 10, "redis with a password")
    yield port
    proc.terminate()
    proc.wait(10)


def test_outages_and_bad_settings_are_one_line_and_leave_nothing(s3_env, seaweed, tmp_path, password_redis):
    book = corpora.write_txt(tmp_path / "book.txt")
    down = f"redis://127.0.0.1:{services.free_port()}/0"
    s3_down = f"http://127.0.0.1:{services.free_port()}"
    bucket = s3_env["VOXBATCH_STORAGE_URL"]
    rows = [
        # (environment changes, command, words in the line)
        ({"VOXBATCH_BROKER_URL": down}, ["submit", str(book), "--voice", "tone"], ["cannot reach Redis"]),
        ({"VOXBATCH_BROKER_URL": down}, ["status", "abc"], ["cannot reach Redis"]),
        ({"VOXBATCH_BROKER_URL": down}, ["jobs"], ["cannot reach Redis"]),
        ({"VOXBATCH_BROKER_URL": down}, ["cancel", "abc"], ["cannot reach Redis"]),
        ({"VOXBATCH_BROKER_URL": down}, ["retry", "abc"], ["abc"]),  # the spec is looked up first: none
        ({"VOXBATCH_BROKER_URL": f"redis://127.0.0.1:{password_redis}/0"}, ["submit", str(book), "--voice", "tone"],
         ["Redis refused the credentials"]),
        ({"VOXBATCH_BROKER_URL": f"redis://:hunter2@127.0.0.1:{password_redis}/0"}, ["jobs"],
         ["Redis refused the credentials"]),
        ({"VOXBATCH_BROKER_URL": "http://127.0.0.1:6379"}, ["jobs"], ["redis://"]),
        ({"VOXBATCH_STORAGE_URL": "ftp://x/y"}, ["submit", str(book), "--voice", "tone"], ["storage_url", "ftp://x/y"]),
        ({"VOXBATCH_S3_ENDPOINT": s3_down}, ["submit", str(book), "--voice", "tone"], ["cannot reach S3"]),
        ({"VOXBATCH_S3_ENDPOINT": s3_down}, ["fetch", "abc", "--out", str(tmp_path / "f")], ["cannot reach S3"]),
        ({"VOXBATCH_S3_ENDPOINT": "not a url"}, ["submit", str(book), "--voice", "tone"], ["not a url"]),
        ({"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, ["submit", str(book), "--voice", "tone"],
         ["S3 refused the credentials"]),
        ({"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}, ["submit", str(book), "--voice", "tone"],
         ["no S3 credentials"]),
        ({"VOXBATCH_STORAGE_URL": "s3://vb-no-such-bucket/p"}, ["submit", str(book), "--voice", "tone"],
         ["vb-no-such-bucket", "does not exist"]),
        ({"VOXBATCH_STORAGE_URL": "s3://vb-no-such-bucket/p"}, ["fetch", "abc", "--out", str(tmp_path / "f")],
         ["vb-no-such-bucket", "does not exist"]),
        ({"VOXBATCH_BATCH_SIZE": "0"}, ["submit", str(book), "--voice", "tone"], ["batch_size"]),
    ]
    jobs = RedisJobStore.from_url(s3_env["VOXBATCH_BROKER_URL"])
    before = jobs.r.zcard("vb:jobs")
    for change, args, names in rows:
        env = {**s3_env, **change}
        env = {k: v for k, v in env.items() if v != ""}
        proc = cli(env, *args)
        assert proc.returncode == 2, (change, args, proc.stdout, proc.stderr)
        one_line_error(proc, 2, *names)
        assert stored({**s3_env, "VOXBATCH_STORAGE_URL": bucket}) == [], (change, args)
    assert jobs.r.zcard("vb:jobs") == before
    assert not (tmp_path / "f").exists()


# --------------------------------------------------------------------------------------------------------
# Exit codes that tell the truth; failures users can see; a good job afterwards completes


@pytest.fixture
def cluster_procs(tmp_path):
    """Start a tone worker and an assembler on private queues for an environment; stopped after."""
    procs: list[services.VoxbatchProcess] = []

    def start(env: dict[str, str], worker: bool = True) -> dict[str, str]:
        tag = uuid.uuid4().hex[:8]
        env = {**BASE_ENV, **env, "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
               "VOXBATCH_ENGINE": "tone", "VOXBATCH_RETRY_BACKOFF_MS": "50", "PYTHONUNBUFFERED": "1"}
        for what in (["worker", "assembler"] if worker else ["assembler"]):
            p = services.VoxbatchProcess([what], env, tmp_path / f"{what}-{tag}.log").start()
            procs.append(p)
            p.wait_ready()
        return env

    yield start
    for p in procs:
        p.stop()


def test_exit_codes_cancel_fetch_and_a_failed_jobs_reason(s3_env, seaweed, tmp_path, cluster_procs):
    from voxbatch.worker.tone import FAIL_MARKER

    env = cluster_procs({**s3_env, "VOXBATCH_MAX_ATTEMPTS": "1"})
    # A job with a failing segment: `status --watch` exits 1 and shows the segment's error.
    bad = tmp_path / "bad.md"
    bad.write_text(f"# One\n\nA fine sentence.\n\n# Two\n\nThis one breaks {FAIL_MARKER} here.\n", encoding="utf-8")
    job_id = cli(env, "submit", str(bad), "--voice", "tone").stdout.strip().splitlines()[-1]
    watch = cli(env, "status", job_id, "--watch")
    assert watch.returncode == 1 and "completed_with_errors" in watch.stdout and "asks the tone engine to fail" in watch.stdout
    # Cancel of a finished job says so and exits 1; nothing changes.
    line = one_line_error(cli(env, "cancel", job_id), 1, job_id, "already finished")
    assert "completed_with_errors" in line
    # Producer and workers on different storage: the job fails, and `status` says why.
    other = {**env, "VOXBATCH_STORAGE_URL": f"s3://{seaweed.new_bucket()}/elsewhere"}
    book = corpora.write_txt(tmp_path / "book.txt")
    lost = cli(other, "submit", str(book), "--voice", "tone").stdout.strip().splitlines()[-1]
    watch = cli(env, "status", lost, "--watch", timeout=180)
    assert watch.returncode == 1 and "failed" in watch.stdout and "reason" in watch.stdout, watch.stdout
    assert "no spec" in watch.stdout and "same storage" in watch.stdout

    # And after all of the above, a good job completes: status --watch exits 0.
    good = cli(env, "submit", str(book), "--voice", "tone")
    assert good.returncode == 0, good.stderr
    done = cli(env, "status", good.stdout.strip().splitlines()[-1], "--watch")
    assert done.returncode == 0 and "completed" in done.stdout, done.stdout + done.stderr


def test_fetch_skips_a_bad_key_with_a_warning_and_fetches_the_rest(tmp_path):
    """A stored key that cannot be fetched safely (here a name with a terminal escape in it) is skipped
    with a warning naming it; everything else arrives; exit 1."""
    root = tmp_path / "store"
    job = root / "jobs" / "job1"
    (job / "chapters").mkdir(parents=True)
    (job / "manifest.json").write_text("{}")
    (job / "chapters" / "0000.wav").write_bytes(b"RIFF")
    (job / "evil\x1b[2J.wav").write_bytes(b"RIFF")
    proc = cli({"VOXBATCH_STORAGE_URL": root.as_uri()}, "fetch", "job1", "--out", str(tmp_path / "got"))
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    (warning,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert warning.startswith("warning: skipped") and "evil\\x1b[2J.wav" in warning and "\x1b" not in warning
    assert "fetched 2 file(s)" in proc.stdout and "skipped 1" in proc.stdout
    assert (tmp_path / "got" / "manifest.json").is_file() and (tmp_path / "got" / "chapters" / "0000.wav").is_file()
    assert sorted(p.name for p in (tmp_path / "got").rglob("*")) == ["0000.wav", "chapters", "manifest.json"]


def test_status_watch_says_when_no_worker_is_alive(tmp_path):
    redis_server = services.start_redis(tmp_path)
    try:
        env = {"VOXBATCH_BROKER_URL": redis_server.url, "VOXBATCH_STORAGE_URL": (tmp_path / "s").as_uri(),
               "VOXBATCH_STALLED_AFTER_S": "1", "VOXBATCH_RENDER_QUEUE": "nobody-listens"}
        job_id = cli(env, "submit", str(corpora.write_txt(tmp_path / "book.txt")), "--voice", "tone").stdout.split()[-1]
        proc = subprocess.Popen([*CLI, "status", job_id, "--watch"], env={**BASE_ENV, **env}, cwd=services.REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=as_in_a_terminal)
        try:
            out, _ = proc.communicate(timeout=8)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            out, _ = proc.communicate(timeout=10)
        assert "no render worker is alive" in out and "voxbatch worker" in out, out
        assert proc.returncode == 130
        listing = cli(env, "jobs")
        assert "no render worker is alive" in listing.stdout.replace("\n", " ") or "no render worker" in listing.stdout
    finally:
        redis_server.stop()


def test_long_job_ids_are_never_cut_in_jobs(tmp_path):
    redis_server = services.start_redis(tmp_path)
    try:
        jobs = RedisJobStore.from_url(redis_server.url)
        long_id = "job-" + "x" * 60
        jobs.create(long_id, "a very long job name " * 4, "tone", "wav", 3, time.time())
        proc = cli({"VOXBATCH_BROKER_URL": redis_server.url, "COLUMNS": "50"}, "jobs")
        assert proc.returncode == 0 and long_id in proc.stdout, proc.stdout
    finally:
        redis_server.stop()


# --------------------------------------------------------------------------------------------------------
# Voice prompts


@pytest.mark.parametrize("wav,text,names", [
    ("nan", "A short prompt.", ["nan.wav", "NaN"]),
    ("ok", "   ", ["empty transcript"]),
    ("ok", "word " * 5000, ["transcript of", "positions"]),
])
def test_voice_add_refuses_unusable_prompts(tiny_model_dir, tmp_path, wav, text, names):
    import soundfile as sf

    audio = 0.3 * np.sin(2 * np.pi * 220 * np.arange(24000 * 2) / 24000).astype(np.float32)
    if wav == "nan":
        audio[100] = np.nan
    path = tmp_path / f"{wav}.wav"
    sf.write(path, audio, 24000, subtype="FLOAT")
    env = {"VOXBATCH_STORAGE_URL": (tmp_path / "s").as_uri()}
    one_line_error(cli(env, "voice", "add", "v1", "--wav", str(path), "--text", text, "--model-dir", str(tiny_model_dir)),
                   2, *names)
    assert not (tmp_path / "s" / "voices").exists()


# --------------------------------------------------------------------------------------------------------
# render: fails fast, stops on Ctrl-C within 2 s, resumes with only the missing segments


def test_render_refuses_a_missing_voice_at_once(tmp_path):
    book = corpora.write_txt(tmp_path / "book.txt")
    t0 = time.monotonic()
    one_line_error(cli({}, "render", str(book), "--out", str(tmp_path / "out"), "--voice", "nobody"), 2,
                   "voice 'nobody' not found")
    assert time.monotonic() - t0 < 30
    assert not list((tmp_path / "out").rglob("*.wav"))


def test_render_interrupted_then_resumed_renders_only_the_missing_segments(tmp_path):
    book = corpora.long_book(tmp_path / "long.txt", chapters=2, sentences=30)
    out = tmp_path / "out"
    args = [*CLI, "render", str(book), "--out", str(out)]
    slow = {**BASE_ENV, "VOXBATCH_TONE_RTF": "0.05", "VOXBATCH_UPLOAD_THREADS": "1"}
    proc = subprocess.Popen(args, env=slow, cwd=services.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_in_a_terminal)

    def segments() -> dict[Path, int]:
        return {p: p.stat().st_mtime_ns for p in out.glob("jobs/*/segments/*/*.wav")}

    services.wait_until(lambda: len(segments()) >= 3 or proc.poll() is not None, 120, "three segments stored")
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=10)
    assert time.monotonic() - t0 < 2.0, f"took {time.monotonic() - t0:.1f}s to stop"
    assert proc.returncode == 130 and "interrupted" in err and "--resume" in err and "Traceback" not in err, err
    before = segments()
    (job_dir,) = (out / "jobs").iterdir()
    total = len(__import__("json").loads((job_dir / "job.json").read_text())["segments"])
    assert 3 <= len(before) < total

    again = subprocess.run(args, env=BASE_ENV, cwd=services.REPO, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert f"resuming job {job_dir.name}: {len(before)} of {total} segments already rendered" in again.stderr
    after = segments()
    assert len(after) == total
    assert {p: after[p] for p in before} == before  # what the first run stored was not rendered again
    assert (job_dir / "manifest.json").is_file()


@pytest.mark.parametrize("settings, names", [
    ({"VOXBATCH_VLLM_ENGINES": "2", "VOXBATCH_VLLM_ENGINE_PROCESS": "false"}, ["vllm_engines", "own process"]),
    ({"VOXBATCH_VLLM_ENGINES": "8", "VOXBATCH_ENGINE_MAX_BATCH": "4"}, ["vllm_engines", "engine_max_batch"]),
])
def test_a_worker_with_vllm_engines_that_cannot_run_is_refused_before_it_starts(settings, names):
    """Several vLLM engines each need their own core process and a row: `voxbatch worker` says so in one
    line and exits 2 before any worker process starts (not a worker failing at its engine, restarted in a loop)."""
    proc = cli({**settings, "VOXBATCH_LLM_BACKEND": "vllm"}, "worker", timeout=60)
    one_line_error(proc, 2, *names)


def test_a_worker_given_an_incomplete_model_folder_is_refused_before_it_starts(tmp_path):
    """`voxbatch worker --model-dir` checks the folder itself: one line naming what is missing, exit 2,
    before any worker process starts."""
    proc = cli({}, "worker", "--engine", "cosyvoice2", "--model-dir", str(tmp_path), timeout=60)
    one_line_error(proc, 2, str(tmp_path), "cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt")


def unloadable_model_dir(folder: Path) -> Path:
    """Every file the worker's check looks for, none of them loadable: it fails only in the worker
    process, while the engine is built."""
    folder.mkdir()
    for name in ("llm.pt", "flow.pt", "hift.pt"):
        (folder / name).write_bytes(b"")
    (folder / "cosyvoice2.yaml").write_text("llm: [\n")
    (folder / "CosyVoice-BlankEN").mkdir()
    return folder


def test_a_worker_that_cannot_build_its_engine_ends_with_one_line_and_is_not_restarted(tmp_path):
    """A model folder that passes the launcher's check but cannot be loaded: each worker process logs
    one `cannot start` line naming the folder and exits 2; the launcher stops the other, says why, does
    not restart either, and exits 2 (every restart would meet the same folder). No traceback, and the
    broker URL's password is in no line."""
    folder = unloadable_model_dir(tmp_path / "model")
    env = {"VOXBATCH_BROKER_URL": "redis://:hunter2@127.0.0.1:1/0"}
    began = time.monotonic()
    proc = cli(env, "worker", "--gpus", "0,1", "--engine", "cosyvoice2", "--model-dir", str(folder), timeout=120)
    everything = proc.stdout + proc.stderr
    assert proc.returncode == 2, everything
    assert "Traceback" not in everything and "hunter2" not in everything, everything
    starts = [ln for ln in proc.stderr.splitlines() if "cannot start:" in ln]
    assert starts and all(str(folder) in ln for ln in starts), everything
    assert "not restarting" in proc.stderr and "restarting in" not in proc.stderr, everything
    assert time.monotonic() - began < 60, everything


@pytest.mark.parametrize("settings, names", [
    ({"VOXBATCH_ENGINE_GPU_MEMORY_GIB": "lots"}, ["bad Settings", "engine_gpu_memory_gib"]),
    ({"VOXBATCH_ENGINE": "cosyvoice2"}, ["cannot start", "incomplete", "cosyvoice2.yaml"]),
])
def test_a_worker_process_that_cannot_start_exits_2_with_one_line(tmp_path, settings, names):
    """The container entry point (`python -m voxbatch.worker.main`, no launcher in front): a bad setting
    or a model folder it cannot use is one critical line naming it and exit 2, no traceback, no secret."""
    (tmp_path / "model").mkdir()
    env = {**BASE_ENV, **NO_AMBIENT_AWS, "VOXBATCH_MODEL_DIR": str(tmp_path / "model"),
           "VOXBATCH_BROKER_URL": "redis://:hunter2@127.0.0.1:1/0", **settings}
    proc = subprocess.run([sys.executable, "-m", "voxbatch.worker.main"], env=env, cwd=services.REPO,
                          capture_output=True, text=True, timeout=120)
    everything = proc.stdout + proc.stderr
    assert proc.returncode == 2, everything
    assert "Traceback" not in everything and "hunter2" not in everything, everything
    critical = [ln for ln in everything.splitlines() if " CRITICAL " in ln]
    assert len(critical) == 1 and all(n in critical[0] for n in names), everything
