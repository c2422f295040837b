"""Where the CosyVoice2 weights come from: a local model directory, or a hub download when online.

Workers normally get `VOXBATCH_MODEL_DIR` pointing at an official `CosyVoice2-0.5B` folder. Without
one we try the Hugging Face hub once; offline (or without `huggingface_hub`) that fails, and the
error says the three ways to provide weights instead of showing a network traceback.
"""

from __future__ import annotations

from pathlib import Path

from voxbatch.model_files import MODEL_FILES, QWEN_DIR, ModelDirError

HUB_REPO = "FunAudioLLM/CosyVoice2-0.5B"
# What the engine itself reads (the two ONNX files are only needed to make voices, producer side).
ENGINE_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt", QWEN_DIR)

HOW_TO_PROVIDE = (
    "provide CosyVoice2 weights with --model-dir DIR or VOXBATCH_MODEL_DIR=DIR (an official CosyVoice2-0.5B "
    f"folder, e.g. `huggingface-cli download {HUB_REPO} --local-dir DIR` on a machine with internet), "
    "or make a random test model with `voxbatch model make-tiny DIR`"
)


class ModelUnavailableError(ModelDirError, OSError):
    """No model directory was given and none could be downloaded (an OSError too: it is the
    environment, not the input, that lacks something)."""


def check_model_dir(model_dir: str | Path, required: tuple[str, ...] = ENGINE_FILES) -> Path:
    """The directory as a Path, after checking every required file is there (the error names them all)."""
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist; {HOW_TO_PROVIDE}")
    missing = [name for name in required if not (path / name).exists()]
    if missing:
        what = "; ".join(f"{path / name} ({MODEL_FILES.get(name, 'required')})" for name in missing)
        raise ModelDirError(f"model directory {path} is incomplete, missing: {what}")
    return path


def download_model(repo_id: str = HUB_REPO) -> Path:
    """Download (or find in the local hub cache) the official model; a clear error when that fails."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelUnavailableError(f"no model directory set and huggingface_hub is not installed; {HOW_TO_PROVIDE}") from None
    try:
        return Path(snapshot_download(repo_id=repo_id))
    except Exception as e:  # noqa: BLE001 - offline, DNS, auth and cache misses all raise different types
        raise ModelUnavailableError(
            f"no model directory set and downloading {repo_id} from the hub failed ({type(e).__name__}); {HOW_TO_PROVIDE}"
        ) from e


def resolve_model_dir(model_dir: str | Path | None) -> Path:
    """settings.model_dir checked, or the hub download when it is None."""
    return check_model_dir(model_dir if model_dir is not None else download_model())
