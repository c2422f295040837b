"""Code constants the benchmarks flip for an A/B (bench switches), in this process or in a worker's.

`SWITCHES` maps a short key of a run spec ('prepare=0', 'lag=4') to the module constant it sets. The
engine stage sets them in its own process for one run (`switched`); the worker stage's A/B sets them
in the `voxbatch worker` processes it starts (`worker_env` / `apply_from_env`): the real worker then
runs with that one constant changed and nothing else, so a change to the job's start or end (where
the engine stage cannot see Celery's threads) is measured where it matters.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "BENCH_SWITCHES"  # 'key=value,...' for the worker processes (read by worker_site/sitecustomize.py)
SITE = Path(__file__).resolve().parent / "worker_site"


def _flag(v: str) -> bool:
    return v in ("1", "true")


def _dtype(v: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[v]


# Engine-stage A/B of scheduler and kernel choices that are code constants, not settings: key ->
# (module, attribute, parse). Set in this process for one run and restored after (engine stage only).
SWITCHES = {
    "prio": ("voxbatch.worker.cosyvoice2.streaming", "LLM_STREAM_PRIORITY", int),
    "longest": ("voxbatch.worker.cosyvoice2.streaming", "LONGEST_FIRST", _flag),
    "idle_div": ("voxbatch.worker.cosyvoice2.streaming", "IDLE_BATCH_DIV", int),
    "start_div": ("voxbatch.worker.cosyvoice2.streaming", "START_BATCH_DIV", int),
    "octave": ("voxbatch.worker.cosyvoice2.streaming", "BUCKETS_PER_OCTAVE", int),
    "fused_llm": ("voxbatch.worker.cosyvoice2.llm", "FUSED_KERNELS", _flag),
    "fused_norm": ("voxbatch.worker.cosyvoice2.flow_estimator", "FUSED_NORM", _flag),
    "lag": ("voxbatch.worker.cosyvoice2.torch_backend", "LOOK_LAG", int),
    "hift_quantum": ("voxbatch.worker.cosyvoice2.engine", "HIFT_FRAME_QUANTUM", int),
    "f0_quantum": ("voxbatch.worker.cosyvoice2.hift", "F0_FRAME_QUANTUM", int),
    "f0_graphs": ("voxbatch.worker.cosyvoice2.hift", "F0_ROW_GRAPHS", _flag),
    "phase_graphs": ("voxbatch.worker.cosyvoice2.hift", "PHASE_IN_ROW_GRAPH", _flag),
    "hift_cl": ("voxbatch.worker.cosyvoice2.hift", "CHANNELS_LAST", _flag),
    "varlen": ("voxbatch.worker.cosyvoice2.flow_estimator", "VARLEN_ATTENTION", _flag),
    "packed": ("voxbatch.worker.cosyvoice2.llm", "PACKED_PREFILL", _flag),
    "rope": ("voxbatch.worker.cosyvoice2.llm", "FUSED_DECODE_ROPE", _flag),
    "merge": ("voxbatch.worker.cosyvoice2.streaming", "TAIL_MERGE", _flag),
    "regrow": ("voxbatch.worker.cosyvoice2.streaming", "BUDGET_REGROW_STEPS", int),
    "llock": ("voxbatch.worker.cosyvoice2.streaming", "LAUNCH_LOCK", _flag),
    "vprio": ("voxbatch.worker.cosyvoice2.streaming", "PRIMARY_VOCODER_PRIORITY", int),
    "split": ("voxbatch.worker.cosyvoice2.streaming", "TAIL_SPLIT", _flag),
    "ahead": ("voxbatch.worker.cosyvoice2.streaming", "VOCODER_LOOKAHEAD", _flag),
    "pipe": ("voxbatch.worker.cosyvoice2.streaming", "VOCODER_PIPELINE", _flag),
    "gelu": ("voxbatch.worker.cosyvoice2.flow_estimator", "GELU_EPILOGUE", _flag),
    "resid": ("voxbatch.worker.cosyvoice2.flow_estimator", "DEFERRED_BIAS", _flag),
    "temb": ("voxbatch.worker.cosyvoice2.flow_estimator", "TIME_EMBEDDING_IN_NORM", _flag),
    "enc_sdpa": ("voxbatch.worker.cosyvoice2.flow_encoder", "ENCODER_SDPA", _flag),
    "source": ("voxbatch.worker.cosyvoice2.hift", "BATCHED_SOURCE", _flag),
    "draws": ("voxbatch.worker.cosyvoice2.hift", "IN_PLACE_DRAWS", _flag),
    "gather": ("voxbatch.worker.cosyvoice2.engine", "GATHER_TO_HIFT", _flag),
    "prepare": ("voxbatch.worker.cosyvoice2.engine", "PREPARE_AT_ENQUEUE", _flag),
    "together": ("voxbatch.worker.cosyvoice2.engine", "PREPARE_TOGETHER", _flag),
    "rows_copied": ("voxbatch.worker.cosyvoice2.engine", "ROWS_COPIED", _flag),
    "hift_frames": ("voxbatch.worker.cosyvoice2.engine", "HIFT_FRAMES_PER_CALL", int),
    "hift_dtype": ("voxbatch.worker.cosyvoice2.engine", "HIFT_GPU_DTYPE", _dtype),
    "epilogue": ("voxbatch.worker.cosyvoice2.hift", "FUSED_CONV_EPILOGUE", _flag),
    "snake_epi": ("voxbatch.worker.cosyvoice2.hift", "SNAKE_IN_EPILOGUE", _flag),
    "fa3": ("voxbatch.worker.cosyvoice2.flash_varlen", "FA3", _flag),
    "fa3_splits": ("voxbatch.worker.cosyvoice2.flash_varlen", "FA3_SPLITS", int),
    "fa3_q": ("voxbatch.worker.cosyvoice2.flash_varlen", "FA3_SKIP_PADDING", _flag),
    "llm_fa3": ("voxbatch.worker.cosyvoice2.flash_varlen", "DECODE_FA3", _flag),
    "graphs": ("voxbatch.worker.cosyvoice2.flow", "EULER_STEP_GRAPHS", _flag),
    "cf": ("voxbatch.worker.cosyvoice2.flow", "EULER_CAPTURE_FIRST", _flag),
    "gcache": ("voxbatch.worker.cosyvoice2.flow", "STEP_GRAPH_CACHE", _flag),
    "gcache_rows": ("voxbatch.worker.cosyvoice2.flow", "GRAPH_ROW_QUANTUM", int),
    "gcache_max": ("voxbatch.worker.cosyvoice2.flow", "GRAPH_CACHE_MAX_ROWS", int),
    "vstream": ("voxbatch.worker.cosyvoice2.vllm_backend", "CONTINUOUS_STREAM", _flag),
    "vfinal": ("voxbatch.worker.cosyvoice2.vllm_backend", "FINAL_ONLY", _flag),
    "sfwav": ("voxbatch.audio", "WAV_BY_LIBSNDFILE", _flag),
    "book_stream": ("voxbatch.producer.assemble", "BOOK_WHILE_ASSEMBLING", _flag),
    "render_warm": ("voxbatch.embedded", "WARM_GRAPHS_AT_START", _flag),
    "glock": ("voxbatch.worker.cosyvoice2.cuda_graphs", "SERIALIZED", _flag),
}



@contextmanager
def switched(run: dict[str, str]) -> Iterator[None]:
    """The run's SWITCHES set on their modules for the duration (this process)."""
    saved = []
    try:
        for key, (module, attr, _) in SWITCHES.items():
            if key in run:
                mod = importlib.import_module(module)
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, parse_switch(key, run[key]))
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def worker_env(run: dict[str, str], pythonpath: str) -> dict[str, str]:
    """Environment variables that set the run's SWITCHES in the worker processes started with them
    (none when the run has none): ENV, and SITE first on PYTHONPATH, whose sitecustomize reads it."""
    chosen = {k: v for k, v in run.items() if k in SWITCHES}
    if not chosen:
        return {}
    return {ENV: ",".join(f"{k}={v}" for k, v in chosen.items()), "PYTHONPATH": os.pathsep.join([str(SITE), pythonpath])}


