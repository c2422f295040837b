"""All of voxbatch's settings, read from the environment in this one place.

Every process (producer CLI, worker, assembler, embedded renderer) builds one `Settings` and passes it
down; nothing else reads `os.environ`. Variables are `VOXBATCH_<FIELD>` (e.g. `VOXBATCH_BROKER_URL`),
plus the usual `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_REGION` for S3.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

AudioFormat = Literal["wav", "flac", "ogg", "opus", "mp3", "m4a"]
# Mastering presets for delivery (voxbatch/producer/mastering.py); "none" keeps chapters as assembled.
PresetName = Literal["none", "acx", "podcast"]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="VOXBATCH_", frozen=True, extra="ignore", populate_by_name=True
    )

    # Redis URL used both as the Celery broker and for job state (db 0 unless the URL says otherwise).
    # May carry a password (redis://:PASSWORD@host): kept out of repr(settings) and so out of logs.
    broker_url: str = Field("redis://127.0.0.1:6379/0", repr=False)
    # Where job specs, voices and audio live: s3://bucket/prefix or file:///abs/path (the embedded default).
    storage_url: str = "file://./voxbatch-data"
    # S3 endpoint for S3-compatible stores (SeaweedFS, MinIO, R2); None means AWS itself.
    s3_endpoint: str | None = None
    # S3 credentials and region, read as AWS_* (the VOXBATCH_ names work too); kept out of logs.
    aws_access_key_id: SecretStr | None = Field(
        None, validation_alias=AliasChoices("AWS_ACCESS_KEY_ID", "VOXBATCH_AWS_ACCESS_KEY_ID")
    )
    aws_secret_access_key: SecretStr | None = Field(
        None, validation_alias=AliasChoices("AWS_SECRET_ACCESS_KEY", "VOXBATCH_AWS_SECRET_ACCESS_KEY")
    )
    aws_region: str = Field("us-east-1", validation_alias=AliasChoices("AWS_REGION", "VOXBATCH_AWS_REGION"))

    # Output container for segment and chapter audio.
    output_format: AudioFormat = "wav"
    # Segments per render task: small enough to spread over workers, large enough to batch on the GPU.
    batch_size: int = Field(16, ge=1, le=1024)
    # Celery queue names.
    render_queue: str = "render"
    assemble_queue: str = "assemble"

    # Engine: "tone" (pipeline test / capacity planning) or "cosyvoice2".
    engine: Literal["tone", "cosyvoice2"] = "tone"
    # Tone engine only: seconds of compute to simulate per second of audio (0 = as fast as possible);
    # lets a CPU worker stand in for a GPU of a given real-time factor in tests and capacity planning.
    tone_rtf: float = Field(0.0, ge=0.0)
    # CosyVoice2 model directory (official layout); None means download from a hub when online.
    model_dir: str | None = None
    # Language-model backend for cosyvoice2.
    llm_backend: Literal["torch", "vllm"] = "torch"
    # Device placement, e.g. "cuda:0"; flow/hift may sit on another GPU than the LLM.
    llm_device: str | None = None
    flow_device: str | None = None
    hift_device: str | None = None
    # Share of GPU memory vLLM may take (the rest stays for flow/HiFT on the same GPU).
    vllm_gpu_memory_utilization: float = Field(0.45, gt=0.0, le=1.0)
    # vLLM's max_model_len: prompt + speech tokens one request may hold; the engine caps a segment's
    # max_tokens (20 x its text tokens) to fit, as it does for the torch backend's KV cache.
    vllm_max_model_len: int = Field(4096, ge=64)
    # Where vLLM's engine core runs. None: in a process of its own on a GPU, in the worker's process
    # on a CPU. On an H200 the worker's engine on vLLM ran at 267.2x real time with the core in its
    # own process against 190.8x in the worker's (bench/results/gpu_h200_vllm7_log.txt,
    # gpu_h200_vllm8.json; the LLM alone is faster in-process, 18.2k vs 14.5k tokens/s,
    # gpu_h200_vllm5.json: in the worker its scheduling competes for the GIL with flow/HiFT). The real
    # `voxbatch worker` process, H100, tasks of 16: 244.6x / 272.1x own process vs 221.9x in the worker's
    # (bench/results/gpu_h100_s38c_vllm_worker.json); before the core was spawned rather than forked
    # that worker never started (gpu_h100_s38_vllm_worker_log.txt). Needs
    # voxbatch installed (the model class reaches that process through the package's
    # vllm.general_plugins entry point); without it the core runs in the worker's process, with a warning.
    vllm_engine_process: bool | None = None
    # vLLM's asynchronous scheduling (step N+1 scheduled while step N runs). None: vLLM's choice (on).
    # Off measured faster for the LLM alone (17.8k vs 14.5k tokens/s, one run each,
    # gpu_h200_vllm5.json), but the worker's engine with it off has no clean run yet (its one run
    # aborted, gpu_h200_vllm7_log.txt), so the default stays vLLM's.
    vllm_async_scheduling: bool | None = None
    # Largest vLLM step, in tokens, replayed from CUDA graphs; a step that admits a prompt beside
    # the decoding rows is larger than vLLM's default (2 x rows, at most 512). None: vLLM's default
    # (1024 measured mixed: 15.8k vs 14.5k tokens/s on the corpus, 19.6k vs 21.3k at fixed rows, gpu_h200_vllm5.json).
    vllm_cudagraph_max_tokens: int | None = Field(None, ge=1, le=8192)
    # vLLM's CUDA-graph mode. None: vLLM's (FULL_AND_PIECEWISE with FlashAttention-3: whole-model graphs
    # for decode-only steps, and a step that admits a prompt runs layer by layer, its attention
    # eager between graphed pieces: on an H100 the piecewise launches were 15% of the in-process
    # LLM thread's samples, bench/results/gpu_h100_s37_vllm_pyspy.txt). FULL: every step up to
    # vllm_cudagraph_max_tokens is one graph, refill steps too (FlashAttention-3 graphs mixed batches);
    # with vLLM 0.26.0 on an H200 that engine hit an illegal memory access while profiling its graphs'
    # memory (bench/results/gpu_h200_s37b_vllm_log.txt), so it is not the default.
    vllm_cudagraph_mode: Literal["FULL", "FULL_AND_PIECEWISE", "PIECEWISE", "NONE"] | None = None
    # Requests handed to vLLM together: waiting requests join once this many rows are free (or all
    # that wait fit), so prompts are prefilled in a few batched steps instead of one beside every
    # freed row (each such step runs outside the decode step's whole-model graph). None: the engine's
    # rows // 8, as the torch backend refills (32 at 256 rows); 1: as soon as a row frees. On an H200
    # at 256 rows, corpus longest text first, 32 against 1: 16.9k vs 14.0k tokens/s in-process,
    # 16.5k vs 14.4k and (A B A B) 15.4k, 16.3k vs 13.2k, 12.3k with the core in its own process
    # (bench/results/gpu_h200_s37c_vllm.json, gpu_h200_s37d_vllm.json).
    vllm_admit_group: int | None = Field(None, ge=1)
    # CUDA stream priority of vLLM's model steps (lower is more urgent; flow/HiFT run at 0, the torch
    # backend's decode step at -1). None: vLLM's own stream, at 0 beside flow/HiFT. Why it might pay:
    # the worker on vLLM kept the GPU 58-69% busy in its LLM phase against 94% on torch, whose step
    # runs above the vocoder's streams (bench/results/gpu_h100_s38b_vllm_worker.json). Not measured
    # yet: unset until a worker A/B on a GPU (bench run key `vpriority`, e.g. `vpriority=-1`).
    vllm_stream_priority: int | None = Field(None, ge=-5, le=0)
    # vLLM engines sharing the GPU, each with its own core process, engine_max_batch / this many rows
    # and that share of vllm_gpu_memory_utilization; each segment goes to the engine holding the fewest.
    # Why it might pay: a vLLM step at 256 rows is ~10 ms of which ~3 ms is GPU work, the rest one
    # Python thread (bench/results/gpu_h100_s37_vllm_pyspy.txt); two cores do that host work side by
    # side. Needs the cores in their own processes (vllm_engine_process). Measured on an H100: the LLM
    # alone at 256 rows, corpus longest text first, 22.5k tokens/s with 2 and 13.7k with 4 against 21.1k
    # with 1, and 24.9k vs 31.6k at 256 fixed rows (bench/results/gpu_h100_s40b_vllm.json); the worker
    # 260.7x with 2 against 256.2x with 1, one pair (gpu_h100_s40c_vllm_worker_log.txt). Inside the
    # spread: 1 stays the default (bench run key `vengines`). Under CUDA MPS (each core a client of one
    # daemon, so their kernels run side by side) they did worse: 17.7k tokens/s with 2 and 13.5k with 4
    # against 22.1k with 1, same run (bench/results/gpu_h100_s42a_vllm_mps.json).
    vllm_engines: int = Field(1, ge=1, le=8)
    # `voxbatch worker` starts a CUDA MPS control daemon of its own for its workers (voxbatch/worker/mps.py),
    # so that a worker's flow/HiFT kernels and its vLLM engine core's (another process) run side by side
    # instead of in the driver's time slices; the torch backend is one process and gains nothing. Needs
    # nvidia-cuda-mps-control on PATH. Off: no gain seen. The worker on vLLM ran 263.2x real time with
    # it (bench/results/gpu_h100_s42c_vllm_worker_mps.json) and 263.6x without (the A run of
    # gpu_h100_s42b_vllm_worker_stop_log.txt), on H100s of two calls, not one run; several vLLM cores
    # under MPS were slower still (vllm_engines). Bench run key `mps` (`--worker-run
    # backend=vllm,task=16 --worker-ab mps=true`).
    cuda_mps: bool = False
    # Most segments the engine decodes at once (the torch backend's KV-cache rows, vLLM's max_num_seqs).
    # None: the engine picks (`llm_rows`, voxbatch/worker/cosyvoice2/engine.py): 256 with the LLM on
    # a GPU, the fastest measured (bench/results/gpu_h200_worker.json), halved until the torch
    # backend's KV cache fits in 40% of the GPU's free memory (256 rows of CosyVoice2-0.5B in bf16
    # are 12 GiB: 128 rows on a 24 GB card); 16 on a CPU; the tone engine 64.
    engine_max_batch: int | None = Field(None, ge=1)
    # Most rows in one flow + HiFT batch (length-bucketed). Unset: half the engine's LLM rows, at most
    # 128 (the fastest measured on an H200: 128 rows on 256 LLM rows, bench/results/h200_probe1.json).
    engine_flow_batch: int | None = Field(None, ge=1)
    # Most GPU memory (GiB) the engine's torch side may take on each GPU it runs on (torch's per-process
    # fraction of the card): to share a card with another process, or to let a big card stand in for a
    # smaller one. None: the whole card. The torch backend's rows are sized within it (`llm_rows`), and a
    # flow/HiFT batch that does not fit renders again in halves, later batches kept within what fit
    # (streaming._Vocoder.token_budget). vLLM's own share is vllm_gpu_memory_utilization.
    engine_gpu_memory_gib: float | None = Field(None, gt=0)
    # Threads that run flow + HiFT batches, each on its own CUDA stream, so one batch's host work and
    # small kernels overlap another's. None: 2 with flow on a GPU (engine 261.2x vs 247.1x with one
    # on an H200, 2.5 GiB more peak memory, bench/results/gpu_h200_vocoders1.json), 1 on a CPU. Set 1
    # on a GPU short of memory: two flow batches are in flight at once.
    engine_vocoder_threads: int | None = Field(None, ge=1, le=8)
    # LLM precision on a GPU ("auto": bf16; a CPU always runs fp32). It sets what a segment re-rendered
    # in another batch (a retry, a solo re-render) keeps. "float32": the same speech tokens, so the same
    # words, timing and length, and a mel within the flow's fp16 rounding (fp32 logits still differ per
    # batch shape by rounding, which moved no draw in 4 of 4 segments on an H200,
    # bench/results/gpu_tests_h200.txt). Audio is never bit-identical: the flow (fp16) and HiFT pick
    # kernels per batch shape and HiFT integrates F0 into phase, so samples move. "bfloat16": none of
    # it (H200: 0 of 8 probes kept their tokens in another batch). Measured in one run
    # (bench/results/gpu_h200_engine.json, invariance): float32 kept 8 of 8 probes' tokens but cost
    # 71% of the x real time, so the default stays bf16; an unchanged segment is reused from storage
    # instead of re-rendered (the content cache). tests/test_gpu_batch_invariance.py asserts this.
    llm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # Benchmark only: every segment decodes exactly as many speech tokens as real speech of its text
    # would (forced_lengths.py), because random-weight models never stop. Changes nothing else.
    engine_forced_lengths: bool = False

    # The double buffer: bounded queue between the engine and the upload threads.
    output_queue_size: int = Field(64, ge=1)
    # Threads that encode and store finished segments (and look up stored/cached ones).
    upload_threads: int = Field(4, ge=1, le=256)
    # Render tasks a worker process runs at once (Celery thread pool); they feed one engine intake.
    # None: enough tasks of batch_size to hold worker_inflight_segments (voxbatch/worker/budget.py).
    task_concurrency: int | None = Field(None, ge=1)
    # Segments a worker process holds in flight, whatever its tasks' size; None: 2 x the engine's rows
    # (engine_max_batch as resolved; the engine refills LLM rows from the rest as sequences finish).
    worker_inflight_segments: int | None = Field(None, ge=1)
    # How long a Python thread holds the GIL before another waiting one gets it (sys.setswitchinterval,
    # set when a pipeline starts; Python's own is 5 ms). The engine's LLM and flow/HiFT threads both
    # launch GPU work from Python: at 5 ms the LLM thread can wait a whole interval per decode step
    # while the vocoder thread launches flow kernels, and its stream runs dry (engine 256.9x at 1 ms vs
    # 249.5x at 5 ms in one H200 run, bench/results/gpu_h200_worker4.json). Shorter is no faster: the
    # worker on an H100, tasks of 16, 335.2x at 0.2 ms vs 338.7x / 337.9x at 1 ms (B/A 0.991,
    # bench/results/gpu_h100_s43a_worker.json).
    gil_switch_interval_ms: float = Field(1.0, gt=0, le=100)
    # Log when the engine admits segments, starts or refills an LLM decode session and runs each
    # flow/HiFT batch with its host time (logger `voxbatch.timeline`, a few lines per batch;
    # voxbatch/worker/timeline.py), and start a GIL probe that logs how late a waking thread gets
    # the GIL (10 lines a second). For finding where a job's GPU time goes; the GPU benchmark's
    # worker stage turns it on.
    timeline_log: bool = False
    # A folder through which the GPU benchmark asks this worker for a torch-profiler trace of one job,
    # reduced to where the GPU sat idle and which thread kept it waiting (voxbatch/worker/gpu_trace.py).
    # Empty: off. A diagnostic: the trace slows the job it covers.
    gpu_trace_dir: str = ""

    # Failure handling: a segment is retried this many times in all before it is recorded failed.
    # Only errors of the segment itself (the engine failed on it) count; outages never do.
    max_attempts: int = Field(3, ge=1)
    # Wait before a segment's next attempt: jittered, doubling from retry_backoff_ms up to the max.
    retry_backoff_ms: int = Field(500, ge=0)
    retry_backoff_max_ms: int = Field(30_000, ge=0)
    # How long a rendered segment keeps its audio and retries its upload through a storage outage
    # before it is recorded failed with the outage as its reason. Redis outages are waited out.
    outage_window_s: float = Field(900.0, ge=0.0)
    # Longest segment text (characters) a worker renders: about what the model can speak in one go
    # (CosyVoice2: ~80 text tokens per segment by the official rules, speech tokens capped at 20x
    # text tokens within the LLM context). A longer one is recorded failed, never rendered.
    max_segment_chars: int = Field(1000, ge=1, le=20_000)

    # On SIGTERM a worker finishes in-flight segments for this long (capped at the visibility
    # timeout), then hands unfinished tasks back to the queue and exits.
    shutdown_window_s: float = Field(60.0, ge=0.0)
    # Broker visibility timeout: a task held this long without a heartbeat goes back to the queue.
    # Workers refresh their running tasks every `task_heartbeat_s`, so it bounds how long a dead
    # worker's tasks wait, not how long a task may run.
    visibility_timeout_s: int = Field(60, ge=10)
    # How often a worker marks the tasks it is running as alive (well under the visibility timeout).
    task_heartbeat_s: float = Field(10.0, gt=0)
    # The sweeper (in `voxbatch assembler`): how often it looks for segments that are neither done,
    # failed, queued nor in flight; one missing in two looks in a row is re-enqueued.
    sweep_interval_s: float = Field(30.0, gt=0)
    # How often kombu restores unacked messages of dead workers (its default is ~100 s).
    unacked_restore_interval_s: float = Field(5.0, gt=0)

    # Assembly: silence between segments and between paragraphs/chapters.
    pause_ms: int = Field(250, ge=0)
    chapter_lead_ms: int = Field(500, ge=0)

    # Delivery mastering of chapters (producer/mastering.py): "acx" (ACX audiobook specs: MP3 192 kb/s
    # CBR 44.1 kHz mono, RMS -23..-18 dB, peaks <= -3 dBFS, room tone, credits as their own files),
    # "podcast" (-16 LUFS, true peak <= -1 dBTP, MP3 or AAC), "none" (chapters as assembled).
    preset: PresetName = "none"
    # Longest chapter file a preset delivers (ACX: 120 min); longer chapters split at segment boundaries.
    master_max_file_s: float = Field(7200.0, gt=0)
    # ACX opening/closing credits, spoken by the job's voice as their own files ({title}, {author} are
    # filled in; None: "<title>. Written by <author>." / "The end. ...").
    credits_opening: str | None = None
    credits_closing: str | None = None
    # EPUB: also read spine items marked linear="no" or missing from the table of contents (covers, ads).
    epub_all_spine: bool = False

    # Prometheus metrics port of a worker (0 = off); per-GPU workers use port + gpu index.
    metrics_port: int = Field(0, ge=0, le=65535)

    # Limits on untrusted input; each refusal is one line naming the file or job and the limit.
    # Corpus bytes on disk (one file, or a folder's files together): 32 MiB is ~25 long novels.
    max_corpus_bytes: int = Field(32 * 2**20, ge=1)
    # An EPUB's members inflated, all together (read from the zip directory before inflating).
    max_epub_uncompressed_bytes: int = Field(256 * 2**20, ge=1)
    # Inflated / compressed bytes of one EPUB member over 1 MiB: XHTML deflates 3-10x, a zip bomb ~1000x.
    max_epub_ratio: float = Field(100.0, gt=1.0)
    # Segments in one job (a 32 MiB corpus makes ~200k of ~160 characters).
    max_segments_per_job: int = Field(250_000, ge=1)
    # Bytes of a stored job spec (jobs/<id>/job.json): the whole segmented text plus ~60 bytes a segment.
    max_job_spec_bytes: int = Field(96 * 2**20, ge=1)
    # A job no worker has touched for this long gets a hint in `status --watch` and `jobs`; workers
    # refresh a heartbeat in Redis this often (it expires after 3 beats).
    worker_heartbeat_s: float = Field(10.0, gt=0)
    stalled_after_s: float = Field(60.0, gt=0)

    # Show the traceback of an unexpected error (a bug) after its one-line message.
    debug: bool = False

    @field_validator("storage_url")
    @classmethod
    def _storage_scheme(cls, v: str) -> str:
        if not (v.startswith("s3://") or v.startswith("file://")):
            raise ValueError(f"storage_url must start with s3:// or file://, got {v!r}")
        return v


    @model_validator(mode="after")
    def _vllm_engines_fit(self) -> "Settings":
        """Several vLLM engines need their cores in their own processes and at least a row each: said at
        start-up in one line, not by a worker that fails building its engine and is restarted in a loop."""
        if self.vllm_engines > 1 and self.vllm_engine_process is False:
            raise ValueError(f"vllm_engines {self.vllm_engines} needs each engine core in its own process "
                             "(vllm_engine_process is false)")
        if self.engine_max_batch is not None and self.vllm_engines > self.engine_max_batch:
            raise ValueError(f"vllm_engines {self.vllm_engines} is more than engine_max_batch "
                             f"{self.engine_max_batch} (each engine needs a row)")
        return self


def validation_problems(e) -> str:
    """A pydantic ValidationError as `bad Settings: field: problem; ...`, without the input values (a
    broker URL may hold a password): what the CLI and a worker that cannot start print."""
    problems = "; ".join(f"{'.'.join(str(p) for p in d['loc']) or 'value'}: {d['msg']}" for d in e.errors())
    return f"bad {e.title}: {problems}"


def load_settings(**overrides) -> Settings:
    """Settings from the environment, with explicit overrides (from CLI flags) on top."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
