"""Export the CosyVoice2 language model from `llm.pt` into a folder vLLM can load.

vLLM loads a model from an HF-style folder (`config.json` + safetensors). CosyVoice2's LM is a Qwen2
body whose input embedding, during decoding, is `speech_embedding` and whose head is `llm_decoder`
(with a bias), over a vocabulary of `speech_token_size + 3` speech tokens. Text never goes through
the engine: the prompt (sos, text, task_id, prompt speech) is handed over as embeddings, so the
folder needs no tokenizer (`skip_tokenizer_init=True`).

The folder is written once, atomically (temp dir + rename), next to the model when the model dir is
writable, else under `~/.cache/voxbatch/vllm/<key>`; it is reused while its stamp (llm.pt and config
sizes/mtimes + EXPORTER_VERSION) matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from voxbatch.worker.cosyvoice2.checkpoint import ModelDirError, load_state_dict
from voxbatch.worker.cosyvoice2.llm import QWEN_DIR, LlmDims

EXPORTER_VERSION = 1
ARCHITECTURE = "CosyVoice2SpeechLM"  # registered with vLLM by voxbatch.worker.cosyvoice2.vllm_model.register()
STAMP_FILE = "voxbatch_export.json"
FOLDER_NAME = "voxbatch_vllm"  # not "vllm": the official code writes its own export there
SPEECH_TOKEN_SIZE_KEY = "cosyvoice2_speech_token_size"  # config.json key: the eos id the RAS processor reads

# Official llm.pt names -> names in the exported folder (HF Qwen2ForCausalLM layout, so vLLM's own
# Qwen2 loader stacks q/k/v and gate/up). The text embedding and llm_embedding stay out: the backend
# builds prompt embeddings itself on CPU.
_BODY_PREFIX = "llm.model.model."
_RENAMES = {
    "speech_embedding.weight": "model.embed_tokens.weight",
    "llm_decoder.weight": "lm_head.weight",
    "llm_decoder.bias": "lm_head.bias",
}
_SKIPPED = {"llm_embedding.weight", "llm.model.lm_head.weight", _BODY_PREFIX + "embed_tokens.weight"}


def _stamp(model_dir: Path) -> dict[str, object]:
    files = ["llm.pt", "cosyvoice2.yaml", "CosyVoice-BlankEN/config.json"]
    stats = {}
    for name in files:
        st = (model_dir / name).stat()
        stats[name] = [st.st_size, st.st_mtime_ns]
    return {"exporter_version": EXPORTER_VERSION, "files": stats}


def _stamp_key(model_dir: Path, stamp: dict[str, object]) -> str:
    blob = json.dumps({"dir": str(model_dir.resolve()), **stamp}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _is_current(folder: Path, stamp: dict[str, object]) -> bool:
    try:
        return json.loads((folder / STAMP_FILE).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _hf_config(model_dir: Path, dims: LlmDims) -> dict[str, object]:
    """The Qwen2 config (`LlmDims.from_model_dir` checked it against the yaml) over the speech vocabulary."""
    cfg = json.loads((model_dir / QWEN_DIR / "config.json").read_text())
    s = dims.speech_token_size
    cfg.update(
        architectures=[ARCHITECTURE],
        vocab_size=dims.n_speech,
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=s,  # unused (prompts come as embeddings); kept inside the vocabulary
        eos_token_id=s,
        **{SPEECH_TOKEN_SIZE_KEY: s},
    )
    return cfg


def _tensors(model_dir: Path, dims: LlmDims) -> dict[str, torch.Tensor]:
    sd = load_state_dict(model_dir, "llm.pt")
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name in _SKIPPED:
            continue
        if name in _RENAMES:
            out[_RENAMES[name]] = t
        elif name.startswith(_BODY_PREFIX):
            out["model." + name[len(_BODY_PREFIX) :]] = t
        else:
            raise ModelDirError(f"{model_dir / 'llm.pt'}: unexpected key {name!r}")
    for name in ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"):
        if name not in out:
            raise ModelDirError(f"{model_dir / 'llm.pt'}: missing the tensor exported as {name!r}")
    if out["lm_head.weight"].shape != (dims.n_speech, dims.hidden):
        raise ModelDirError(
            f"{model_dir / 'llm.pt'}: llm_decoder.weight is {tuple(out['lm_head.weight'].shape)}, "
            f"expected {(dims.n_speech, dims.hidden)} from speech_token_size {dims.speech_token_size}"
        )
    # safetensors wants contiguous tensors that own their storage (llm.pt shares some).
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def _write(model_dir: Path, folder: Path, stamp: dict[str, object]) -> None:
    dims = LlmDims.from_model_dir(model_dir)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(_hf_config(model_dir, dims), indent=2))
        save_file(_tensors(model_dir, dims), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True))
        if folder.exists():  # stale export: move it aside first, rename cannot replace a non-empty dir
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
            os.rename(folder, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not _is_current(folder, stamp):  # lost a race to another exporter: fine if it is current
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _writable(folder: Path) -> bool:
    """Writable, and meant to be: a folder without write bits stays untouched even for root."""
    try:
        return bool(folder.stat().st_mode & 0o222) and os.access(folder, os.W_OK)
    except OSError:
        return False


def export_for_vllm(model_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Path of an up-to-date vLLM folder for `model_dir`, exporting it first if needed.

    `cache_dir` (a folder to hold exports) overrides the default placement.
    """
    model_dir = Path(model_dir)
    stamp = _stamp(model_dir)
    if cache_dir is not None:
        candidates = [Path(cache_dir) / _stamp_key(model_dir, stamp)]
    else:
        home = Path(os.path.expanduser("~")) / ".cache" / "voxbatch" / "vllm" / _stamp_key(model_dir, stamp)
        candidates = [model_dir / FOLDER_NAME, home] if _writable(model_dir) else [home]
    for folder in candidates:
        if _is_current(folder, stamp):
            return folder
    last_error: OSError | None = None
    for folder in candidates:
        try:
            _write(model_dir, folder, stamp)
            return folder
        except OSError as e:  # read-only model dir (or file system): try the next place
            last_error = e
    raise ModelDirError(f"cannot write a vLLM export for {model_dir} to any of {candidates}: {last_error}")
