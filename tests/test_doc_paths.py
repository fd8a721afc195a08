"""Every file path the docs name exists: a move that leaves a page pointing nowhere fails.

The README, BENCHMARKS.md and every page under ``docs/`` (the guide, the architecture,
the ADRs) name files as ``recovery/generation/protocol.py``, folders as
``launcher/chaos/``, and functions as ``launcher/job_outcome.exit_status`` (a module's
path, then the name). Each must resolve in this checkout. An ADR may name a file it
records as removed; those are listed in :data:`HISTORICAL`, each with its page.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("recovery", "replication", "launcher", "dataloader_cache", "benchmarks", "examples",
       "tests", "docs", ".ci")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(t) for t in TOP)
                  + r")/[\w/.*-]*[\w*/])")

#: page -> the paths it names as history: files an ADR records as removed or replaced.
HISTORICAL = {
    "docs/adr/0018-replay-check-and-failure-count.md": {"recovery/transfer.reseed_replicas"},
    "docs/adr/0019-one-step-of-consolidation.md": {
        "recovery/settings.py", "recovery/transfer.py", "launcher/rendezvous.py",
        "launcher/config/", "benchmarks/chaos/", "benchmarks/goodput_worker.py",
    },
}


def _pages() -> list[Path]:
    return sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md")])


def _resolves(path: str) -> bool:
    """A file or folder, a glob that matches something, or ``module.name``."""
    if "*" in path:
        return any(ROOT.glob(path))
    if (ROOT / path).exists():
        return True
    module, _, name = path.rpartition(".")
    return bool(module) and name.isidentifier() and (ROOT / f"{module}.py").is_file()


def _missing(page: Path) -> list[str]:
    rel = str(page.relative_to(ROOT))
    allowed = HISTORICAL.get(rel, set())
    return [f"{rel}: {p}" for p in PATH.findall(page.read_text())
            if p not in allowed and not _resolves(p.rstrip("."))]


def test_every_path_the_docs_name_exists() -> None:
    assert [m for page in _pages() for m in _missing(page)] == []


def test_the_check_reports_a_path_that_does_not_exist() -> None:
    """The check is live: a page naming a moved file is reported, with the page."""
    page = ROOT / "docs" / "_doc_paths_probe_tmp.md"
    page.write_text("See `recovery/elastic_group.py` and `recovery/runtime/checkpointless.py`.\n")
    try:
        assert _missing(page) == ["docs/_doc_paths_probe_tmp.md: recovery/elastic_group.py"]
    finally:
        page.unlink()


def test_every_historical_entry_is_still_named_and_still_gone() -> None:
    """The allowance shrinks with the docs: an entry no page names, or a path that exists
    again, is stale."""
    for rel, paths in HISTORICAL.items():
        text = (ROOT / rel).read_text()
        for p in paths:
            assert p in text and not _resolves(p), (rel, p)
