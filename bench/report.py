"""BENCHMARKS.md's and docs/scaling.md's GPU numbers, rebuilt from bench/results/*.json.

    python -m bench.report            # rewrite the generated blocks in place
    python -m bench.report --check    # exit 1 (naming the block) when a committed block is stale

Hand-written prose stays; only the text between marker comments is generated:

    <!-- bench:NAME begin -->  ...  <!-- bench:NAME end -->

Blocks: `headline` (BENCHMARKS.md's first table: the newest result, by `when`, whose
`headline.path` is "worker"), `gpu-stages` (BENCHMARKS.md: the model, corpus and machine of that
result, then one section per stage that some GPU result holds, each from the newest result that has
it, naming its file and commit) and `scaling-gpu` (docs/scaling.md's per-GPU table). A GPU result is
a `bench.gpu_engine` result (it has a `headline`) run on a GPU (`environment.gpus` not empty). Every
number printed is read from a result or computed from them here (ratios, RTF, segments/s).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MARK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) begin -->\n)(?P<body>.*?)(<!-- bench:(?P=name) end -->)", re.DOTALL)
# Issue 11's targets for the worker on one GPU.
TARGET_X_REALTIME, TARGET_GPU_BUSY_PCT, TARGET_VS_BASELINE, TARGET_TASK_SIZE_PCT = 250, 95, 100, 90
STAGE_ORDER = ("accuracy", "llm", "parts", "engine", "worker", "baseline", "profile", "vllm", "invariance")
HIDDEN_OPTIONS = ("--redis-server", "--out", "--fixture-yaml")  # paths of the machine that ran it


# -- results ------------------------------------------------------------------------------------------------


def load_results(folder: Path = RESULTS) -> dict[str, dict]:
    """{file name: result} of the GPU results in `folder`."""
    out = {}
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(r, dict) and "headline" in r and r.get("environment", {}).get("gpus"):
            out[path.name] = r
    return out


def newest(results: dict[str, dict], keep) -> tuple[str, dict] | None:
    hits = [(r["when"], name) for name, r in results.items() if keep(r)]
    return (max(hits)[1], results[max(hits)[1]]) if hits else None


# The machine issue 11's figures are for: the headline is the newest worker result on it, and only
# where none is committed the newest on any GPU (a device call may get an H100 in its place; those
# results stay in bench/results and in their own sections, not the first table).
HEADLINE_GPU = "H200"


def headline_result(results: dict[str, dict]) -> tuple[str, dict]:
    def worker(r: dict) -> bool:  # a whole worker run: an A/B-only run (no baseline in it) is no headline
        return r["headline"].get("path") == "worker" and r["headline"].get("baseline_x_realtime") is not None

    found = newest(results, lambda r: worker(r) and HEADLINE_GPU in str(r["headline"].get("gpu"))) or newest(results, worker)
    if found is None:
        raise SystemExit("bench/results holds no GPU result whose headline path is 'worker'")
    return found


# -- formatting -----------------------------------------------------------------------------------------------


def num(x, digits: int | None = None) -> str:
    """1234.5 -> '1,234.5'; ints keep no decimals; None -> '–'."""
    if x is None:
        return "–"
    if digits is not None:
        x = round(x, digits)
    if isinstance(x, float) and x.is_integer() and digits == 0:
        x = int(x)
    return f"{x:,}"


def source(name: str, r: dict) -> str:
    return f"`bench/results/{name}` (commit {r['commit'][:7]}, {r['when']})"


def machine(r: dict) -> str:
    env = r["environment"]
    text = f"{', '.join(env['gpus'])}, {env['cpus']} CPU cores, torch {env['torch']}"
    host = env.get("host")
    if host:  # bench/host_speed.py: results from other hosts compare only beside these
        text += (f"; host speed: Python loop {host['python_loop_ns']} ns/iteration, torch CPU op "
                 f"{host['torch_cpu_op_us']} us, CUDA launch {host['cuda_launch_us']} us")
    return text


def command(r: dict) -> str:
    """The result's command without the options that name paths of the machine that ran it."""
    argv = r["command"].split()
    keep, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in HIDDEN_OPTIONS:
            skip = True
            continue
        keep.append(arg)
    return " ".join(keep)


