"""`voxbatch render` assembles each chapter while later chapters still render, and keeps its contract.

The tiny CosyVoice2 fixture renders a 3-chapter book on the CPU two segments at a time (two LLM rows,
tasks and flow batches of two), so chapters finish one after another; the storage folder then shows
the order of events: every chapter file but the last is older than the last chapter's newest
segment. A second run of the same command finds every segment stored and renders none. With the
tone engine and a segment that always fails, the job ends `completed_with_errors` with exit 1, the
chapters around the failing one delivered, and a rerun keeps every stored segment as it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests import corpora
from voxbatch.models import Manifest

TWO_AT_A_TIME = {"VOXBATCH_ENGINE_MAX_BATCH": "2", "VOXBATCH_BATCH_SIZE": "2", "VOXBATCH_ENGINE_FLOW_BATCH": "2",
                 "VOXBATCH_UPLOAD_THREADS": "1"}


def render(*args: str, env: dict[str, str]) -> tuple[int, dict, str]:
    """`voxbatch render ARGS --json` in this process: exit code, the JSON result (or {}), stderr."""
    from voxbatch.cli import app

    r = CliRunner().invoke(app, ["render", *args, "--json"], env={"COLUMNS": "200", **env})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return r.exit_code, json.loads(lines[-1]) if lines else {}, r.stderr


def mtimes(paths) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in paths}


@pytest.fixture(scope="module")
def voiced_out(tmp_path_factory, tiny_model_dir, tiny_facts) -> Path:
    """An output folder holding voice 'v1', made from the fixture's prompt."""
    from voxbatch.producer.voice import create_voice
    from voxbatch.storage import LocalStorage
    from voxbatch.voice import save_voice

    out = tmp_path_factory.mktemp("out")
    save_voice(LocalStorage(out), create_voice(tiny_model_dir, "v1", tiny_model_dir / "prompt_24k.wav",
                                               tiny_facts.prompt_text))
    return out


def test_chapters_are_assembled_while_later_chapters_render(voiced_out, tiny_model_dir, tmp_path, one_torch_thread):
    book = corpora.write_md(tmp_path / "book.md")
    args = [str(book), "--out", str(voiced_out), "--voice", "v1", "--engine", "cosyvoice2",
            "--model-dir", str(tiny_model_dir), "--max-tokens", "25"]
    code, result, err = render(*args, env=TWO_AT_A_TIME)
    assert code == 0 and result["state"] == "completed", err
    job = Path(result["path"])
    manifest = Manifest.model_validate_json((job / "manifest.json").read_text())
    last = len(manifest.chapters) - 1
    assert last >= 2 and all(c.key for c in manifest.chapters)
    segments = mtimes(job.glob("segments/*/*.wav"))
    assert len(segments) == len(manifest.segments) == result["segments"]
    last_segment = max(t for p, t in segments.items() if p.parent.name == f"{last:04d}")
    for chapter in manifest.chapters[:-1]:
        written = (voiced_out / chapter.key).stat().st_mtime_ns
        assert written < last_segment, f"chapter {chapter.index} was assembled after the last chapter's segments"
    times = result["times"]
    assert set(times) == {"startup_s", "first_segment_s", "rendering_s", "assembly_tail_s", "wall_s"}
    assert all(v is not None and v >= 0 for v in times.values()), times
    assert times["first_segment_s"] <= times["rendering_s"] and times["startup_s"] + times["rendering_s"] <= times["wall_s"]
    assert "time: startup" in err

    # The same command again: the same job, every segment found stored, none rendered again.
    again_code, again, _ = render(*args, env=TWO_AT_A_TIME)
    assert again_code == 0 and again["job_id"] == result["job_id"] and again["reused"] == again["segments"]
    assert mtimes(job.glob("segments/*/*.wav")) == segments
    assert all((voiced_out / c.key).is_file() for c in manifest.chapters)


def test_a_failing_segment_exits_1_delivers_the_other_chapters_and_resumes(tmp_path):
    from voxbatch.worker.tone import FAIL_MARKER

    chapters = [(title, list(paras)) for title, paras in corpora.CHAPTERS]
    chapters[1][1][0] = f"This sentence breaks {FAIL_MARKER} the tone engine."
    book = corpora.write_md(tmp_path / "book.md", chapters)
    out = tmp_path / "out"
    env = {**TWO_AT_A_TIME, "VOXBATCH_ENGINE": "tone", "VOXBATCH_MAX_ATTEMPTS": "1"}
    code, result, err = render(str(book), "--out", str(out), env=env)
    assert code == 1 and result["state"] == "completed_with_errors" and result["failed"] == 1, err
    job = Path(result["path"])
    manifest = Manifest.model_validate_json((job / "manifest.json").read_text())
    assert [c.key is not None for c in manifest.chapters] == [True, False, True]
    (failed_id,) = manifest.failed
    assert failed_id.startswith("0001-") and "asks the tone engine to fail" in manifest.failed[failed_id]
    stored = mtimes(job.glob("segments/*/*.wav"))
    assert len(stored) == len(json.loads((job / "job.json").read_text())["segments"]) - 1
    assert not list(job.glob("chapters/0001*"))

    # Resumed by id: the stored segments stay as they were, the failing one fails again, exit 1 again.
    code, again, _ = render("--resume", result["job_id"], "--out", str(out), env=env)
    assert code == 1 and again["job_id"] == result["job_id"] and again["failed"] == 1
    assert mtimes(job.glob("segments/*/*.wav")) == stored
    assert [c.key is not None for c in Manifest.model_validate_json((job / "manifest.json").read_text()).chapters] == [
        True, False, True]


def test_graphs_warmed_at_start_are_warmed_once_before_rendering(voiced_out, tiny_model_dir, tmp_path, one_torch_thread,
                                                                 monkeypatch):
    """With `embedded.WARM_GRAPHS_AT_START` the engine-start thread calls the engine's `warm_graphs`
    once, after the probe and before any segment renders, and the render completes as without it."""
    import threading

    from voxbatch import embedded
    from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine

    calls: list[tuple[str, int]] = []
    warm = CosyVoice2Engine.warm_graphs

    def recorded(engine):
        calls.append((threading.current_thread().name, len(list(voiced_out.glob("jobs/*/segments/*/*.wav")))))
        warm(engine)

    monkeypatch.setattr(embedded, "WARM_GRAPHS_AT_START", True)
    monkeypatch.setattr(CosyVoice2Engine, "warm_graphs", recorded)
    book = corpora.write_md(tmp_path / "book.md", corpora.CHAPTERS[:1])
    before = len(list(voiced_out.glob("jobs/*/segments/*/*.wav")))
    code, result, err = render(str(book), "--out", str(voiced_out), "--voice", "v1", "--engine", "cosyvoice2",
                               "--model-dir", str(tiny_model_dir), "--max-tokens", "20", env=TWO_AT_A_TIME)
    assert code == 0 and result["state"] == "completed" and result["reused"] == 0, err
    assert calls == [("engine-start", before)]
