"""What an official CosyVoice2 model directory holds, and the error for one that does not.

Torch-free on purpose: the producer reads the tokenizer folder to segment text on machines without
torch, and the CLI reports a bad model directory as bad input (a ValueError, one line) on either side.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

QWEN_DIR = "CosyVoice-BlankEN"  # the Qwen2 folder: config.json and the text tokenizer

# Files an official CosyVoice2-0.5B directory holds, and what each is.
MODEL_FILES = {
    "cosyvoice2.yaml": "the HyperPyYAML model config",
    "llm.pt": "the Qwen2LM state dict (torch.save)",
    "flow.pt": "the CausalMaskedDiffWithXvec state dict (torch.save)",
    "hift.pt": "the HiFTGenerator state dict (torch.save)",
    "campplus.onnx": "the CAM++ speaker-embedding ONNX model",
    "speech_tokenizer_v2.onnx": "the S3 speech tokenizer ONNX model",
    QWEN_DIR: "the Qwen2 config and tokenizer folder (tokenizer.json or vocab.json + merges.txt)",
}


class ModelDirError(ValueError):
    """A model directory is missing a file or holds one that is not what we expect."""


# Files whose bytes determine the audio of a segment once the voice profile is made (the ONNX
# frontend models only make voice profiles, whose content is hashed on its own).
SYNTHESIS_FILES = ("cosyvoice2.yaml", "llm.pt", "flow.pt", "hift.pt")
TOKENIZER_SUFFIXES = (".json", ".txt", ".model")


def model_digest(model_dir: str | Path) -> str:
    """sha256 over the synthesis files and the tokenizer's vocabulary files, names included (about
    2.5 GB for CosyVoice2-0.5B: a few seconds, once per worker, when the pipeline starts)."""
    root = Path(model_dir)
    files = [root / name for name in SYNTHESIS_FILES]
    tokenizer = root / "CosyVoice-BlankEN"
    if tokenizer.is_dir():
        files += sorted(p for p in tokenizer.rglob("*") if p.is_file() and p.suffix in TOKENIZER_SUFFIXES)
    h = hashlib.sha256()
    for path in files:
        if not path.is_file():
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\x1f")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()
