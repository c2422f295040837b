"""The tail of `voxbatch render` on a long book: what is left after the last segment is stored.

Runs `voxbatch render` as a user runs it (its own process, `--json`, ffmpeg on PATH so the .m4b is
written) over a generated book of `--chapters` chapters, on the tone engine slowed to `--x-realtime`
(`VOXBATCH_TONE_RTF`: a stand-in for a GPU worker's rate, so chapters finish over the render's wall
time as they do on a GPU, without one), in A B.. A order: A is the shipped configuration, each B one
`--ab` spec of bench switches (bench/switches.py) set in the render process. Records each run's
phases (start-up, rendering, assembly tail, wall) from the command's own `--json`.

Why: a book is assembled chapter by chapter while later ones render, but the .m4b was encoded in one
go after the last chapter, ~255x real time on one core, which on a GPU rendering at ~300x real time
is most of a render's wall time again. `book_stream=0` is that old way (assemble.BOOK_WHILE_ASSEMBLING).

Usage (repo root): python -m bench.render_tail [--hours 2] [--x-realtime 300] [--ab book_stream=0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.provenance import commit
from bench.switches import parse_switches, worker_env

REPO = Path(__file__).resolve().parents[1]
SENTENCE = "The keeper walked the length of the harbour wall and counted every boat that had come home before dark."


def write_book(path: Path, chapters: int, hours: float) -> int:
    """A Markdown book of `chapters` chapters and about `hours` of tone audio; its sentence count (the
    segmenter may split a sentence: each run records the segments it rendered)."""
    from voxbatch.worker.tone import tone_duration_s

    per_chapter = max(1, round(hours * 3600 / tone_duration_s(SENTENCE) / chapters))
    lines = []
    for c in range(chapters):
        lines.append(f"# Chapter {c + 1}\n")
        lines += [f"{SENTENCE} Line {c}.{i}.\n" for i in range(per_chapter)]
    path.write_text("\n".join(lines), encoding="utf-8")
    return per_chapter * chapters


def render_once(book: Path, x_realtime: float, run: dict[str, str]) -> dict:
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="render-tail-") as out:
        env = {**os.environ, "PYTHONPATH": pythonpath, "VOXBATCH_ENGINE": "tone",
               "VOXBATCH_TONE_RTF": str(1 / x_realtime), **worker_env(run, pythonpath)}
        cmd = [sys.executable, "-m", "voxbatch.cli", "render", str(book), "--out", out, "--voice", "tone", "--json"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"voxbatch render exited {proc.returncode}: {proc.stderr[-2000:]}")
        r = json.loads(lines[-1])
        book_written = any(Path(out).rglob("book.m4b"))
    return {"switches": run, "segments": r["segments"], "audio_s": r["audio_s"], "state": r["state"],
            "process_wall_s": round(wall, 3), **r["times"], "book_m4b": book_written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=float, default=2.0, help="audio in the book")
    ap.add_argument("--chapters", type=int, default=20)
    ap.add_argument("--x-realtime", type=float, default=300.0, help="the tone engine's rate (a GPU worker's)")
    ap.add_argument("--ab", nargs="+", default=["book_stream=0"], metavar="SPEC", help="bench switches for the B runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "render_tail.json")
    args = ap.parse_args()
    try:  # a bad spec or no ffmpeg: exit 2 with the reason, before anything runs
        variants = [("A", {})] + [(f"B: {spec}", parse_switches(spec)) for spec in args.ab] + [("A again", {})]
    except SystemExit as e:
        ap.error(str(e))
    if shutil.which("ffmpeg") is None:
        ap.error("ffmpeg is not on PATH: without it there is no .m4b, and nothing to measure")
    with tempfile.TemporaryDirectory() as tmp:
        book = Path(tmp) / "book.md"
        sentences = write_book(book, args.chapters, args.hours)
        runs = []
        for label, run in variants:
            r = render_once(book, args.x_realtime, run)
            runs.append({"run": label, **r})
            print(f"  {label}: wall {r['wall_s']} s, rendering {r['rendering_s']} s, assembly tail {r['assembly_tail_s']} s",
                  flush=True)
    a_tail = sum(r["assembly_tail_s"] for r in runs if r["run"].startswith("A")) / 2
    a_wall = sum(r["wall_s"] for r in runs if r["run"].startswith("A")) / 2
    for r in runs:
        r["tail_over_a_mean"] = round(r["assembly_tail_s"] / a_tail, 3) if a_tail else None
        r["wall_over_a_mean"] = round(r["wall_s"] / a_wall, 3)
    ffmpeg_version = subprocess.run(["ffmpeg", "-version"], capture_output=True, text=True).stdout.split("\n")[0]
    result = {"bench": "render_tail", "commit": commit(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join(["python -m bench.render_tail", *sys.argv[1:]]),
              "book": {"chapters": args.chapters, "sentences": sentences, "hours": args.hours},
              "tone_x_realtime": args.x_realtime, "runs": runs,
              "hardware": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                           "ffmpeg": ffmpeg_version}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    table = ["| run | segments | audio s | start-up s | rendering s | assembly tail s | wall s | tail / A | wall / A | .m4b |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['run']} | {r['segments']} | {r['audio_s']} | {r['startup_s']} | {r['rendering_s']} | {r['assembly_tail_s']} | "
              f"{r['wall_s']} | {r['tail_over_a_mean']} | {r['wall_over_a_mean']} | {r['book_m4b']} |" for r in runs]
    md = (f"# voxbatch render's tail ({result['when']}, commit {result['commit'][:7]})\n\n"
          f"{args.hours} h book in {args.chapters} chapters, tone engine at {args.x_realtime}x real time, "
          f"{os.cpu_count()} cores, {ffmpeg_version}\n\n" + "\n".join(table) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
