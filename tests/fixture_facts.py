"""Where the official-format CosyVoice2 fixture is, and what it says about itself.

Parity tests read every expected dimension, vocabulary size, seed and length from here, never from a
literal, so any official-format fixture (other sizes, vocabularies, seeds, prompt lengths) is verified
by the same tests. The facts come from the fixture's own files, read independently of the code under
test: `cosyvoice2.yaml` (HyperPyYAML, tags ignored), `CosyVoice-BlankEN/config.json`,
`reference_meta.json` and `reference.md` (which states the seeds of the seeded reference calls).

`VOXBATCH_FIXTURES` may name the fixture folder itself or a folder holding it (`cosyvoice2-tiny/`, or
the one sub-folder that has a `reference.npz`); by default `../shared/fixtures`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_NAME = "cosyvoice2-tiny"
REFERENCE = "reference.npz"


class FixtureNotFound(LookupError):
    """No fixture, or no single one, where VOXBATCH_FIXTURES points."""


def fixture_path() -> Path:
    """The fixture folder (holding `reference.npz`), or FixtureNotFound saying where it looked."""
    root = Path(os.environ.get("VOXBATCH_FIXTURES", REPO.parent / "shared" / "fixtures"))
    if (root / REFERENCE).is_file():
        return root
    if (root / DEFAULT_NAME / REFERENCE).is_file():
        return root / DEFAULT_NAME
    found = sorted(p.parent for p in root.glob(f"*/{REFERENCE}")) if root.is_dir() else []
    if len(found) == 1:
        return found[0]
    if found:
        raise FixtureNotFound(f"{root} holds several fixtures ({', '.join(p.name for p in found)}): set VOXBATCH_FIXTURES to one")
    raise FixtureNotFound(f"no {REFERENCE} in {root} or a folder under it (set VOXBATCH_FIXTURES to the fixture folder)")


class _TagBlindLoader(yaml.SafeLoader):
    """HyperPyYAML read as plain data: `!new:`/`!name:` nodes become their mapping, `!ref <x>` its text."""


def _untagged(loader: yaml.SafeLoader, _suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


_TagBlindLoader.add_multi_constructor("!", _untagged)


@dataclass(frozen=True)
class FixtureFacts:
    path: Path
    meta: dict[str, Any]  # reference_meta.json
    config: dict[str, Any]  # cosyvoice2.yaml, tags ignored
    qwen: dict[str, Any]  # CosyVoice-BlankEN/config.json
    reference_md: str

    @classmethod
    def read(cls, path: Path) -> FixtureFacts:
        return cls(
            path=path,
            meta=json.loads((path / "reference_meta.json").read_text(encoding="utf-8")),
            config=yaml.load((path / "cosyvoice2.yaml").read_text(encoding="utf-8"), Loader=_TagBlindLoader),  # noqa: S506
            qwen=json.loads((path / "CosyVoice-BlankEN" / "config.json").read_text(encoding="utf-8")),
            reference_md=(path / "reference.md").read_text(encoding="utf-8"),
        )

    def value(self, *keys: str) -> Any:
        """config[keys...], following a `!ref <name>` to the top-level value it names."""
        node: Any = self.config
        for key in keys:
            node = node[key]
        ref = re.fullmatch(r"\s*<(\w+)>\s*", node) if isinstance(node, str) else None
        return self.config[ref.group(1)] if ref else node

    # -- the language model -----------------------------------------------------------------------
    @property
    def speech_token_size(self) -> int:
        """Speech tokens 0 .. S-1; S, S+1, S+2 are eos and the other stop ids."""
        return int(self.value("llm", "speech_token_size"))

    @property
    def eos_id(self) -> int:
        return int(self.meta["llm"]["eos_id"])

    @property
    def stop_ids(self) -> list[int]:
        return [int(t) for t in self.meta["llm"]["stop_ids"]]

    @property
    def llm_vocab(self) -> int:
        """Rows of the speech embedding and the decoder head: tokens plus the three stop ids."""
        return self.speech_token_size + 3

    @property
    def ras(self) -> dict[str, float]:
        return {k: self.value("llm", "sampling", k) for k in ("top_p", "top_k", "win_size", "tau_r")}

    # -- audio ------------------------------------------------------------------------------------
    @property
    def sample_rate(self) -> int:
        return int(self.config["sample_rate"])

    @property
    def n_mels(self) -> int:
        return int(self.value("flow", "output_size"))

    @property
    def spk_embed_dim(self) -> int:
        return int(self.config["spk_embed_dim"])

    @property
    def token_mel_ratio(self) -> int:
        return int(self.config["token_mel_ratio"])

    @property
    def samples_per_frame(self) -> int:
        """HiFT samples per mel frame: the upsampling rates times the iSTFT hop."""
        return math.prod(self.value("hift", "upsample_rates")) * int(self.value("hift", "istft_params", "hop_len"))

    @property
    def samples_per_token(self) -> int:
        return self.token_mel_ratio * self.samples_per_frame

    @property
    def nb_harmonics(self) -> int:
        return int(self.value("hift", "nb_harmonics"))

    # -- the reference calls ----------------------------------------------------------------------
    @property
    def prompt_text(self) -> str:
        return self.meta["e2e"]["prompt_text"]

    def seed_before(self, array: str) -> int:
        """The `torch.manual_seed(n)` that reference.md says preceded the call making `array`."""
        row = re.search(rf"^\|\s*`{re.escape(array)}`\s*\|.*$", self.reference_md, re.MULTILINE)
        seed = re.search(r"manual_seed\((\d+)\)", row.group(0)) if row else None
        if seed is None:
            raise AssertionError(f"{self.path / 'reference.md'}: no manual_seed stated for {array}")
        return int(seed.group(1))


@functools.cache
def facts() -> FixtureFacts:
    return FixtureFacts.read(fixture_path())
