"""`voxbatch worker` with no tuning runs the configuration that measured fastest.

The measured configuration is read from the committed H200 result (the worker stage's VOXBATCH_*
variables and the engine stage's derived budget), the model's dimensions from that result and from
the fixture's own files; the auto rows (`llm_rows`) are checked for the GPU, a smaller card and a CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from voxbatch.settings import Settings
from voxbatch.worker.budget import inflight_segments, task_threads
from voxbatch.worker.cosyvoice2.engine import CPU_ROWS, KV_CACHE_SHARE, CosyVoice2Engine, Placement, flow_rows, llm_rows
from voxbatch.worker.cosyvoice2.llm import LlmDims
from voxbatch.worker.cosyvoice2.torch_backend import MAX_SEQ
from voxbatch.worker.tone import ToneEngine

REPO = Path(__file__).resolve().parents[1]
RESULT = json.loads((REPO / "bench" / "results" / "gpu_h200_worker.json").read_text())  # the headline worker
ENGINE_RESULT = json.loads((REPO / "bench" / "results" / "gpu_h200_engine.json").read_text())  # same session: engine A/Bs
GIB = 2**30


def gpu(dtype: torch.dtype = torch.bfloat16) -> Placement:
    return Placement("cuda:0", "cuda:0", "cuda:0", dtype, torch.float16, torch.float32)


def full_size_kv_bytes_per_row(dtype: torch.dtype) -> int:
    """One KV-cache row of the measured model (CosyVoice2-0.5B sizes, as the result recorded them)."""
    d = RESULT["model"]["llm_dims"]
    return 2 * d["n_layers"] * d["n_kv_heads"] * MAX_SEQ * d["head_dim"] * dtype.itemsize


def test_defaults_are_the_measured_configuration_on_the_measured_gpu():
    """The headline worker ran with what a worker with no tuning resolves to: every tuning variable
    it was given equals the default, and the first engine run (the same configuration) reports the
    rows, budget and threads the defaults give on that GPU."""
    env = RESULT["stages"]["worker"]["env"]
    engine_run = next(iter(ENGINE_RESULT["stages"]["engine"]["runs"].values()))
    assert engine_run["env"] == {k: v for k, v in env.items() if k in engine_run["env"]}  # the same configuration
    s = Settings()
    free = 140 * GIB  # an H200 with nothing else on it (the result's GPU)
    rows = llm_rows(gpu(), full_size_kv_bytes_per_row(torch.bfloat16), free_bytes=free)
    assert int(env.get("VOXBATCH_ENGINE_MAX_BATCH", rows)) == rows == engine_run["engine_rows"]
    assert s.engine_flow_batch is None
    assert int(env.get("VOXBATCH_ENGINE_FLOW_BATCH", flow_rows(rows))) == flow_rows(rows)
    assert int(env.get("VOXBATCH_BATCH_SIZE", s.batch_size)) == s.batch_size
    assert s.llm_dtype == env.get("VOXBATCH_LLM_DTYPE", s.llm_dtype)
    assert inflight_segments(s, rows) == engine_run["inflight_segments"]
    assert task_threads(s, rows) == engine_run["task_threads"]


def test_auto_rows_fit_the_kv_cache_in_a_smaller_gpu():
    per_row = full_size_kv_bytes_per_row(torch.bfloat16)
    free = 23 * GIB  # a 24 GB card
    rows = llm_rows(gpu(), per_row, free_bytes=free)
    assert rows < 256 and rows * per_row <= KV_CACHE_SHARE * free
    assert 2 * rows * per_row > KV_CACHE_SHARE * free  # the largest power-of-two step that fits
    fp32 = llm_rows(gpu(torch.float32), full_size_kv_bytes_per_row(torch.float32), free_bytes=free)
    assert fp32 == rows // 2
    assert llm_rows(gpu(), None, free_bytes=free) == 256  # vLLM sizes its own cache
    assert llm_rows(gpu(), per_row, free_bytes=GIB) == CPU_ROWS  # never below the CPU's rows


def test_the_kv_cache_formula_is_what_the_model_allocates(tiny_model_dir):
    from voxbatch.worker.cosyvoice2.llm import CosyVoice2LM

    model = CosyVoice2LM.from_model_dir(tiny_model_dir)
    model.setup_cache(3, 40)
    allocated = sum(t.numel() * t.element_size() for t in (model.cache_k, model.cache_v))
    assert model.dims.kv_cache_bytes(3, 40, torch.float32) == allocated


def test_a_cpu_engine_left_to_itself_takes_the_cpu_rows(tiny_model_dir, tmp_path):
    settings = Settings(engine="cosyvoice2", model_dir=str(tiny_model_dir), llm_device="cpu",
                        storage_url=tmp_path.as_uri())
    engine = CosyVoice2Engine.from_settings(settings)
    assert engine.max_batch == engine.llm.max_batch == CPU_ROWS
    assert engine.flow_batch == flow_rows(CPU_ROWS) == CPU_ROWS // 2
    assert engine.llm.model.cache_shape[0] == CPU_ROWS
    explicit = CosyVoice2Engine.from_settings(settings.model_copy(update={"engine_max_batch": 5}))
    assert explicit.max_batch == explicit.llm.model.cache_shape[0] == 5
    assert LlmDims.from_model_dir(tiny_model_dir) == engine.llm.model.dims
    assert ToneEngine().max_batch == ToneEngine.ROWS and ToneEngine(max_batch=3).max_batch == 3


def test_a_memory_cap_is_refused_at_zero_and_changes_nothing_on_a_cpu():
    import pydantic
    import pytest

    from voxbatch.worker.cosyvoice2.engine import cap_gpu_memory

    with pytest.raises(pydantic.ValidationError, match="engine_gpu_memory_gib"):
        Settings(engine_gpu_memory_gib=0)
    cpu = Placement("cpu", "cpu", "cpu", torch.float32, torch.float32, torch.float32)
    assert cap_gpu_memory(cpu, 24) is None and cap_gpu_memory(gpu(), None) is None


def test_a_memory_cap_holds_torch_within_it_and_sizes_the_rows_on_gpu():
    """Settings.engine_gpu_memory_gib on a GPU: torch allocates no more than the cap (out of memory past
    it, which the vocoder answers with smaller batches), and the rows are sized from what the cap leaves."""
    import pytest

    from voxbatch.worker.cosyvoice2.engine import cap_gpu_memory

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        free = cap_gpu_memory(gpu(), 2.0)
        assert free is not None and free <= 2 * GIB
        small = torch.empty(GIB // 2, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
        del small
        per_row = full_size_kv_bytes_per_row(torch.bfloat16)
        assert llm_rows(gpu(), per_row, free) == CPU_ROWS  # 2 GiB: the fewest rows
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        torch.cuda.empty_cache()


def test_running_out_of_memory_while_loading_under_a_cap_names_the_setting():
    """A cap below what the model needs is bad input: the load's out-of-memory error comes back as a
    ValueError naming VOXBATCH_ENGINE_GPU_MEMORY_GIB; without a cap, or for other errors, nothing changes."""
    import pytest

    from voxbatch.worker.cosyvoice2.engine import loading_within

    with pytest.raises(ValueError, match=r"VOXBATCH_ENGINE_GPU_MEMORY_GIB=1.5 is too little GPU memory"):
        with loading_within(1.5):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    with pytest.raises(torch.OutOfMemoryError):
        with loading_within(None):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(KeyError):
        with loading_within(1.5):
            raise KeyError("llm.pt")


def test_the_allocator_default_yields_to_the_users_own(monkeypatch):
    """The engine's CUDA allocator options go into the environment only where the user set none (either
    of PyTorch's two variables); with the default off, nothing is set at all."""
    from voxbatch.worker import engine as registry

    monkeypatch.setattr(registry, "CUDA_ALLOC_CONF", "expandable_segments:True")
    env: dict[str, str] = {}
    assert registry.default_allocator(env) == "expandable_segments:True"
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for var in registry.ALLOC_CONF_VARS:
        own = {var: "max_split_size_mb:128"}
        assert registry.default_allocator(own) == "max_split_size_mb:128"
        assert own == {var: "max_split_size_mb:128"}  # the user's choice stands, alone
    monkeypatch.setattr(registry, "CUDA_ALLOC_CONF", None)
    env = {}
    assert registry.default_allocator(env) is None and env == {}
