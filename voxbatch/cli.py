"""The `voxbatch` command: thin typer commands that build one Settings and call library code.

Options default to None and fall back to Settings (environment), so no default is restated here.
Heavy imports (torch, the engine) happen inside the commands that need them: the producer commands
run on machines without torch.

Errors: every command runs under `main`, which turns any exception into one escaped line on stderr
(`explain` maps bad input, Redis, S3 and broker failures to a sentence naming the file, name or
service) and an exit code: 0 only when everything asked for was done, 1 when a job finished with
failed segments (or a fetch skipped files, or a cancel found the job already finished), 2 for bad
input or an unreachable service, 130 for Ctrl-C. A new command gets all of this for free. Anything a
user typed or a corpus held is escaped before rich prints it (`[/bold]` in a job name is text).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from voxbatch.settings import Settings, load_settings, validation_problems

app = typer.Typer(help="voxbatch: distributed batch text-to-speech (CosyVoice2) to S3-compatible storage.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
voice_app = typer.Typer(help="Voice profiles (prompt audio + transcript).", no_args_is_help=True)
model_app = typer.Typer(help="Model directories.", no_args_is_help=True)
app.add_typer(voice_app, name="voice")
app.add_typer(model_app, name="model")
console = Console()
err = Console(stderr=True)


EXIT_OK, EXIT_FAILURES, EXIT_BAD, EXIT_INTERRUPTED = 0, 1, 2, 130


def _line(message: str) -> str:
    """One line (newlines folded), escaped for rich."""
    return escape(" ".join(str(message).split()))


def _fail(message: str, code: int = EXIT_BAD) -> None:
    """One line on stderr (newlines folded, never wrapped, brackets shown as written), then exit."""
    err.print(f"[red]error:[/red] {_line(message)}", soft_wrap=True)
    raise typer.Exit(code)


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {_line(message)}", soft_wrap=True)


def explain(e: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached the top of a command."""
    import redis
    from pydantic import ValidationError

    from voxbatch.storage import StorageError

    if isinstance(e, ValidationError):
        return EXIT_BAD, validation_problems(e)
    if isinstance(e, redis.AuthenticationError) or (
            isinstance(e, redis.ResponseError) and str(e).startswith(("NOAUTH", "WRONGPASS"))):
        return EXIT_BAD, f"Redis refused the credentials in VOXBATCH_BROKER_URL ({e})"
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
        return EXIT_BAD, f"cannot reach Redis (VOXBATCH_BROKER_URL): {e}"
    if isinstance(e, redis.RedisError):
        return EXIT_BAD, f"Redis error: {e}"
    s3 = _explain_s3(e)
    if s3 is not None:
        return EXIT_BAD, s3
    if type(e).__module__.startswith(("kombu", "celery", "amqp")):
        return EXIT_BAD, f"cannot use the broker (VOXBATCH_BROKER_URL): {type(e).__name__}: {e}"
    if isinstance(e, (ValueError, StorageError)):  # CorpusError, SubmitError, BadName, ModelDirError...
        return EXIT_BAD, str(e)
    if isinstance(e, LookupError):  # VoiceNotFoundError, JobNotFound
        return EXIT_BAD, str(e.args[0]) if e.args else type(e).__name__
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        return EXIT_BAD, f"{where}{e.strerror or e}"
    return EXIT_BAD, f"unexpected {type(e).__name__}: {e} (a bug; VOXBATCH_DEBUG=1 shows the traceback)"


def _explain_s3(e: BaseException) -> str | None:
    try:
        from botocore import exceptions as bx
    except ImportError:
        return None
    if isinstance(e, bx.NoCredentialsError):
        return "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return f"cannot reach S3 (VOXBATCH_S3_ENDPOINT): {e}"
    if isinstance(e, bx.ClientError):
        error = e.response.get("Error", {})
        code, bucket = error.get("Code", "?"), error.get("BucketName", "")
        if code == "NoSuchBucket":
            return f"S3 bucket {bucket!r} does not exist (VOXBATCH_STORAGE_URL)"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
            return f"S3 refused the credentials ({code}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        return f"S3 error {code}: {error.get('Message', e)}"
    if isinstance(e, bx.BotoCoreError):
        return f"S3: {e}"
    return None


