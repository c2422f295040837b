"""The `invariance` stage of bench/gpu_engine.py: does a segment re-rendered in another batch come out the same?

A retried segment, or a suspect re-rendered solo, lands in another batch than the first time: another
LLM row count and attention width, other neighbours, another flow/HiFT batch. For each LLM dtype the
stage builds the worker's engine (`CosyVoice2Engine.from_settings`, VOXBATCH_LLM_DTYPE set) and renders
K probe segments, all of one length bucket (the engine vocodes a bucket together), three ways:

  alone  one at a time: the LLM with one row, flow and HiFT with one row (what `engine.synthesize([p])` does)
  A      inside the first N corpus segments decoded together at the configured rows (corpus order), then
         vocoded in flow batches of their bucket-mates, `flow` rows each, in that order
  B      inside another N segments (the probes plus the corpus from its other end), shuffled

and compares each part: speech tokens (identical sequences), mel (bit-identical; max abs where the
tokens agree) and audio (bit-identical; max abs). A probe counts as identical only if A and B both equal
alone. Two more checks hold a part's input fixed so each part's own batch dependence shows (once: they
do not depend on the LLM dtype): flow on the same tokens alone vs in a batch, HiFT on the same mel alone
vs in a batch. Throughput of each dtype: LLM speech tokens/s over composition A (`generate`, continuous
batching, as the llm stage's corpus row) and x real time of the engine through the worker's Pipeline on
the same N segments (as the engine stage). `decision`: fp32's cost vs bf16 and which dtype gives
identical tokens (and audio) at <= MAX_COST_PCT cost, judged on x real time.

Forced lengths (random weights never stop) fix every segment's token count, so tokens can differ only in
value, never in where eos falls, and audio lengths always agree.
"""

from __future__ import annotations

import gc
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from voxbatch.models import SynthesisParams
from voxbatch.settings import Settings
from voxbatch.worker.cosyvoice2.engine import CosyVoice2Engine, PreparedVoice
from voxbatch.worker.cosyvoice2.streaming import length_bucket
from voxbatch.worker.engine import SynthesisRequest