def wrap(cmd: str, width: int = 100) -> str:
    """A long command as shell lines joined with backslashes, an option never apart from its values."""
    groups: list[str] = []
    for word in cmd.split():
        if groups and not word.startswith("--") and groups[-1].startswith("--"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines, line = [], ""
    for group in groups:
        if line and len(line) + len(group) + 3 > width:
            lines.append(line + " \\")
            line = "  " + group
        else:
            line = f"{line} {group}" if line else group
    return "\n".join(lines + [line])


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def short_env(env: dict[str, str]) -> str:
    return " ".join(f"{k.removeprefix('VOXBATCH_')}={v}" for k, v in env.items())


def matching_engine_run(r: dict) -> dict | None:
    """The engine-stage run with exactly the worker's settings (it records the derived budget)."""
    worker_env = r["stages"].get("worker", {}).get("env")
    for run in r["stages"].get("engine", {}).get("runs", {}).values():
        if run.get("env") == worker_env:
            return run
    return None


# -- BENCHMARKS.md: the headline ------------------------------------------------------------------------------


def headline_block(results: dict[str, dict]) -> str:
    name, r = headline_result(results)
    st = r["stages"]
    runs = list(st["worker"]["runs"].values())
    first = runs[0]
    base = st.get("baseline", {})
    base_x = base.get("x_realtime")

    def vs(x):
        return f"{round(x / base_x):,}×" if base_x else "–"

    rows = []
    for i, run in enumerate(runs):
        x = f"**{run['x_realtime']}**" if i == 0 else f"{run['x_realtime']} ({run['of_first_pct']}%)"
        rows.append(["`voxbatch worker`", str(run["task_size"]), num(run["segments"]), num(run["audio_s"]), num(run["wall_s"]),
                     x, f"**{vs(run['x_realtime'])}**" if i == 0 else vs(run["x_realtime"]), num(run.get("gpu_busy_pct")),
                     num(r.get("llm_tokens_per_s_corpus"), 0) if i == 0 else ""])
    for run in st.get("engine", {}).get("runs", {}).values():
        reps = run.get("repeats", [])
        median = f"; median of {len(reps)} runs: {', '.join(str(x['x_realtime']) for x in reps)}" if len(reps) > 1 else ""
        rows.append([f"the same engine through the Pipeline, no broker (`{run['config']}`{median})", str(run["task_size"]), num(run["segments"]),
                     num(run["audio_s"]), num(run["wall_s"]), str(run["x_realtime"]), vs(run["x_realtime"]),
                     num(run.get("gpu_busy_pct")), ""])
    if base_x:
        rows.append(["baseline: one segment at a time (LLM fp32 step loop, flow fp16 autocast, HiFT fp32)", "–",
                     num(base["segments"]), num(base["audio_s"]), num(base["wall_s"]), str(base_x), "1×", "–",
                     num(base.get("llm_tokens_per_s"))])
    lines = [
        f"## Headline: the real `voxbatch worker` on one {r['headline']['gpu']}", "",
        f"From {source(name, r)}: a `voxbatch worker` process (Celery threads pool, the shipped CosyVoice2 "
        "engine) fed by `voxbatch submit` through a redis-server on the same machine, storage in a local "
        "folder, CosyVoice2-0.5B sizes with random weights written as an official model folder. Wall time: "
        "job created in Redis -> last segment stored.", "",
        *table(["path", "tasks of", "segments", "audio s", "wall s", "× real time", "vs baseline", "GPU busy %",
                "LLM tokens/s (corpus, LLM stage)"], rows), "",
        f"Worker settings (the only VOXBATCH_* it got besides broker, storage and model folder): `{short_env(st['worker']['env'])}`.",
    ]
    engine = matching_engine_run(r)
    if engine and "inflight_segments" in engine:
        lines[-1] = lines[-1][:-1] + (f"; with them the worker's budget (`voxbatch/worker/budget.py`) is {engine['inflight_segments']} segments "
                                      f"in flight in {engine['task_threads']} task threads (the engine run with the same settings records it).")
    if len(runs) > 1:
        others = " and of ".join(f"{run['task_size']}" for run in runs[1:])
        pcts = " and ".join(f"{run['of_first_pct']}%" for run in runs[1:])
        lines[-1] += f" Tasks of {others} segments give {pcts} of the tasks-of-{first['task_size']} figure."
    lines += ["", "Issue 11's targets: " + targets(first, base_x, runs) + ".", "",
              "Reproduce (on a GPU machine, from the repository root; `--redis-server PATH` if redis-server is not on PATH):", "",
              "```", wrap(command(r)), "```", ""]
    return "\n".join(lines)


def targets(first: dict, base_x: float | None, runs: list[dict]) -> str:
    x, busy = first["x_realtime"], first.get("gpu_busy_pct")
    checks = [(f"{TARGET_X_REALTIME}× real time", f"{x}×", x >= TARGET_X_REALTIME),
              (f"GPU busy ≥ {TARGET_GPU_BUSY_PCT}%", f"{busy}%", busy is not None and busy >= TARGET_GPU_BUSY_PCT)]
    if base_x:
        checks.append((f"≥ {TARGET_VS_BASELINE}× the baseline", f"{round(x / base_x):,}×", x / base_x >= TARGET_VS_BASELINE))
    if len(runs) > 1:
        worst = min(run["of_first_pct"] for run in runs[1:])
        checks.append((f"every other task size ≥ {TARGET_TASK_SIZE_PCT}% of the first", f"{worst}%", worst >= TARGET_TASK_SIZE_PCT))
    met = [f"{what} (got {got})" for what, got, ok in checks if ok]
    missed = [f"{what} (got {got})" for what, got, ok in checks if not ok]
    return "; ".join(part for part in (f"**not met**: {', '.join(missed)}" if missed else "",
                                       f"met: {', '.join(met)}" if met else "") if part)


# -- BENCHMARKS.md: the GPU stages ----------------------------------------------------------------------------


def gpu_stages_block(results: dict[str, dict]) -> str:
    name, r = headline_result(results)
    m, c = r["model"], r["corpus"]
    lo, mean, hi = c["audio_s_min_mean_max"]
    lines = [
        f"Model and corpus of {source(name, r)}: LLM {m['llm_params_M']} M parameters, flow {m['flow_params_M']} M, "
        f"HiFT {m['hift_params_M']} M (`{m['yaml']}`), {m['weights_gib_on_gpu']} GiB of weights on the GPU. Corpus: {c['segments']} "
        f"generated sentences ({c['zh']} Chinese, {c['en']} English), {lo}–{hi} s (mean {mean} s): **{num(c['audio_s_total'])} s of audio, "
        f"{num(c['speech_tokens_total'])} speech tokens**; one voice prompt ({c['prompt']['speech_tokens']} speech tokens, "
        f"{c['prompt']['mel_frames']} mel frames) for every segment (zero-shot). Machine: {machine(r)}.", "",
    ]
    present = [s for s in dict.fromkeys([*STAGE_ORDER, *(s for r in results.values() for s in r["stages"])])
               if s not in ("worker", "engine", "baseline")]
    missing = []
    for stage in present:
        found = newest(results, lambda res, s=stage: isinstance(res["stages"].get(s), dict) and "skipped" not in res["stages"][s])
        if found is None:
            missing.append(stage)
            continue
        src_name, src = found
        lines += STAGE_SECTIONS.get(stage, generic_section)(stage, src["stages"][stage], src_name, src) + [""]
        if stage == "vllm":
            lines += vllm_runs(results) + [""]
    if missing:
        lines += [f"Stages no committed GPU result holds: {', '.join(missing)} "
                  f"(`python -m bench.gpu_engine --stages {' '.join(missing)}` measures them).", ""]
    return "\n".join(lines)


def llm_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    rows = [[str(x["impl"]), str(x["batch"]), num(x["requests"]), num(x["tokens"]), num(x["seconds"]), f"**{num(x['tokens_per_s'], 0)}**",
             num(x.get("peak_gpu_gib"))] for x in st["rows"]]
    backend = "vLLM" if stage == "vllm" else "torch backend"
    head = [f"### LLM stage, {backend}: speech tokens/s", "", f"From {source(name, r)}; fixed rows decode {st.get('fixed_tokens', r['settings']['llm_tokens'])} tokens "
            "each, the `continuous` rows are the mixed-length corpus (in given order unless the row names another).", ""]
    tail = ["", f"vLLM start-up {st['startup_s']} s, gpu_memory_utilization {st['gpu_memory_utilization']}."] if "startup_s" in st else []
    if "corpus" in st:  # the vllm stage's same-run comparison with the torch backend
        c = st["corpus"]
        tail += ["", f"Mixed-length corpus ({c.get('order', 'given order')}), {num(c['requests'])} requests at {c['rows']} rows, one run: "
                     f"vLLM **{num(c['vllm_tokens_per_s'], 0)}** tokens/s, torch backend **{num(c['torch_tokens_per_s'], 0)}**; "
                     f"vLLM / torch = {c['vllm_over_torch']}."]
    return head + table(["impl", "rows", "requests", "tokens", "s", "tokens/s", "peak GiB"], rows) + tail


def vllm_runs(results: dict[str, dict]) -> list[str]:
    """Every committed vLLM-vs-torch comparison, oldest first: each run changed the vLLM path, and the
    newest alone would not say which change bought what."""
    rows = []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["when"]):
        st = r["stages"].get("vllm")
        if not isinstance(st, dict) or "corpus" not in st:
            continue
        c = st["corpus"]
        fixed = {x["batch"]: x["tokens_per_s"] for x in st["rows"] if x["impl"] == "vllm"}
        B = c["rows"]
        extra = "; ".join(f"{x['impl']}: {num(x['tokens_per_s'], 0)}" for x in st["rows"]
                          if x["impl"].startswith("vllm, continuous, corpus,"))
        rows.append([f"`{name}`", r["commit"][:7], c.get("order", "given order"), num(fixed.get(B), 0), f"**{num(c['vllm_tokens_per_s'], 0)}**",
                     num(c["torch_tokens_per_s"], 0), str(c["vllm_over_torch"]), extra or "–"])
    if not rows:
        return []
    return ["vLLM against the torch backend in each committed run (corpus rows: the mixed-length corpus at the same rows):", "",
            *table(["result", "commit", "corpus order", "vLLM fixed", "vLLM corpus", "torch corpus", "vLLM / torch", "same-run variants"], rows)]