class _SetOnImport(importlib.abc.MetaPathFinder):
    """Sets the switches of a module right after it is first imported (before anything uses it)."""

    def __init__(self, settings: dict[str, list[tuple[str, object]]]):
        self.settings = settings

    def find_spec(self, name, path, target=None):
        if name not in self.settings:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, values = spec.loader, self.settings[name]

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for attr, value in values:
                    if not hasattr(module, attr):
                        raise AttributeError(f"{ENV}: {name} has no {attr}")
                    setattr(module, attr, value)

        spec.loader = _Loader()
        return spec


def parse_switch(key: str, value: str) -> object:
    """The value switch `key` sets; SystemExit naming the switch for an unknown key or a bad value (the
    bench checks every spec this way before it starts anything)."""
    if key not in SWITCHES:
        raise SystemExit(f"unknown bench switch {key!r} (switches: {', '.join(SWITCHES)})")
    try:
        return SWITCHES[key][2](value)
    except (KeyError, ValueError) as e:
        raise SystemExit(f"bench switch {key}={value!r}: not a valid value ({type(e).__name__}: {e})") from None


def parse_switches(spec: str) -> dict[str, str]:
    """'book_stream=0,prepare=0' -> {'book_stream': '0', ...}, each checked by `parse_switch` (for
    benchmarks that take switches alone, without the GPU bench's run keys)."""
    out = {}
    for part in filter(None, spec.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise SystemExit(f"bad switch spec {spec!r}: use key=value pairs")
        parse_switch(key, value)
        out[key] = value
    return out


def apply_from_env() -> None:
    """In a process started with `worker_env`: set its switches on their modules as they are imported.
    A bad spec ends the process (SystemExit): a worker that ran without its switch would be measured as
    the variant it is not."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    settings: dict[str, list[tuple[str, object]]] = {}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        module, attr, _ = SWITCHES.get(key, (None, None, None))
        value = parse_switch(key, value)
        settings.setdefault(module, []).append((attr, value))
    for module, values in settings.items():
        if module in sys.modules:  # already imported: set now
            for attr, value in values:
                setattr(sys.modules[module], attr, value)
    sys.meta_path.insert(0, _SetOnImport(settings))