MAX_COST_PCT = 10.0  # the bar: re-render identity is worth at most this much throughput
SEED_BASE = 1000  # segment i of the corpus has seed 1000 + i, as run_pipeline gives it
B_SHUFFLE_SEED = 11
RERUNS = 2  # probes rendered alone a second time through engine.synthesize (run-to-run determinism)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def choose_probes(lengths: list[int], n: int, k: int) -> list[int]:
    """K of the first n corpus indexes, spread over the most common length bucket (`lengths`: forced
    speech tokens per corpus segment)."""
    by_bucket: dict[int, list[int]] = defaultdict(list)
    for i in range(min(n, len(lengths))):
        by_bucket[length_bucket(lengths[i])].append(i)
    members = max(by_bucket.values(), key=len)
    k = min(k, len(members))
    return [members[j * len(members) // k] for j in range(k)]


def compositions(n_corpus: int, n: int, probes: list[int]) -> dict[str, list[int]]:
    """A: the first n corpus segments in order. B: the probes plus n - K others from the corpus's other
    end (the same others where the corpus is short), shuffled: other neighbours, other rows."""
    taken = set(probes)
    others = [j for j in reversed(range(n_corpus)) if j not in taken][: n - len(probes)]
    b = probes + others
    random.Random(B_SHUFFLE_SEED).shuffle(b)
    return {"A": list(range(n)), "B": b}


def flow_chunks(order: list[int], n_tokens: dict[int, int], probes: list[int], flow_batch: int) -> list[list[int]]:
    """Flow batches the engine could form around the probes: the probes, `flow_batch` at a time, each
    group filled up to `flow_batch` rows with other segments of their length bucket taken in the
    composition's order, the rows in that order (one flow + HiFT batch per group)."""
    bucket = length_bucket(n_tokens[probes[0]])
    fillers = iter([j for j in order if j not in probes and length_bucket(n_tokens[j]) == bucket])
    rank = {j: r for r, j in enumerate(order)}
    chunks = []
    for g in range(0, len(probes), flow_batch):
        rows = probes[g : g + flow_batch]
        rows += [j for _, j in zip(range(flow_batch - len(rows)), fillers)]
        chunks.append(sorted(rows, key=rank.__getitem__))
    return chunks


def first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first token where two sequences differ (the shorter length if one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _max_abs(pairs: list[tuple]) -> float | None:
    """Largest |x - y| over (x, y) pairs of tensors or arrays of equal shape (others skipped: a segment
    whose token count changed has no sample-wise difference); None for no pairs."""
    out = None
    for x, y in pairs:
        if x.shape != y.shape:
            continue
        d = float((x - y).abs().max()) if isinstance(x, torch.Tensor) else float(np.abs(x - y).max())
        out = d if out is None else max(out, d)
    return out


def _same(x, y) -> bool:
    return bool(torch.equal(x, y)) if isinstance(x, torch.Tensor) else bool(np.array_equal(x, y))


@dataclass
class _Renders:
    """Tokens, mels and audio of the probes in one way of rendering them (alone, A or B), by corpus index."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    mel: dict[int, torch.Tensor] = field(default_factory=dict)  # (80, T_mel) fp32
    audio: dict[int, np.ndarray] = field(default_factory=dict)


def _mels(engine: CosyVoice2Engine, voice: PreparedVoice, chunks: list[list[int]], tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Each chunk as one flow batch (engine.mels: the first half of engine.vocode) -> mel (80, T_mel) per row."""
    out = {}
    for chunk in chunks:
        out.update(zip(chunk, engine.mels([tokens[j] for j in chunk], [voice] * len(chunk))))
    return out


def _audio(engine: CosyVoice2Engine, chunks: list[list[int]], mels: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
    """Each chunk as one HiFT batch (engine.waves: the second half of engine.vocode), speed 1, segment seeds."""
    out = {}
    for chunk in chunks:
        out.update(zip(chunk, engine.waves([mels[j] for j in chunk], [1.0] * len(chunk), [SEED_BASE + j for j in chunk])))
    return out


def _vocode(engine: CosyVoice2Engine, voice: PreparedVoice, chunks: list[list[int]], tokens: dict[int, list[int]],
            probes: list[int], into: _Renders) -> None:
    """Flow then HiFT over the chunks, as engine.vocode runs a batch; the probes' mels and audio go `into`."""
    mels = _mels(engine, voice, chunks, tokens)
    audio = _audio(engine, chunks, mels)
    into.mel.update({p: mels[p] for p in probes if p in mels})
    into.audio.update({p: audio[p] for p in probes if p in audio})


def _compare(alone: _Renders, ways: dict[str, _Renders], probes: list[int]) -> dict:
    """Per part, how many probes came out identical in every way vs alone, and by how much they differ."""
    same_tokens = [p for p in probes if all(w.tokens[p] == alone.tokens[p] for w in ways.values())]
    out = {
        "probes": len(probes),
        "tokens_identical": len(same_tokens),
        "tokens_identical_by_composition": {k: sum(w.tokens[p] == alone.tokens[p] for p in probes) for k, w in ways.items()},
        "first_token_diff": {k: sorted(first_diff(w.tokens[p], alone.tokens[p]) for p in probes if w.tokens[p] != alone.tokens[p])
                             for k, w in ways.items()},
        "tokens_per_probe": sorted({len(alone.tokens[p]) for p in probes}),
    }
    if any(w.mel for w in ways.values()):
        out["mel_identical"] = sum(all(_same(w.mel[p], alone.mel[p]) for w in ways.values()) for p in probes)
        out["mel_max_abs_same_tokens"] = _max_abs([(w.mel[p], alone.mel[p]) for w in ways.values() for p in same_tokens])
        out["audio_identical"] = sum(all(_same(w.audio[p], alone.audio[p]) for w in ways.values()) for p in probes)
        out["audio_max_abs"] = _max_abs([(w.audio[p], alone.audio[p]) for w in ways.values() for p in probes])
        out["audio_max_abs_same_tokens"] = _max_abs([(w.audio[p], alone.audio[p]) for w in ways.values() for p in same_tokens])
    return out


def _engine(bench, run: dict[str, str]) -> tuple[CosyVoice2Engine, Settings]:
    """The worker's engine as the engine stage builds it (bench.engine_env: VOXBATCH_* of the run), warmed."""
    env = bench.engine_env(run)
    settings = Settings(**{k[len("VOXBATCH_"):].lower(): v for k, v in env.items()})
    engine = CosyVoice2Engine.from_settings(settings)
    engine.warmup()
    return engine, settings


def one_dtype(bench, run: dict[str, str], dtype: str, probes: list[int], ways: dict[str, list[int]],
              run_pipeline: Callable, parts: bool) -> dict:
    """Build the engine with `dtype`, measure its throughput, render the probes alone and in A and B."""
    corpus, n = bench.corpus, len(ways["A"])
    phase_s: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        phase_s[name] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()

    engine, settings = _engine(bench, {**run, "dtype": dtype})
    lap("start_and_warmup")
    try:
        voice = engine.voices.get("bench")
        requests = {j: SynthesisRequest(f"s{j}", corpus[j].text, "bench", SEED_BASE + j, SynthesisParams())
                    for j in set(ways["A"]) | set(ways["B"])}
        llm_req = {j: engine.llm_request(r, voice) for j, r in requests.items()}
        place = engine.placement
        out: dict = {"llm_dtype": dtype, "effective_llm_dtype": str(place.llm_dtype).removeprefix("torch."),
                     "flow_dtype": str(place.flow_dtype).removeprefix("torch."), "hift_dtype": str(place.hift_dtype).removeprefix("torch.")}

        # Throughput: the engine through the worker's Pipeline on composition A's texts (warmed by engine.warmup).
        pipe = run_pipeline(engine, [corpus[j].text for j in ways["A"]], bench.storage_root, settings)
        out["x_realtime"] = pipe["x_realtime"]
        out["pipeline"] = {k: pipe[k] for k in ("segments", "audio_s", "wall_s", "failed", "gpu_busy_pct")}
        if pipe["failed"]:
            raise RuntimeError(f"invariance {dtype}: {pipe['failed']} segments failed in the pipeline run")
        lap("pipeline")

        # LLM: A (timed: the mixed corpus at the configured rows), B, then each probe alone.
        rendered = {k: _Renders() for k in ways}
        tokens: dict[str, dict[int, list[int]]] = {}
        for k, order in ways.items():
            _sync()
            t0 = time.perf_counter()
            res = {order[r.index]: r.tokens for r in engine.llm.generate([llm_req[j] for j in order])}
            _sync()
            if k == "A":
                llm_s = time.perf_counter() - t0
                out["llm_s"] = round(llm_s, 3)
                out["llm_tokens_per_s_corpus"] = round(sum(map(len, res.values())) / llm_s, 1)
            tokens[k] = res
            rendered[k].tokens = {p: res[p] for p in probes}
        lap("llm_batches")
        alone = _Renders()
        for p in probes:
            (r,) = engine.llm.generate([llm_req[p]])
            alone.tokens[p] = r.tokens
        lap("llm_alone")

        # Flow + HiFT: alone (one row each), then A and B in flow batches of the probes' bucket-mates.
        n_tokens = {j: len(toks) for res in tokens.values() for j, toks in res.items()}
        _vocode(engine, voice, [[p] for p in probes], alone.tokens, probes, alone)
        for k, order in ways.items():
            _vocode(engine, voice, flow_chunks(order, n_tokens, probes, engine.flow_batch), tokens[k], probes, rendered[k])
        out.update(_compare(alone, rendered, probes))
        out["flow_batches_per_composition"] = len(flow_chunks(ways["A"], n_tokens, probes, engine.flow_batch))
        lap("vocode")

        # Run to run: a few probes alone again, through engine.synthesize (the shipped path end to end).
        same = 0
        for p in probes[:RERUNS]:
            (res,) = list(engine.synthesize([requests[p]]))
            same += res.audio is not None and np.array_equal(res.audio, alone.audio[p])
        out["alone_rerun_identical"] = f"{same}/{len(probes[:RERUNS])}"
        lap("rerun")

        if parts:
            out["acoustic_parts"] = _parts(engine, voice, ways["A"], tokens["A"], alone, probes, n_tokens, engine.flow_batch)
            lap("parts")
        out["phase_s"] = phase_s
        return out
    finally:
        engine.llm.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _parts(engine, voice, order, tokens_a, alone: _Renders, probes, n_tokens, flow_batch) -> dict:
    """Each acoustic part with its input held fixed, in composition A's flow batches: flow on the probes'
    alone tokens (vs their alone mels), HiFT on the probes' alone mels (vs their alone audio)."""
    chunks = flow_chunks(order, n_tokens, probes, flow_batch)
    mels = _mels(engine, voice, chunks, {**tokens_a, **alone.tokens})
    audio = _audio(engine, chunks, {**mels, **alone.mel})
    return {
        "flow_mel_identical": sum(_same(mels[p], alone.mel[p]) for p in probes),
        "flow_mel_max_abs": _max_abs([(mels[p], alone.mel[p]) for p in probes]),
        "hift_audio_identical": sum(_same(audio[p], alone.audio[p]) for p in probes),
        "hift_audio_max_abs": _max_abs([(audio[p], alone.audio[p]) for p in probes]),
        "audio_rms": round(float(np.sqrt(np.mean(np.concatenate([alone.audio[p] for p in probes]) ** 2))), 4),
        "note": "flow: same tokens alone vs in A's flow batch; HiFT: same mel alone vs in A's HiFT batch",
    }


def decide(per: dict[str, dict]) -> dict:
    """fp32's cost vs bf16 (x real time through the Pipeline; LLM tokens/s beside it) and, per dtype,
    whether it gave identical tokens / audio for every probe at <= MAX_COST_PCT cost."""
    out: dict = {"max_cost_pct": MAX_COST_PCT, "cost_basis": "x_realtime of the engine through the worker's Pipeline"}
    bf, fp = per.get("bfloat16"), per.get("float32")
    cost = {"bfloat16": 0.0}
    if bf and fp:
        cost["float32"] = out["fp32_x_realtime_cost_pct"] = round(100 * (1 - fp["x_realtime"] / bf["x_realtime"]), 1)
        out["fp32_llm_cost_pct"] = round(100 * (1 - fp["llm_tokens_per_s_corpus"] / bf["llm_tokens_per_s_corpus"]), 1)
    for name, r in per.items():
        c = cost.get(name)
        cheap = c is not None and c <= MAX_COST_PCT
        out[name] = {"tokens_identical_all": r["tokens_identical"] == r["probes"],
                     "audio_identical_all": r.get("audio_identical") == r["probes"], "cost_pct": c}
        out[name]["meets_identical_tokens"] = out[name]["tokens_identical_all"] and cheap
        out[name]["meets_identical_audio"] = out[name]["audio_identical_all"] and cheap
    if bf and bf["effective_llm_dtype"] != "bfloat16":
        out["recommend"] = f"nothing to decide here: the LLM ran {bf['effective_llm_dtype']} for every dtype (no GPU)"
    elif bf and out["bfloat16"]["meets_identical_tokens"]:
        out["recommend"] = "keep bfloat16: its tokens were identical for every probe (no cost)"
    elif fp and out["float32"]["meets_identical_tokens"]:
        out["recommend"] = f"make float32 the default: identical tokens at {cost['float32']}% cost"
    elif fp and out["float32"]["tokens_identical_all"]:
        out["recommend"] = f"keep bfloat16: float32 gives identical tokens but costs {cost['float32']}% (> {MAX_COST_PCT}%)"
    else:
        out["recommend"] = "neither dtype gave identical tokens for every probe"
    return out


def invariance_stage(bench, run: dict[str, str], run_pipeline: Callable) -> dict:
    """The stage: probes, compositions, one engine per dtype, the decision (see the module docstring).
    `bench`: gpu_engine's Bench (corpus, args, engine_env, storage_root); `run`: --invariance-run parsed."""
    a = bench.args
    n = min(a.invariance_segments, len(bench.corpus))
    probes = choose_probes([s.speech_tokens for s in bench.corpus], n, a.invariance_probes)
    ways = compositions(len(bench.corpus), n, probes)
    per = {}
    for i, dtype in enumerate(a.invariance_dtypes):
        per[dtype] = one_dtype(bench, run, dtype, probes, ways, run_pipeline, parts=i == 0)
        r = per[dtype]
        print(f"  invariance {dtype}: tokens {r['tokens_identical']}/{r['probes']}, audio {r['audio_identical']}/{r['probes']} "
              f"identical (max abs {r['audio_max_abs']}); LLM {r['llm_tokens_per_s_corpus']} tok/s, {r['x_realtime']}x realtime", flush=True)
    return {"config": a.invariance_run, "segments": n, "probes": probes,
            "probe_speech_tokens": sorted({bench.corpus[p].speech_tokens for p in probes}),
            "compositions": {k: {"segments": len(v), "first": v[:8]} for k, v in ways.items()},
            "dtypes": per, "decision": decide(per),
            "note": "alone = one row through LLM, flow and HiFT; A/B = inside N mixed segments at the configured rows, "
                    "vocoded in flow batches of the probes' length bucket; identical = bit-identical vs alone in both A and B"}


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def table_lines(st: dict) -> list[str]:
    """Markdown lines of the stage for gpu_engine's report."""
    lines = [f"## Re-render identity ({st['config']}; {st['segments']} segments, {len(st['probes'])} probes of "
             f"{st['probe_speech_tokens']} speech tokens)", "",
             "| LLM dtype (effective) | tokens identical | mel identical | audio identical | audio max abs | "
             "mel max abs (same tokens) | LLM tokens/s (corpus) | x real time | alone rerun identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in st["dtypes"].items():
        k = r["probes"]
        lines.append(f"| {name} ({r['effective_llm_dtype']}) | {r['tokens_identical']}/{k} | {r['mel_identical']}/{k} | "
                     f"{r['audio_identical']}/{k} | {_e(r['audio_max_abs'])} | {_e(r['mel_max_abs_same_tokens'])} | "
                     f"{r['llm_tokens_per_s_corpus']:,.0f} | {r['x_realtime']} | {r['alone_rerun_identical']} |")
    parts = next((r["acoustic_parts"] for r in st["dtypes"].values() if "acoustic_parts" in r), None)
    if parts:
        k = len(st["probes"])
        lines += ["", f"Parts with their input held: flow mel identical {parts['flow_mel_identical']}/{k} (max abs "
                      f"{_e(parts['flow_mel_max_abs'])}); HiFT audio identical {parts['hift_audio_identical']}/{k} "
                      f"(max abs {_e(parts['hift_audio_max_abs'])}; audio RMS {parts['audio_rms']})"]
    d = st["decision"]
    lines += ["", f"Decision: fp32 costs {d.get('fp32_x_realtime_cost_pct')}% x real time "
                  f"({d.get('fp32_llm_cost_pct')}% LLM tokens/s); {d['recommend']}", ""]
    return lines