def parts_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    from bench.gpu_engine import parts_lines  # the stage's own table (gpu_engine prints the same)

    head, *rest = parts_lines(st)
    return ["### " + head.removeprefix("## "), "", f"From {source(name, r)}.", *rest]


def profile_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    lines = ["### Profile: where the device time goes", "", f"From {source(name, r)}; the top operators of each part by device time.", ""]
    for part, p in st.items():
        if not isinstance(p, dict) or "top" not in p:
            continue
        rows = [[f"`{x['name'][:60]}`", num(x["count"]), num(x["device_ms"]), num(x["cpu_ms"])] for x in p["top"][:6]]
        lines += [f"{part}: {p['what']}, {num(p.get('kernel_launches'))} kernel launches", "",
                  *table(["operator", "calls", "device ms", "CPU ms"], rows), ""]
    return lines[:-1]


def accuracy_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    return ["### Precision against fp32 (same inputs)", "", f"From {source(name, r)}. {st.get('note', '')}", "", *flat_table(st)]


def generic_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    return [f"### {stage}", "", f"From {source(name, r)}." + (f" {st['note']}" if isinstance(st.get("note"), str) else ""), "", *flat_table(st)]


def render_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    """The render run's measures, and its A/B (`--render-ab`) as one row per run instead of dotted keys."""
    lines = generic_section(stage, {k: v for k, v in st.items() if k != "ab"}, name, r)
    ab = st.get("ab")
    if not ab:
        return lines
    cols = ("wall_s", "x_realtime", "startup_s", "first_segment_s", "rendering_s", "assembly_tail_s")
    runs = [("A", ab["a_runs"][0])] + [(f"B: `{v['spec']}` (wall B/A {v['wall_over_a_mean']})", v["run"]) for v in ab["variants"]]
    runs += [("A again", ab["a_runs"][1])]
    rows = [[label, *(num(run.get(c)) for c in cols)] for label, run in runs]
    return lines + ["", f"A/B in the same run ({ab['order']}):", "",
                    *table(["run", "wall s", "x real time", "start-up s", "first segment s", "rendering s", "assembly tail s"], rows)]


