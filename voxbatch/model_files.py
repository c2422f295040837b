"""What an official CosyVoice2 model directory holds, and the error for one that does not.

Torch-free on purpose: the producer reads the tokenizer folder to segment text on machines without
torch, and the CLI reports a bad model directory as bad input (a ValueError, one line) on either side.
"""

from __future__ import annotations

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
