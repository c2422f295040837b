"""Every command the docs quote still parses, so README.md, BENCHMARKS.md and docs/ cannot rot.

Commands are taken from shell code blocks (``` bash, sh or bare; each non-comment line, `\\`
continuations joined) and from inline code spans, wherever they start with `voxbatch` or
`python -m` (after env assignments and `.venv/bin/`); `&&`, `|` and `;` separate commands. A
command tied to a past commit (the same line names `commit <hash>`) is history, not an instruction,
and is skipped.

- `voxbatch ...` is parsed by the CLI itself with `--help` appended (click's parser under typer):
  unknown commands or options fail; the eager `--help` then stops it before anything runs.
- `python -m <module> ...` runs the module in a subprocess whose `ArgumentParser.parse_args`
  exits right after parsing: unknown options and bad values fail; nothing is benchmarked.
  (`python -m pytest` is pytest itself and is not checked.)
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from voxbatch.cli import app

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_CHECKED = {"pytest"}  # `python -m` modules that are not ours
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
SHELL = {"", "bash", "sh", "shell", "console"}  # fences that hold commands (``` text: diagrams, layouts)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
HISTORY = re.compile(r"\bcommit [0-9a-f]{7,}")

# Runs each `python -m` command in one interpreter (imports shared), the module executed as
# `python -m` would, but stopped once argparse has parsed its arguments; prints one exit code each.
_PARSE_ONLY = """
import argparse, contextlib, io, json, runpy, sys
_parse = argparse.ArgumentParser.parse_args
def parse_args(self, args=None, namespace=None):
    _parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_args
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = list(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = "the module never parsed its arguments"
    except SystemExit as e:
        code = e.code or 0
    results.append([code, err.getvalue()[-2000:]])
print(json.dumps(results))
"""


def _lines(text: str) -> list[str]:
    """Candidate command lines: code-block lines (continuations joined) and inline code spans."""
    out = []
    for lang, block in FENCE.findall(text):
        if lang.strip() not in SHELL:
            continue
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    prose = FENCE.sub("", text)
    for line in prose.splitlines():
        if not HISTORY.search(line):
            out += SPAN.findall(line)
    return out


def _commands(line: str) -> list[list[str]]:
    """The voxbatch / python -m commands of one shell line, as argument lists."""
    line = re.sub(r"\s#\s.*$", "", line)  # trailing comment
    line = re.sub(r"<[^<>]*>", "PLACEHOLDER", line)  # <copy of ...>
    try:
        words = shlex.split(line, posix=True)
    except ValueError:
        return []
    commands, current = [], []
    for w in [*words, "&&"]:
        if w in ("&&", "|", ";", "||"):
            while current and ENV.match(current[0]):
                current.pop(0)
            if current and current[0].split("/")[-1] == "voxbatch":
                commands.append(["voxbatch", *current[1:]])
            elif len(current) >= 3 and current[0].split("/")[-1].startswith("python") and current[1] == "-m":
                commands.append(current)
            current = []
        else:
            current.append(w)
    return commands


def quoted_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for line in _lines(doc.read_text(encoding="utf-8")):
            if HISTORY.search(line):
                continue
            for cmd in _commands(line):
                found.append((doc.relative_to(REPO).as_posix(), cmd))
    return found


def parse_voxbatch(args: list[str]) -> tuple[int, str]:
    """(exit code, output) of `voxbatch ARGS --help`: click parses every argument (unknown commands
    and options fail with exit code 2), then the eager --help stops before anything runs."""
    result = CliRunner().invoke(app, [*args, "--help"])
    return result.exit_code, result.output


def parse_python_modules(argvs: list[list[str]]) -> list[tuple[object, str]]:
    """(exit code, stderr) of each `python -m MODULE ARGS` (argv as quoted), parsed only."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _PARSE_ONLY, json.dumps([a[2:] for a in argvs])], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.strip().splitlines()[-1])]


COMMANDS = quoted_commands()


def test_the_docs_quote_commands():
    """The extraction finds the README's commands (an empty list would make the checks vacuous)."""
    readme = [cmd for doc, cmd in COMMANDS if doc == "README.md"]
    assert any(cmd[:2] == ["voxbatch", "render"] for cmd in readme)
    assert any(cmd[:2] == ["voxbatch", "submit"] for cmd in readme)
    assert any(cmd[:2] == ["python", "-m"] for _, cmd in COMMANDS)


@pytest.mark.parametrize(("doc", "argv"), [c for c in COMMANDS if c[1][0] == "voxbatch"],
                         ids=[f"{d}:{' '.join(a)[:60]}" for d, a in COMMANDS if a[0] == "voxbatch"])
def test_voxbatch_command_parses(doc, argv):
    code, output = parse_voxbatch(argv[1:])
    assert code == 0, f"{doc}: `{shlex.join(argv)}` does not parse:\n{output}"


FILE_SPAN = re.compile(r"^[A-Za-z.][\w.\-/]*$")
TOP_DIRS = {p.name for p in REPO.iterdir() if p.is_dir() and p.name not in (".git", ".venv", ".cache", "out")}


def named_repo_paths(text: str) -> set[str]:
    """Code spans that name a path in this repository: under one of its top-level folders, or a
    top-level file (`BENCHMARKS.md`, `.env.example`); model-dir names such as `cosyvoice2.yaml` are not."""
    spans = {s for s in SPAN.findall(FENCE.sub("", text)) if FILE_SPAN.match(s)}
    top_files = {s for s in spans if "/" not in s and s.endswith((".md", ".example", ".toml")) and s.rsplit(".", 1)[0]}
    return {s for s in spans if "/" in s and s.split("/")[0] in TOP_DIRS} | top_files


@pytest.mark.parametrize("doc", [REPO / "README.md", REPO / "docs" / "design.md"], ids=lambda p: p.name)
def test_every_file_the_page_names_is_in_the_repository(doc):
    """Paths in code spans (`voxbatch/settings.py`, `infra/k8s/`) exist in this checkout."""
    named = named_repo_paths(doc.read_text(encoding="utf-8"))
    assert any("/" in n for n in named), "the check found no paths"
    missing = sorted(n for n in named if not (REPO / n).exists())
    assert missing == [], f"{doc.name} names files that are not in the repository: {missing}"
    assert named_repo_paths("see `../shared/DESIGN.md`, `voxbatch/nope.py` and `cosyvoice2.yaml`") == {"voxbatch/nope.py"}


def test_parser_rejects_what_it_should():
    assert parse_voxbatch(["render", "book.md", "--no-such-flag"])[0] == 2
    code, output = parse_voxbatch(["voice", "nonsense"])
    assert code == 2 and "No such command" in output
    assert parse_voxbatch(["voice", "add", "v", "--wav", "a.wav", "--text", "t"]) == (0, parse_voxbatch(["voice", "add"])[1])


_MODULES = sorted({(doc, tuple(cmd)) for doc, cmd in COMMANDS if cmd[0] != "voxbatch" and cmd[2] not in NOT_CHECKED})
_UNKNOWN_FLAG = ("python", "-m", "bench.orchestration", "--no-such-flag")  # must fail: the check is not vacuous


@pytest.fixture(scope="module")
def module_results() -> dict[tuple[str, ...], tuple[object, str]]:
    argvs = [list(a) for _, a in _MODULES] + [list(_UNKNOWN_FLAG)]
    return dict(zip(map(tuple, argvs), parse_python_modules(argvs)))


@pytest.mark.parametrize(("doc", "argv"), _MODULES, ids=[f"{d}:{' '.join(a[2:])[:70]}" for d, a in _MODULES])
def test_python_module_command_parses(doc, argv, module_results):
    code, stderr = module_results[argv]
    assert code == 0, f"{doc}: `{shlex.join(argv)}` does not parse ({code}):\n{stderr}"


def test_module_parse_check_rejects_unknown_options(module_results):
    code, stderr = module_results[_UNKNOWN_FLAG]
    assert code == 2 and "unrecognized arguments: --no-such-flag" in stderr