def flat_table(st: dict) -> list[str]:
    """Every number, string and flag of a stage, one row per dotted key (for stages without a layout)."""
    rows: list[list[str]] = []

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                walk(f"{prefix}[{i}]", x)
        elif prefix not in ("note", "stage_wall_s"):
            text = json.dumps(v, ensure_ascii=False) if isinstance(v, (list, bool)) or v is None else str(v)
            rows.append([f"`{prefix}`", text.replace("|", "\\|")[:120]])

    walk("", st)
    return table(["measure", "value"], rows)


def invariance_section(stage: str, st: dict, name: str, r: dict) -> list[str]:
    from bench.invariance import table_lines  # the stage's own table (gpu_engine prints the same)

    head, *rest = table_lines(st)
    return ["### " + head.removeprefix("## "), "", f"From {source(name, r)}.", *rest[:-1]]


STAGE_SECTIONS = {"llm": llm_section, "vllm": llm_section, "parts": parts_section, "profile": profile_section,
                  "accuracy": accuracy_section, "invariance": invariance_section, "render": render_section}


# -- docs/scaling.md ------------------------------------------------------------------------------------------


def scaling_block(results: dict[str, dict]) -> str:
    name, r = headline_result(results)
    st = r["stages"]
    gpu = r["headline"]["gpu"].removeprefix("NVIDIA ")
    env = st["worker"]["env"]
    rows_setting = env.get("VOXBATCH_ENGINE_MAX_BATCH", "auto")
    engine = matching_engine_run(r)
    inflight = f"{engine['inflight_segments']} segments in flight" if engine and "inflight_segments" in engine else "–"
    backend = env.get("VOXBATCH_LLM_BACKEND", "torch")
    rows = []
    for i, run in enumerate(st["worker"]["runs"].values()):
        rtf = run["wall_s"] / run["audio_s"]
        b = lambda s: f"**{s}**" if i == 0 else s  # noqa: E731 - the first run is the figure
        what = (f"{backend}, {rows_setting} rows; `voxbatch worker` through Celery + Redis, tasks of {run['task_size']}" if i == 0
                else f"the same, tasks of {run['task_size']}")
        rows.append([gpu, what, inflight, b(f"{rtf:.5f}"), b(str(run["x_realtime"])),
                     b(f"{run['segments'] / run['wall_s']:.1f}") + f" ({run['segments']} / {run['wall_s']:.2f} s)", f"`{name}`"])
    base = st.get("baseline")
    if base and "x_realtime" in base:
        rows.append([gpu, "torch, one segment at a time (official-style baseline, engine only)", "1", f"{base['rtf']:.2f}",
                     str(base["x_realtime"]), f"{base['segments'] / base['wall_s']:.1f} ({base['segments']} / {base['wall_s']:.1f} s)", f"`{name}`"])
    lo, mean, hi = r["corpus"]["audio_s_min_mean_max"]
    return "\n".join([
        f"*Measured* per GPU, from {source(name, r)}. Segment lengths are set by the bench, because random "
        f"weights never stop on their own: {lo}–{hi} s, mean {mean} s.", "",
        *table(["GPU", "LLM backend", "in flight", "RTF (aggregate)", "× real time", "segments/s", "file"], rows), ""])


