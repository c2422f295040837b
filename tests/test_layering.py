"""Which code may import which, and what the wheel installs.

Imports go one way: `voxbatch.producer` (CPU: corpora, submit, voices, assembly) and `voxbatch.worker`
(GPU: tasks, pipeline, engines) each build on the shared contract (`voxbatch/*.py`: settings, models,
keys, storage, job state, tokenizer...) and never import each other; the contract imports neither,
except the two modules that compose them (the CLI, and the embedded `voxbatch render`). bench/ and
tests/ share code only through the package (`voxbatch.testing_services`), never each other. Every
import counts, also one inside a function.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPOSERS = {"voxbatch/cli.py", "voxbatch/embedded.py"}  # may import both sides


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module an `import` / `from ... import` in the file names (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def offenders(folder: str, forbidden: tuple[str, ...], skip: set[str] = frozenset(), root: Path = REPO) -> dict[str, list[str]]:
    """{file: [forbidden modules it imports]} for the .py files under root/folder."""
    bad = {}
    for path in sorted((root / folder).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in skip:
            continue
        hits = sorted(m for m in imported_modules(path, root) if any(m == f or m.startswith(f + ".") for f in forbidden))
        if hits:
            bad[rel] = hits
    return bad


def test_producer_never_imports_the_worker():
    assert offenders("voxbatch/producer", ("voxbatch.worker",)) == {}


def test_worker_never_imports_the_producer():
    assert offenders("voxbatch/worker", ("voxbatch.producer",)) == {}


def test_the_contract_imports_neither_side_except_the_composers():
    contract = {p.relative_to(REPO).as_posix() for p in (REPO / "voxbatch").glob("*/**/*.py")}
    assert offenders("voxbatch", ("voxbatch.producer", "voxbatch.worker"), skip=COMPOSERS | contract) == {}


def test_bench_and_tests_do_not_import_each_other():
    assert offenders("bench", ("tests",)) == {}
    assert offenders("tests", ("bench",)) == {}


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    (tmp_path / "voxbatch" / "producer").mkdir(parents=True)
    probe = tmp_path / "voxbatch" / "producer" / "probe.py"
    probe.write_text("import json\n\ndef f():\n    from ..worker import engine\n    import voxbatch.worker.tone\n", encoding="utf-8")
    assert offenders("voxbatch/producer", ("voxbatch.worker",), root=tmp_path) == {
        "voxbatch/producer/probe.py": ["voxbatch.worker", "voxbatch.worker.engine", "voxbatch.worker.tone"]}


def test_wheel_installs_only_the_voxbatch_package(tmp_path):
    """`pip wheel . --no-deps`: every file of the wheel is under voxbatch/ (or its .dist-info). Built
    from a copy of what the build reads, so the checkout gets no build/ or egg-info."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "voxbatch", src / "voxbatch", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path), "-q"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}")
    (wheel,) = tmp_path.glob("voxbatch-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"voxbatch"}, sorted(top)
    for module in ("voxbatch/__init__.py", "voxbatch/producer/voice.py", "voxbatch/worker/cosyvoice2/llm.py", "voxbatch/tokenizer.py"):
        assert module in names, module
