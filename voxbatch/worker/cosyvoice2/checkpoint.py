"""Reading an official CosyVoice2 model directory as data.

`cosyvoice2.yaml` is HyperPyYAML: its `!new:`/`!name:`/`!ref`/`!apply:` tags construct official
classes. We never construct them; we read the tagged nodes as plain mappings (the tag itself is kept
under the key `__tag__`) and resolve `!ref <name>` and simple arithmetic like `<a> * <b>` against the
top-level values. Each model file then reads its own dimensions out of this dict.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.overrides import TorchFunctionMode

from voxbatch.model_files import MODEL_FILES, ModelDirError

__all__ = ["MODEL_FILES", "ModelDirError", "check_keys", "empty_init", "load_state_dict", "read_config", "section"]


class _Tagged(dict):
    pass


class _Ref(str):
    pass


def _construct_tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if suffix == "ref" or suffix == "":
        return _Ref(loader.construct_scalar(node))  # type: ignore[arg-type]
    if isinstance(node, yaml.MappingNode):
        out = _Tagged(loader.construct_mapping(node, deep=True))
    elif isinstance(node, yaml.SequenceNode):
        out = _Tagged(__args__=loader.construct_sequence(node, deep=True))
    else:
        out = _Tagged(__value__=loader.construct_scalar(node))  # type: ignore[arg-type]
    out["__tag__"] = suffix
    return out


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_multi_constructor("!", _construct_tagged)

_REF = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>")


def _resolve(value: Any, top: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        names = _REF.findall(value)
        if not names:
            return str(value)
        resolved = [_resolve(top[n], top) for n in names]
        if value.strip() == f"<{names[0]}>":
            return resolved[0]
        expr = _REF.sub(lambda m: repr(_resolve(top[m.group(1)], top)), value)
        if not re.fullmatch(r"[\d\s.+\-*/()]+", expr):
            raise ModelDirError(f"cosyvoice2.yaml: cannot evaluate {value!r}")
        return eval(expr, {"__builtins__": {}})  # noqa: S307 - digits and operators only, checked above
    if isinstance(value, dict):
        out = type(value)({k: _resolve(v, top) for k, v in value.items()})
        return out
    if isinstance(value, list):
        return [_resolve(v, top) for v in value]
    return value


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """The yaml as nested dicts, references resolved; tagged nodes carry their tag in `__tag__`."""
    path = Path(model_dir) / "cosyvoice2.yaml"
    if not path.is_file():
        raise ModelDirError(f"{path}: missing ({MODEL_FILES['cosyvoice2.yaml']})")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # noqa: S506 - our SafeLoader subclass
    except yaml.YAMLError as e:
        raise ModelDirError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path}: expected a mapping at the top level")
    return {k: _resolve(v, raw) for k, v in raw.items() if not k.startswith("__")}


def section(config: dict[str, Any], *path: str) -> dict[str, Any]:
    """config[path[0]][path[1]]..., with an error naming the yaml path when it is absent."""
    node: Any = config
    for i, key in enumerate(path):
        if not isinstance(node, dict) or key not in node:
            raise ModelDirError(f"cosyvoice2.yaml: missing '{'.'.join(path[: i + 1])}'")
        node = node[key]
    return node


class _SkipRandomInit(TorchFunctionMode):
    """`torch.nn.init` and the random fills do nothing to meta tensors (they hold no values anyway)."""

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in self.FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Build modules on the meta device without running their random init: every weight then comes
    from the checkpoint (`load_state_dict(..., assign=True)`). Init on meta is not free: nn.Embedding's
    `normal_` runs through torch's Python reference ops, whose first call imports torch._dynamo
    (3-7 s of start-up, measured on CPU) for values that are thrown away."""
    with torch.device("meta"), _SkipRandomInit():
        yield


def load_state_dict(model_dir: str | Path, name: str, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load `llm.pt` / `flow.pt` / `hift.pt` memory-mapped, each tensor read once straight onto
    `device` (a GPU: cast there afterwards, not on the host), with an error naming the file."""
    path = Path(model_dir) / name
    if not path.is_file():
        raise ModelDirError(f"{path}: missing ({MODEL_FILES.get(name, 'a checkpoint')})")
    try:
        sd = torch.load(path, map_location=device, mmap=True, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is not a state dict
        raise ModelDirError(f"{path}: not a loadable torch state dict ({type(e).__name__}: {e})") from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ModelDirError(f"{path}: expected a dict of tensors ({MODEL_FILES.get(name, 'a state dict')})")
    return sd


def check_keys(name: str, got: set[str], expected: set[str]) -> None:
    """Strict key matching, with an error that names the file and the first differences."""
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise ModelDirError(
            f"{name}: state dict does not match the model "
            f"(missing {len(missing)}: {missing[:5]}; unexpected {len(unexpected)}: {unexpected[:5]})"
        )