# Docs/scaling.md's worked example: the audio a team asks for in one night, the night and the share of it a GPU
# synthesizes (an assumption, stated there), and the fleet size for the other way round.
EXAMPLE_AUDIO_HOURS, EXAMPLE_WINDOW_H, EXAMPLE_UTILISATION, EXAMPLE_FLEET = 2000, 8, 0.8, 1000


def headline_run(results: dict[str, dict]) -> tuple[str, dict, dict, str]:
    """The headline result's file name, the result, its first worker run (the tables' figure) and its
    GPU's name without the vendor."""
    name, r = headline_result(results)
    return name, r, next(iter(r["stages"]["worker"]["runs"].values())), r["headline"]["gpu"].removeprefix("NVIDIA ")


def scaling_example_block(results: dict[str, dict]) -> str:
    """The worked example from the headline's first worker run, so that the arithmetic follows the
    table when a new result lands."""
    name, r, run, gpu = headline_run(results)
    rtf, x = run["wall_s"] / run["audio_s"], run["x_realtime"]
    need = EXAMPLE_AUDIO_HOURS * rtf / (EXAMPLE_WINDOW_H * EXAMPLE_UTILISATION)
    gpus = max(1, math.ceil(need))
    at = EXAMPLE_AUDIO_HOURS * rtf / (EXAMPLE_WINDOW_H * gpus)
    fleet_hours = EXAMPLE_FLEET * x * EXAMPLE_WINDOW_H * EXAMPLE_UTILISATION
    return "\n".join([
        f"Worked example (arithmetic on `{name}`, tasks of {run['task_size']}): {EXAMPLE_AUDIO_HOURS:,} audio hours in "
        f"{EXAMPLE_WINDOW_H} hours at {EXAMPLE_UTILISATION} utilisation needs "
        f"`{EXAMPLE_AUDIO_HOURS} × {rtf:.5f} / ({EXAMPLE_WINDOW_H} × {EXAMPLE_UTILISATION}) = {need:.2f}`, so "
        f"**{gpus} {gpu}{'s' if gpus > 1 else ''}** (at {at:.2f} utilisation). The other way round, {EXAMPLE_FLEET:,} "
        f"{gpu}s produce `{EXAMPLE_FLEET} × {x} × {EXAMPLE_WINDOW_H} h × {EXAMPLE_UTILISATION} ≈ "
        f"{fleet_hours / 1e6:.2f} million audio hours` per night. Machines differ by up to 20% in LLM speed on "
        f"unchanged code (BENCHMARKS.md), so plan with a margin.", ""])