def main() -> None:
    """The console script: run the command, turning any error into one line and a true exit code."""
    import click

    try:
        code = app(standalone_mode=False)
    except click.ClickException as e:  # usage errors: click's own message, exit 2
        e.show()
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the one place errors become messages (see module doc)
        code, message = explain(e)
        err.print(f"[red]error:[/red] {_line(message)}", soft_wrap=True)
        if _debug():
            err.print_exception()
        sys.exit(code)
    sys.exit(code if isinstance(code, int) else EXIT_OK)


def _debug() -> bool:
    try:
        return load_settings().debug
    except Exception:  # noqa: BLE001 - settings that do not load cannot ask for a traceback
        return False


# Bad input (corpus, settings, model directory: `ModelDirError` is a ValueError) or a missing file: a
# command that wants its own wording for them catches these; anything else reaches `main`.
INPUT_ERRORS = (ValueError, OSError)


# Options shared by `submit` and `render` (multi-voice scripts, lexicons, reuse of stored audio).
CAST_HELP = 'speakers of a script: "Alice=voiceA,Bob=voiceB"; a paragraph starting "Alice:" is read by voiceA'
LEXICON_HELP = "pronunciation lexicon: .tsv (term<TAB>replacement) or W3C .pls alias entries"
NO_REUSE_HELP = "render every segment, even those whose audio is already stored (content cache)"


def _script_options(cast: Optional[str], lexicon: Optional[Path], no_reuse: bool) -> dict:
    from voxbatch.producer.cast import parse_cast

    return {"cast": parse_cast(cast), "lexicon": lexicon, "reuse": not no_reuse}


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

    settings = load_settings(output_format=format, model_dir=str(model_dir) if model_dir else None, preset=preset,
                         epub_all_spine=epub_all_spine)
    options = _script_options(cast, lexicon, no_reuse)
    with _stage_bar() as progress:
        spec = plan_job(path, voice, settings, name=name, params=SynthesisParams(max_tokens=max_tokens),
                        title=title, author=author, progress=progress, **options)
        job_id = submit_job(spec, settings, open_storage(settings), queue, progress=progress)
    console.print(job_id, highlight=False, markup=False)
    if watch:
        from voxbatch.producer.control import watch as watch_job

        raise typer.Exit(_job_exit(watch_job(_jobs(settings), job_id, err, settings)))


