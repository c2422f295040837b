"""The table of every setting (docs/settings.md, `voxbatch settings`), built from voxbatch/settings.py.

settings.py is the one place a setting is explained: the comment above each field. This module reads
those comments from the source (with the field's variable name, default and type from the pydantic
model), so the docs table is generated, never written by hand. A field without a comment of its own
shares the comment of the field on the line just above it (`llm_device`, `flow_device`,
`hift_device` under one comment); a blank line ends such a group.
"""

from __future__ import annotations

import ast
import inspect
import typing
from dataclasses import dataclass

from pydantic import AliasChoices

from voxbatch import settings as settings_module
from voxbatch.settings import Settings

HEADER = """# Settings

Every setting is an environment variable (`VOXBATCH_<FIELD>`, plus the usual `AWS_*` for S3); CLI
flags override them. This table is generated from the comments in `voxbatch/settings.py` by
`voxbatch settings` (`tests/test_settings_doc.py` fails when it is out of date): edit the comment
there, then run `voxbatch settings > docs/settings.md`.
"""


@dataclass(frozen=True)
class SettingDoc:
    field: str
    variables: tuple[str, ...]  # environment variables that set it, the preferred one first
    kind: str  # type and bounds, e.g. "int >= 1", "tone | cosyvoice2"
    default: str
    doc: str  # the comment in settings.py, one line


def _comments(source: str) -> dict[str, str]:
    """{field: its comment} for the fields of `class Settings` in settings.py's source."""
    lines = source.splitlines()
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    docs: dict[str, str] = {}
    previous: ast.AnnAssign | None = None
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous = None
            continue
        i, above = node.lineno - 2, []  # 0-based index of the line above the field
        while i >= 0 and lines[i].strip().startswith("#"):
            above.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if above:
            docs[node.target.id] = " ".join(above)
        elif previous is not None and previous.end_lineno == node.lineno - 1:
            docs[node.target.id] = docs.get(previous.target.id, "")
        else:
            docs[node.target.id] = ""
        previous = node
    return docs


def _kind(field) -> str:
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(str(a) for a in typing.get_args(annotation))
    if args and len(args) == 1:  # X | None
        annotation = args[0]
        if typing.get_origin(annotation) is typing.Literal:
            return " \\| ".join(str(a) for a in typing.get_args(annotation))
    name = getattr(annotation, "__name__", str(annotation))
    bounds = []
    for m in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if (bound := getattr(m, attr, None)) is not None:
                bounds.append(f"{sign} {bound:g}" if isinstance(bound, float) else f"{sign} {bound}")
    return " ".join([name, ", ".join(bounds)]).strip()


def _default(field) -> str:
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def describe() -> list[SettingDoc]:
    """Every field of Settings, in the order settings.py declares them."""
    comments = _comments(inspect.getsource(settings_module))
    prefix = Settings.model_config.get("env_prefix", "")
    out = []
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        variables = tuple(alias.choices) if isinstance(alias, AliasChoices) else (f"{prefix}{name}".upper(),)
        out.append(SettingDoc(name, tuple(str(v) for v in variables), _kind(field), _default(field), comments.get(name, "")))
    return out


def _cell(text: str) -> str:
    """A comment as one table cell: pipes escaped, and <...> outside `code` shown, not taken for HTML."""
    parts = text.replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def markdown() -> str:
    """docs/settings.md: the header and one table row per setting."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for s in describe():
        names = "<br>".join(f"`{v}`" for v in s.variables)
        rows.append(f"| {names} | {s.kind} | `{s.default}` | {_cell(s.doc)} |")
    return HEADER + "\n" + "\n".join(rows) + "\n"
