"""What each delivery preset does to a chapter: levels before and after mastering, per chapter file.

Renders a corpus in this process (`render_local`, a local folder) with each preset, on the tone engine
and, when the tiny CosyVoice2 fixture is there, on the tiny model (random weights: noise, not speech),
and reads the QC rows of the manifest: `source_levels` is the chapter as assembled (engine rate,
before mastering), `levels` the delivered file decoded again (after). Same measurements as
`voxbatch qc` (producer/qc.py): integrated LUFS, RMS, sample peak, true peak, noise floor (quietest
500 ms), room tone at head and tail, length.

Usage (repo root): python -m bench.presets [--corpus examples/book.md] [--out bench/results/presets.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

FIELDS = ("integrated_lufs", "rms_db", "peak_dbfs", "true_peak_dbtp", "noise_floor_db", "head_s", "tail_s", "duration_s")


def run(corpus: Path, preset: str, engine: str, model_dir: Path | None) -> dict:
    from voxbatch.models import SynthesisParams
    from voxbatch.settings import Settings
    from voxbatch.embedded import render_local

    with tempfile.TemporaryDirectory() as out:
        settings = Settings(engine=engine, preset=preset, storage_url=Path(out).as_uri(),
                            model_dir=str(model_dir) if model_dir else None)
        voice = "tone"
        if engine == "cosyvoice2":
            from voxbatch.producer.voice import create_voice
            from voxbatch.storage import LocalStorage
            from voxbatch.voice import save_voice

            meta = json.loads((model_dir / "reference_meta.json").read_text())
            save_voice(LocalStorage(out), create_voice(str(model_dir), "bench", model_dir / "prompt_24k.wav",
                                                       meta["e2e"]["prompt_text"]))
            voice = "bench"
        t0 = time.perf_counter()
        manifest = render_local(corpus, out, voice, settings, params=SynthesisParams(max_tokens=60))
        wall = time.perf_counter() - t0
    rows = [{"file": r.key.rsplit("/", 1)[-1], "passed": r.passed,
             "failed": [k for k, ok in r.checks.items() if not ok],
             "before": {f: getattr(r.source_levels, f) for f in FIELDS},
             "after": {f: getattr(r.levels, f) for f in FIELDS}} for r in manifest.qc]
    return {"preset": preset, "engine": engine, "wall_s": round(wall, 2), "files": rows}


def markdown(results: list[dict]) -> str:
    out = []
    short = ("LUFS", "RMS dB", "peak dBFS", "TP dBTP", "floor dB", "head s", "tail s", "len s")
    for res in results:
        out.append(f"\n### {res['preset']} on the {res['engine']} engine ({res['wall_s']} s wall for the job)\n")
        out.append("| file | | " + " | ".join(short) + " | QC |")
        out.append("|---|---|" + "---|" * len(short) + "---|")
        for row in res["files"]:
            for when in ("before", "after"):
                vals = " | ".join(f"{row[when][f]:.2f}" if "_s" in f else f"{row[when][f]:.1f}" for f in FIELDS)
                qc = ("pass" if row["passed"] else "FAIL " + ", ".join(row["failed"])) if when == "after" else ""
                out.append(f"| {row['file'] if when == 'before' else ''} | {when} | {vals} | {qc} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", default="examples/book.md")
    ap.add_argument("--model-dir", default="../shared/fixtures/cosyvoice2-tiny")
    ap.add_argument("--out", default="bench/results/presets.json")
    args = ap.parse_args()
    model_dir = Path(args.model_dir)
    engines = ["tone"] + (["cosyvoice2"] if (model_dir / "llm.pt").is_file() else [])
    results = [run(Path(args.corpus), preset, engine, model_dir if engine == "cosyvoice2" else None)
               for engine in engines for preset in ("acx", "podcast")]
    Path(args.out).write_text(json.dumps({"corpus": args.corpus, "results": results}, indent=1) + "\n")
    md = markdown(results)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