def scaling_load_block(results: dict[str, dict]) -> str:
    """Segments per second per GPU, the load Redis and S3 see, from the same run as the worked example."""
    name, r, run, gpu = headline_run(results)
    x = run["x_realtime"]
    mean_s = r["corpus"]["audio_s_min_mean_max"][1]
    return "\n".join([
        f"Redis and S3 work is per segment, so their load is `GPUs × {x} / mean_segment_s` segments per second: "
        f"**{x / mean_s:.1f} segments/s per {gpu}** at the measured run's {mean_s}-s mean (`{name}`).", ""])


# -- the files --------------------------------------------------------------------------------------------------

BLOCKS = {"headline": headline_block, "gpu-stages": gpu_stages_block, "scaling-gpu": scaling_block,
          "scaling-example": scaling_example_block, "scaling-load": scaling_load_block}
FILES = ("BENCHMARKS.md", "docs/scaling.md")


def render(text: str, results: dict[str, dict], path: str) -> str:
    """`text` with every marked block regenerated; an unknown block name is an error."""
    def one(m: re.Match) -> str:
        fn = BLOCKS.get(m["name"])
        if fn is None:
            raise SystemExit(f"{path}: unknown generated block {m['name']!r} (known: {', '.join(BLOCKS)})")
        return m.group(1) + fn(results) + m.group(4)

    return MARK.sub(one, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a generated block is stale")
    ap.add_argument("--results", type=Path, default=RESULTS, help="folder of result files")
    ap.add_argument("--root", type=Path, default=REPO, help="folder holding the docs to regenerate (a copy, in tests)")
    args = ap.parse_args()
    results = load_results(args.results)
    stale = []
    for rel in FILES:
        path = args.root / rel
        text = path.read_text(encoding="utf-8")
        new = render(text, results, rel)
        if new != text:
            stale.append(rel)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"generated GPU numbers are stale in {', '.join(stale)}: run `python -m bench.report`", file=sys.stderr)
        sys.exit(1)
    if not args.check:
        print(f"rewrote: {', '.join(stale) or 'nothing (up to date)'}")


if __name__ == "__main__":
    main()