class _stage_bar:
    """A transient bar on stderr for the stages of a long submit ("segment" chapters, "enqueue"
    segments); a small corpus is done before the bar draws."""

    def __enter__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeRemainingColumn(), console=err, transient=True, disable=not err.is_terminal)
        self.bar.start()
        self.tasks: dict[str, int] = {}
        return self.update

    def update(self, stage: str, done: int, total: int) -> None:
        if self.bar.disable:
            return
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=total)
        self.bar.update(self.tasks[stage], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        self.bar.stop()


def _job_exit(status) -> int:
    """Exit code for a job that was followed to its end: 0 completed, 1 anything less."""
    return EXIT_OK if status.state == "completed" else EXIT_FAILURES


@app.command()
def status(job: str, watch: bool = typer.Option(False, help="progress bar until the job finishes")):
    """Progress of a job: segments, audio seconds, failures."""
    from voxbatch.producer.control import get_status, status_table
    from voxbatch.producer.control import watch as watch_job

    from voxbatch.keys import check_name
    from voxbatch.storage import open_storage

    check_name("job id", job)
    settings = load_settings()
    jobs = _jobs(settings)
    s = watch_job(jobs, job, console, settings) if watch else get_status(jobs, job, open_storage(settings))
    console.print(status_table(s, jobs))
    if watch:
        raise typer.Exit(_job_exit(s))


@app.command()
def cancel(job: str):
    """Stop a job: queued segments are skipped, stored ones are kept."""
    from voxbatch.keys import check_name

    jobs = _jobs(load_settings())
    outcome = jobs.cancel(check_name("job id", job))
    if outcome < 0:
        _fail(f"no job {job!r} in Redis")
    if outcome == 0:
        _fail(f"job {job!r} already finished ({jobs.state(job)}): nothing to cancel", EXIT_FAILURES)
    console.print(f"cancelled {escape(job)}")


@app.command()
def retry(job: str, queue: Optional[str] = typer.Option(None, help="render queue")):
    """Re-enqueue only the failed or missing segments of a job (rebuilt from storage if Redis lost it)."""
    from voxbatch.keys import check_name
    from voxbatch.producer.control import retry_job
    from voxbatch.storage import open_storage

    settings = load_settings()
    n = retry_job(_jobs(settings), open_storage(settings), settings, check_name("job id", job), queue)
    console.print(f"re-enqueued {n} segment(s) of {escape(job)}")


@app.command()
def fetch(job: str, out: Path = typer.Option(..., help="folder to download the job's files into")):
    """Download every file of a job (segments, chapters, manifest, subtitles, book)."""
    from voxbatch.producer.assemble import fetch_job
    from voxbatch.storage import open_storage

    from voxbatch.keys import check_name

    storage = open_storage(load_settings())
    storage.check()
    n, skipped = fetch_job(storage, check_name("job id", job), out)
    for problem in skipped:
        _warn(problem)
    if n == 0 and not skipped:
        _fail(f"job {job!r}: nothing stored at {storage.describe(f'jobs/{job}/')}")
    console.print(f"fetched {n} file(s) into {escape(str(out))}" + (f", skipped {len(skipped)}" if skipped else ""),
                  soft_wrap=True)
    if skipped:
        raise typer.Exit(EXIT_FAILURES)


@app.command("jobs")
def list_jobs(limit: int = typer.Option(50, help="most jobs to list")):
    """List jobs, newest first."""
    from voxbatch.producer.control import jobs_table

    settings = load_settings()
    console.print(jobs_table(_jobs(settings), limit, settings), crop=False)  # ids stay whole past the width


@app.command()
def worker(gpus: Optional[str] = typer.Option(None, help="comma-separated GPU ids, one process each"),
           engine: Optional[str] = typer.Option(None, help="tone|cosyvoice2"),
           llm_backend: Optional[str] = typer.Option(None, help="torch|vllm"),
           model_dir: Optional[Path] = typer.Option(None, help="CosyVoice2 model directory"),
           concurrency: Optional[int] = typer.Option(None, help="render tasks at once per process"),
           queues: Optional[str] = typer.Option(None, help="queues to consume (default: render)")):
    """Start GPU workers: one pinned Celery process per GPU, engine warmed before the first task."""
    from voxbatch.celery_app import shutdown_window_s
    from voxbatch.worker.launcher import EXIT_MARGIN_S, run_workers
    from voxbatch.worker.main import STOP_GRACE_S
    from voxbatch.worker.mps import MpsError

    flags = {"engine": engine, "llm_backend": llm_backend, "model_dir": str(model_dir) if model_dir else None}
    settings = load_settings(**flags)  # validate here, before any process starts
    if settings.engine == "cosyvoice2" and settings.model_dir is not None:
        from voxbatch.worker.cosyvoice2.hub import check_model_dir

        check_model_dir(settings.model_dir)  # a missing file is one line now, not a worker that cannot start
    env = {f"VOXBATCH_{k.upper()}": v for k, v in flags.items() if v is not None}
    ids = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else None
    try:
        code = run_workers(ids, concurrency, queues, env_overrides=env, mps=settings.cuda_mps,
                           stop_wait_s=shutdown_window_s(settings) + STOP_GRACE_S + EXIT_MARGIN_S)
    except MpsError as e:
        _fail(str(e), EXIT_BAD)
    raise typer.Exit(code)


@app.command("settings")
def settings_table():
    """Print every setting (environment variable, type, default, what it does) as docs/settings.md."""
    from voxbatch.settings_doc import markdown

    sys.stdout.write(markdown())


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

    settings = load_settings()
    configure_celery(settings)
    install_heartbeat(settings.broker_url, settings.task_heartbeat_s)
    start_sweeper(_jobs(settings), open_storage(settings), settings)
    celery_app.worker_main(["worker", "--pool", "threads", "--concurrency", str(concurrency), "--queues",
                            settings.assemble_queue, "--hostname", "voxbatch-assembler@%h",
                            "--without-gossip", "--without-mingle", "--loglevel", "INFO"])


@app.command()
def render(path: Optional[Path] = typer.Argument(None, help="corpus (.txt, .md, .epub or a folder)"),
           out: Path = typer.Option(..., help="output folder"),
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
           no_reuse: bool = typer.Option(False, "--no-reuse", help=NO_REUSE_HELP),
           resume: Optional[str] = typer.Option(
               None, help="job id in OUT to continue as it was planned (the same command resumes by itself)"),
           json_out: bool = typer.Option(False, "--json", help="print the result as one JSON object (with where "
                                                              "the wall time went) instead of the summary line")):
    """Render a corpus in this process into a local folder (no Redis, no S3): the embedded default.

    Ctrl-C keeps what is rendered; running the same command again renders only what is missing."""
    import json
    import os
    import time

    started_at, started_unix = time.monotonic(), time.time()

    from rich.progress import Progress

    from voxbatch.models import SynthesisParams
    from voxbatch.producer.control import JobBar, progress_columns
    from voxbatch.embedded import RenderInterrupted, RenderTimes, render_local

    times = RenderTimes(start=started_at)

    if path is None and resume is None:
        _fail("render needs a corpus PATH (or --resume JOB)")
    settings = load_settings(engine=engine, llm_backend=llm_backend, model_dir=str(model_dir) if model_dir else None,
                         output_format=format, storage_url=out.resolve().as_uri(), preset=preset,
                         epub_all_spine=epub_all_spine)
    options = _script_options(cast, lexicon, no_reuse)

    def started(spec, already: int) -> None:
        what = (f"resuming job {spec.id}: {already} of {len(spec.segments)} segments already rendered"
                if already else f"job {spec.id}: {len(spec.segments)} segments")
        if planning:
            progress.remove_task(planning[0])
        err.print(escape(what), highlight=False, soft_wrap=True)

    with Progress(*progress_columns(), console=err, transient=True) as progress:  # the summary line stays
        bar: list[JobBar] = []
        planning: list[int] = []

        def planned(stage: str, done: int, total: int) -> None:  # a large corpus takes a while to segment
            if not planning:
                planning.append(progress.add_task("segmenting chapters", total=total, audio=0.0, rate=0.0, failed=0))
            progress.update(planning[0], completed=done, total=total)

        def show(status) -> None:
            if not bar:
                bar.append(JobBar(progress, status))
            bar[0].update(status)

        try:
            manifest = render_local(path, out, voice, settings, params=SynthesisParams(max_tokens=max_tokens),
                                    title=title, author=author, resume=resume, on_plan=planned, on_start=started,
                                    on_progress=show, times=times, **options)
        except RenderInterrupted as e:
            progress.stop()
            err.print(f"interrupted: {e.done} of {e.total} segments of job {e.job_id} are stored; run the same "
                      f"command again (or add --resume {e.job_id}) to render the rest", soft_wrap=True)
            err.file.flush()
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)  # render threads may still be inside the engine: do not wait for them
    total = sum(c.duration_s for c in manifest.chapters) + sum(i.duration_s for i in manifest.items)
    phases = times.phases()
    if json_out:
        print(json.dumps({"job_id": manifest.job_id, "state": manifest.state, "segments": len(manifest.segments),
                          "reused": manifest.reused, "failed": len(manifest.failed), "audio_s": round(total, 3),
                          "path": str(out / "jobs" / manifest.job_id), "started_at": round(started_unix, 3),
                          "times": phases}), flush=True)
    else:
        console.print(f"job {manifest.job_id}: {len(manifest.segments)} segments ({manifest.reused} reused, "
                      f"{len(manifest.segments) - manifest.reused} rendered), {total:.1f} s of audio, "
                      f"state {manifest.state} -> {escape(str(out / 'jobs' / manifest.job_id))}", highlight=False,
                      soft_wrap=True)
    err.print("time: " + ", ".join(f"{name[:-2].replace('_', ' ')} {v:.1f} s" for name, v in phases.items()
                                   if v is not None), highlight=False, soft_wrap=True)
    for seg, error in list(manifest.failed.items())[:5]:
        _warn(f"segment {seg} failed: {error}")
    _exit_on_qc_failures(manifest)
    if manifest.state != "completed":
        raise typer.Exit(EXIT_FAILURES)


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

    from voxbatch.keys import check_name

    settings = load_settings(storage_url=out.resolve().as_uri() if out else None)
    try:
        manifest = load_manifest(open_storage(settings), check_name("job id", job))
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

    from voxbatch.keys import check_name

    check_name("voice name", name)
    settings = load_settings(model_dir=str(model_dir) if model_dir else None)
    if not settings.model_dir:
        _fail("voice add needs the model directory: --model-dir or VOXBATCH_MODEL_DIR")
    storage = open_storage(settings)
    profile = create_voice(settings.model_dir, name, wav, text, max_positions=settings.vllm_max_model_len)
    save_voice(storage, profile)
    console.print(f"stored voice {escape(repr(name))}")


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
    main()
