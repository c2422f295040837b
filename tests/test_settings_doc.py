"""Every setting is documented once, in voxbatch/settings.py, and docs/settings.md is generated from it.

docs/settings.md must equal what `voxbatch settings` prints now (so a changed comment, default or
bound in settings.py fails here until the table is regenerated); every setting has a comment; and
every `VOXBATCH_*` name the prose docs mention is a real setting (a renamed one would leave them
pointing at nothing).
"""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from voxbatch.cli import app
from voxbatch.settings import Settings
from voxbatch.settings_doc import describe, markdown

REPO = Path(__file__).resolve().parents[1]
PROSE = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_SETTINGS = {"VOXBATCH_FIXTURES"}  # the tests' fixture folder (tests/fixture_facts.py), not a Settings field


def test_docs_settings_table_is_generated_from_settings_py():
    out = CliRunner().invoke(app, ["settings"])
    assert out.exit_code == 0, out.output
    assert out.output == markdown()
    committed = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert committed == markdown(), "docs/settings.md is stale: run `voxbatch settings > docs/settings.md`"


def test_every_setting_has_its_comment_and_variable():
    docs = describe()
    assert [d.field for d in docs] == list(Settings.model_fields)
    assert [d.field for d in docs if not d.doc] == []
    for d in docs:
        assert f"`{d.variables[0]}`" in markdown()


def test_the_docs_name_only_real_settings():
    fields = {v for d in describe() for v in d.variables}
    for path in PROSE:
        unknown = set(re.findall(r"VOXBATCH_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8"))) - fields - NOT_SETTINGS
        assert not unknown, f"{path.relative_to(REPO)} names {sorted(unknown)}, which voxbatch/settings.py does not have"
