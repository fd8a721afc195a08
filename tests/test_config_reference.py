"""The configuration reference page is generated from the schema, and kept current.

``docs/reference/configuration.md`` is what ``checkpointless config reference`` prints:
every key, its type, default, allowed values, environment variable and meaning. These
tests fail when a key has no description, and when the page in the tree is not the
one the schema generates today (regenerate it with the command above).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from recovery.recipe import all_fields
from recovery.recipe.reference import reference_markdown, undescribed

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "configuration.md"


def test_every_key_says_what_it_does():
    assert undescribed() == [], "keys without a description (metadata['help'])"


def test_the_page_in_the_tree_is_the_one_the_schema_generates():
    assert PAGE.read_text() == reference_markdown(), (
        "docs/reference/configuration.md is stale: regenerate it with "
        "`checkpointless config reference > docs/reference/configuration.md`")


def test_the_page_lists_every_key_with_its_environment_variable():
    page = PAGE.read_text()
    for spec in all_fields():
        assert f"| `{'.'.join(spec.path)}` |" in page and f"`{spec.env_var}`" in page


def test_the_command_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "config", "reference"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == PAGE.read_text()
