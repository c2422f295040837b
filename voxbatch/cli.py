"""The `voxbatch` command: thin typer commands that build one Settings and call library code.

Options default to None and fall back to Settings (environment), so no default is restated here.
Heavy imports (torch, the engine) happen inside the commands that need them: the producer commands
run on machines without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from voxbatch.settings import Settings, load_settings

app = typer.Typer(help="voxbatch: distributed batch text-to-speech (CosyVoice2) to S3-compatible storage.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
voice_app = typer.Typer(help="Voice profiles (prompt audio + transcript).", no_args_is_help=True)
model_app = typer.Typer(help="Model directories.", no_args_is_help=True)
app.add_typer(voice_app, name="voice")
app.add_typer(model_app, name="model")
console = Console()
err = Console(stderr=True)


def _fail(message: str) -> None:
    """One line on stderr (newlines folded, never wrapped, brackets shown as written), exit code 2."""
    err.print(f"[red]error:[/red] {escape(' '.join(message.split()))}", soft_wrap=True)
    raise typer.Exit(2)


# Bad input (corpus, settings, model directory: `ModelDirError` is a ValueError) or a missing file:
# one line, no traceback.
INPUT_ERRORS = (ValueError, OSError)


def _settings(**overrides) -> Settings:
    try:
        return load_settings(**overrides)
    except Exception as e:  # noqa: BLE001 - show pydantic's field error, never a traceback with values
        _fail(f"bad settings: {e}")
        raise


# Options shared by `submit` and `render` (multi-voice scripts, lexicons, reuse of stored audio).
CAST_HELP = 'speakers of a script: "Alice=voiceA,Bob=voiceB"; a paragraph starting "Alice:" is read by voiceA'
LEXICON_HELP = "pronunciation lexicon: .tsv (term<TAB>replacement) or W3C .pls alias entries"
NO_REUSE_HELP = "render every segment, even those whose audio is already stored (content cache)"


def _script_options(cast: Optional[str], lexicon: Optional[Path], no_reuse: bool) -> dict:
    from voxbatch.producer.cast import parse_cast

    try:
        return {"cast": parse_cast(cast), "lexicon": lexicon, "reuse": not no_reuse}
    except INPUT_ERRORS as e:
        _fail(str(e))
        raise


def _jobs(settings: Settings):
    from voxbatch.jobstate import RedisJobStore

    return RedisJobStore.from_url(settings.broker_url)


FORMAT_HELP = "segment (and chapter) audio: wav|flac|ogg|opus|mp3|m4a"
PRESET_HELP = ("mastering of chapters: acx (MP3 192k CBR 44.1 kHz mono, RMS -23..-18 dB, peaks <= -3 dBFS, room "
               "tone, credits) | podcast (-16 LUFS, true peak <= -1 dBTP) | none (as assembled)")
TITLE_HELP = "book title for tags, the m4b and credits (default: EPUB dc:title / markdown H1)"
AUTHOR_HELP = "book author (default: EPUB dc:creator)"
ALL_SPINE_HELP = "EPUB: also read pages readers skip (linear=\"no\", absent from the TOC: covers, ads)"


@app.command()
def submit(path: Path, voice: str = typer.Option(..., help="voice profile name ('tone' for the tone engine)"),
           name: Optional[str] = typer.Option(None, help="job name (default: file name)"),
           format: Optional[str] = typer.Option(None, "--format", help=FORMAT_HELP),
           preset: Optional[str] = typer.Option(None, "--preset", help=PRESET_HELP),
           title: Optional[str] = typer.Option(None, help=TITLE_HELP),
           author: Optional[str] = typer.Option(None, help=AUTHOR_HELP),
           epub_all_spine: Optional[bool] = typer.Option(None, "--epub-all-spine", help=ALL_SPINE_HELP),
           queue: Optional[str] = typer.Option(None, help="render queue (default: settings)"),
           watch: bool = typer.Option(False, help="show progress until the job finishes"),
           max_tokens: Optional[int] = typer.Option(None, help="cap on speech tokens per segment"),
           cast: Optional[str] = typer.Option(None, help=CAST_HELP),
           lexicon: Optional[Path] = typer.Option(None, help=LEXICON_HELP),
           no_reuse: bool = typer.Option(False, "--no-reuse", help=NO_REUSE_HELP),
           model_dir: Optional[Path] = typer.Option(
               None, help="CosyVoice2 model directory: segments are measured with its tokenizer (only the "
                          "tokenizer folder is read; without a model dir, or for the 'tone' voice, a "
                          "tokenizer-free estimate is used)")):
    """Read, segment and enqueue a corpus (.txt, .md, .epub, a folder, or a .jsonl/.csv line-item batch);
    prints the job id."""
    from voxbatch.producer.submit import plan_job, submit_job
    from voxbatch.models import SynthesisParams
    from voxbatch.storage import open_storage

    settings = _settings(output_format=format, model_dir=str(model_dir) if model_dir else None, preset=preset,
                         epub_all_spine=epub_all_spine)
    options = _script_options(cast, lexicon, no_reuse)
    try:
        spec = plan_job(path, voice, settings, name=name, params=SynthesisParams(max_tokens=max_tokens),
                        title=title, author=author, **options)
        job_id = submit_job(spec, settings, open_storage(settings), queue)
    except INPUT_ERRORS as e:
        _fail(str(e))
    console.print(job_id, highlight=False)
    if watch:
        from voxbatch.producer.control import watch as watch_job

        watch_job(_jobs(settings), job_id, err)


@app.command()
def status(job: str, watch: bool = typer.Option(False, help="progress bar until the job finishes")):
    """Progress of a job: segments, audio seconds, failures."""
    from voxbatch.producer.control import JobNotFound, get_status, status_table
    from voxbatch.producer.control import watch as watch_job

    from voxbatch.storage import open_storage

    settings = _settings()
    jobs = _jobs(settings)
    try:
        s = watch_job(jobs, job, console) if watch else get_status(jobs, job, open_storage(settings))
    except JobNotFound as e:
        _fail(str(e.args[0]))
    console.print(status_table(s))


@app.command()
def cancel(job: str):
    """Stop a job: queued segments are skipped, stored ones are kept."""
    if _jobs(_settings()).cancel(job) < 0:
        _fail(f"no job {job!r}")
    console.print(f"cancelled {job}")


@app.command()
def retry(job: str, queue: Optional[str] = typer.Option(None, help="render queue")):
    """Re-enqueue only the failed or missing segments of a job (rebuilt from storage if Redis lost it)."""
    from voxbatch.producer.control import JobNotFound, retry_job
    from voxbatch.producer.submit import SubmitError
    from voxbatch.storage import open_storage

    settings = _settings()
    try:
        n = retry_job(_jobs(settings), open_storage(settings), settings, job, queue)
    except (JobNotFound, SubmitError) as e:
        _fail(str(e.args[0]))
    console.print(f"re-enqueued {n} segment(s) of {job}")


@app.command()
def fetch(job: str, out: Path = typer.Option(..., help="folder to download the job's files into")):
    """Download every file of a job (segments, chapters, manifest, subtitles, book)."""
    from voxbatch.producer.assemble import fetch_job
    from voxbatch.storage import open_storage

    n = fetch_job(open_storage(_settings()), job, out)
    if n == 0:
        _fail(f"job {job!r}: nothing stored")
    console.print(f"fetched {n} file(s) into {out}")


@app.command("jobs")
def list_jobs(limit: int = typer.Option(50, help="most jobs to list")):
    """List jobs, newest first."""
    from voxbatch.producer.control import jobs_table

    console.print(jobs_table(_jobs(_settings()), limit))


@app.command()
def worker(gpus: Optional[str] = typer.Option(None, help="comma-separated GPU ids, one process each"),
           engine: Optional[str] = typer.Option(None, help="tone|cosyvoice2"),
           llm_backend: Optional[str] = typer.Option(None, help="torch|vllm"),
           model_dir: Optional[Path] = typer.Option(None, help="CosyVoice2 model directory"),
           concurrency: Optional[int] = typer.Option(None, help="render tasks at once per process"),
           queues: Optional[str] = typer.Option(None, help="queues to consume (default: render)")):
    """Start GPU workers: one pinned Celery process per GPU, engine warmed before the first task."""
    from voxbatch.worker.launcher import run_workers

    flags = {"engine": engine, "llm_backend": llm_backend, "model_dir": str(model_dir) if model_dir else None}
    _settings(**flags)  # validate here, before any process starts
    env = {f"VOXBATCH_{k.upper()}": v for k, v in flags.items() if v is not None}
    ids = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else None
    raise typer.Exit(run_workers(ids, concurrency, queues, env_overrides=env))


@app.command()
def assembler(concurrency: int = typer.Option(2, help="assemble tasks at once")):
    """Start the CPU assembler: chapters, manifest, subtitles and m4b once a job's last segment lands;
    also sweeps for segments nothing will finish and re-enqueues them."""
    import voxbatch.producer.tasks  # noqa: F401 - registers voxbatch.assemble
    from voxbatch.broker import install_heartbeat
    from voxbatch.celery_app import app as celery_app
    from voxbatch.celery_app import configure_celery
    from voxbatch.producer.sweeper import start_sweeper
    from voxbatch.storage import open_storage

    settings = _settings()
    configure_celery(settings)
    install_heartbeat(settings.broker_url, settings.task_heartbeat_s)
    start_sweeper(_jobs(settings), open_storage(settings), settings)
    celery_app.worker_main(["worker", "--pool", "threads", "--concurrency", str(concurrency), "--queues",
                            settings.assemble_queue, "--hostname", "voxbatch-assembler@%h",
                            "--without-gossip", "--without-mingle", "--loglevel", "INFO"])


@app.command()
def render(path: Path, out: Path = typer.Option(..., help="output folder"),
           voice: str = typer.Option("tone", help="voice profile name (stored under OUT/voices/)"),
           engine: Optional[str] = typer.Option(None, help="tone|cosyvoice2"),
           llm_backend: Optional[str] = typer.Option(None, help="torch|vllm"),
           model_dir: Optional[Path] = typer.Option(
               None, help="CosyVoice2 model directory; its tokenizer also measures the segments (without "
                          "one, or with the tone engine, a tokenizer-free estimate is used)"),
           format: Optional[str] = typer.Option(None, "--format", help=FORMAT_HELP),
           preset: Optional[str] = typer.Option(None, "--preset", help=PRESET_HELP),
           title: Optional[str] = typer.Option(None, help=TITLE_HELP),
           author: Optional[str] = typer.Option(None, help=AUTHOR_HELP),
           epub_all_spine: Optional[bool] = typer.Option(None, "--epub-all-spine", help=ALL_SPINE_HELP),
           max_tokens: Optional[int] = typer.Option(None, help="cap on speech tokens per segment"),
           cast: Optional[str] = typer.Option(None, help=CAST_HELP),
           lexicon: Optional[Path] = typer.Option(None, help=LEXICON_HELP),
           no_reuse: bool = typer.Option(False, "--no-reuse", help=NO_REUSE_HELP)):
    """Render a corpus in this process into a local folder (no Redis, no S3): the embedded default."""
    from voxbatch.models import SynthesisParams
    from voxbatch.embedded import render_local

    settings = _settings(engine=engine, llm_backend=llm_backend, model_dir=str(model_dir) if model_dir else None,
                         output_format=format, storage_url=out.resolve().as_uri(), preset=preset,
                         epub_all_spine=epub_all_spine)
    options = _script_options(cast, lexicon, no_reuse)
    try:
        manifest = render_local(path, out, voice, settings, params=SynthesisParams(max_tokens=max_tokens),
                                title=title, author=author, **options)
    except INPUT_ERRORS as e:
        _fail(str(e))
    total = sum(c.duration_s for c in manifest.chapters) + sum(i.duration_s for i in manifest.items)
    console.print(f"job {manifest.job_id}: {len(manifest.segments)} segments ({manifest.reused} reused, "
                  f"{len(manifest.segments) - manifest.reused} rendered), {total:.1f} s of audio, "
                  f"state {manifest.state} -> {escape(str(out / 'jobs' / manifest.job_id))}", highlight=False, soft_wrap=True)
    _exit_on_qc_failures(manifest)


def _exit_on_qc_failures(manifest) -> None:
    """A preset was asked and some chapter file is outside it: say which, exit 1 (never shipped silently)."""
    failing = [row.key for row in manifest.qc if not row.passed]
    if failing:
        err.print(f"QC: {len(failing)} of {len(manifest.qc)} file(s) fail preset {manifest.preset} "
                  f"(voxbatch qc {manifest.job_id})", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command()
def qc(job: str, out: Optional[Path] = typer.Option(
        None, help="the folder `voxbatch render --out` wrote (default: the storage URL from settings)")):
    """QC of a mastered job: levels of every chapter file and each rule of its preset; exit 1 if one fails."""
    from voxbatch.producer.qc import failure_lines, load_manifest, qc_table
    from voxbatch.storage import open_storage

    settings = _settings(storage_url=out.resolve().as_uri() if out else None)
    try:
        manifest = load_manifest(open_storage(settings), job)
    except KeyError:
        _fail(f"job {job!r}: no manifest in {settings.storage_url} (not assembled yet, or another storage)")
    except INPUT_ERRORS as e:
        _fail(f"job {job!r}: unreadable manifest: {e}")
    if not manifest.qc:
        console.print(f"job {escape(job)}: preset {manifest.preset}, no QC rules to check")
        return
    console.print(qc_table(manifest))
    failures = failure_lines(manifest)
    for line in failures:
        console.print(escape(line), soft_wrap=True, highlight=False)
    if failures:
        err.print(f"{len(failures)} of {len(manifest.qc)} file(s) fail preset {manifest.preset}")
        raise typer.Exit(1)


@voice_app.command("add")
def voice_add(name: str, wav: Path = typer.Option(..., help="prompt audio (≤ 30 s, ≥ 16 kHz)"),
              text: str = typer.Option(..., help="transcript of the prompt audio"),
              model_dir: Optional[Path] = typer.Option(None, help="CosyVoice2 model directory (ONNX frontend)")):
    """Create a voice profile from a prompt recording and store it."""
    from voxbatch.producer.voice import create_voice
    from voxbatch.storage import open_storage
    from voxbatch.voice import save_voice

    settings = _settings(model_dir=str(model_dir) if model_dir else None)
    if not settings.model_dir:
        _fail("voice add needs the model directory: --model-dir or VOXBATCH_MODEL_DIR")
    try:
        profile = create_voice(settings.model_dir, name, wav, text)
    except INPUT_ERRORS as e:
        _fail(str(e))
    save_voice(open_storage(settings), profile)
    console.print(f"stored voice {name!r}")


@model_app.command("make-tiny")
def model_make_tiny(out: Path, seed: int = typer.Option(0, help="seed of the random weights"),
                    force: bool = typer.Option(False, help="write into a non-empty folder")):
    """Write a tiny random CosyVoice2 model in the official layout (tests and demos; it makes noise)."""
    from voxbatch.worker.cosyvoice2.tiny import make_tiny

    try:
        path = make_tiny(out, seed=seed, overwrite=force)
    except (FileExistsError, OSError) as e:
        _fail(str(e))
    console.print(f"wrote a tiny random CosyVoice2 model to {path}")


if __name__ == "__main__":
    app()
