"""The CosyVoice2 text tokenizer: Qwen2 byte-level BPE plus the CosyVoice2 special tokens.

The `CosyVoice-BlankEN/` folder only holds Qwen2's own specials (`<|endoftext|>`, `<|im_start|>`,
`<|im_end|>`). The official frontend adds the CosyVoice2 markers (`<|endofprompt|>`, `[breath]`, ...)
at load time, so their ids depend on the order they are added in; `SPECIAL_TOKENS` keeps that order.
We load `tokenizer.json` when present, else rebuild the same pipeline from `vocab.json` + `merges.txt`
(NFC, Qwen2's split regex, ByteLevel, no BOS), so both layouts of the folder give the same ids.

Part of the shared contract (not of the worker): the producer counts tokens with this class to
segment text (`producer/submit.py`) on machines without torch, the engine encodes with it; no torch
here, and a bad folder raises the torch-free `ModelDirError`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from voxbatch.model_files import MODEL_FILES, QWEN_DIR, ModelDirError

WHAT = MODEL_FILES[QWEN_DIR]

# Added after the base vocabulary in exactly this order (the official `get_qwen_tokenizer` list).
# Tokens already in the vocabulary (`<|im_start|>`, `<|im_end|>`) keep their ids.
SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip

# Qwen2's pre-tokenization regex (contractions, letters, single digits, punctuation, newlines, spaces).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _from_vocab_merges(folder: Path) -> Tokenizer:
    """The Qwen2 fast-tokenizer pipeline rebuilt from the slow-tokenizer files."""
    tok = Tokenizer(models.BPE.from_file(str(folder / "vocab.json"), str(folder / "merges.txt")))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    config = folder / "tokenizer_config.json"
    if config.is_file():  # the base specials (<|endoftext|> ...) with their fixed ids
        added = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
        for _, entry in sorted(added.items(), key=lambda kv: int(kv[0])):
            tok.add_special_tokens([AddedToken(entry["content"], normalized=False, special=True)])
    return tok


class CosyVoice2Tokenizer:
    """Text -> Qwen token ids, with the CosyVoice2 specials recognised anywhere in the text."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelDirError(f"{folder}: missing ({WHAT})")
        single = folder / "tokenizer.json"
        if single.is_file():
            files, load = str(single), lambda: Tokenizer.from_file(str(single))
        elif (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
            files, load = f"{folder}/{{vocab.json,merges.txt}}", lambda: _from_vocab_merges(folder)
        else:
            raise ModelDirError(f"{folder}: no tokenizer.json and no vocab.json + merges.txt ({WHAT})")
        try:
            self._tok: Tokenizer = load()
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises a plain Exception for a malformed file
            raise ModelDirError(f"{files}: not a readable tokenizer ({type(e).__name__}: {e})") from e
        self._tok.add_special_tokens(
            [AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True) for t in SPECIAL_TOKENS]
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> CosyVoice2Tokenizer:
        return cls(Path(model_dir) / QWEN_DIR)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in one call that lets go of the GIL: `tokenizers` encodes a batch in
        its own threads, where a single `encode` holds the GIL throughout (~120 us for a 300-character
        segment), time a worker's LLM thread waits for at a job's start (Engine.prepare_many)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_length(self, text: str) -> int:
        """Length in tokens: the pluggable length function for the producer's segmentation."""
        return len(self.encode(text))

    def token_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(token)
        return tid

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)
