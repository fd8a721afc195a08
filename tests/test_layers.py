"""The layer rule of ``docs/architecture.md``, checked by parsing every import.

    launcher/          may import everything below
    recovery/          may import replication/ and dataloader_cache/, never launcher/
      recovery/recipe/ (the configuration layer) imports only configuration sections
    replication/       imports neither recovery/ nor launcher/ (nor dataloader_cache/)
    dataloader_cache/  imports neither recovery/ nor launcher/; from replication/ only
                       the stdlib-only process contract (replication/contract.py)

Inside ``recovery/`` and ``replication/`` the same rule holds between *rooms* (their
subpackages, and the shared top-level modules): :data:`ROOMS` says which room may import
which, and is shown in ``docs/architecture.md``. A room absent from the table, an import
the table does not allow, or a circle in the table fails.

Imports inside functions count too: a lazy import is still a dependency. The test
fails the day someone adds a forbidden one, naming the file, line and module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("launcher", "recovery", "replication", "dataloader_cache")
MAX_MODULE_LINES = 600

#: package -> the top-level packages of this project it must never import.
FORBIDDEN = {
    "recovery": {"launcher", "benchmarks"},
    "replication": {"recovery", "launcher", "dataloader_cache", "benchmarks"},
    "dataloader_cache": {"recovery", "launcher", "replication", "benchmarks"},
    "launcher": {"benchmarks"},
}
#: Modules of a forbidden package that a lower layer may import all the same.
ALLOWED = {"dataloader_cache": {"replication.contract", "replication.errors"}, "replication": set(),
           "recovery": set(), "launcher": set()}
#: recovery/recipe/ is below the rest of recovery/: of this project it imports only these.
#: (``recovery.faults.spec`` is the grammar of the ``recovery.fault`` setting, stdlib-only.)
RECIPE_MAY_IMPORT = ("recovery.recipe", "recovery.common.config", "recovery.faults.spec",
                     "replication.config", "replication.contract", "replication.errors",
                     "dataloader_cache.config")


#: room -> the other rooms of its package it may import. A room is a subpackage
#: (``recovery.generation``) or a shared top-level module (``replication.errors``); the
#: package's own ``__init__`` is the room named like the package. Bottom first.
ROOMS: dict[str, set[str]] = {
    "recovery.job_store": set(),
    "recovery.common": {"recovery.job_store"},
    "recovery.generation": {"recovery.common", "recovery.job_store"},
    "recovery.faults": {"recovery.common", "recovery.job_store", "recovery.generation"},
    "recovery.recipe": {"recovery.common", "recovery.faults"},  # see RECIPE_MAY_IMPORT
    "recovery.schedules": {"recovery.common"},
    "recovery.loader": {"recovery.common"},
    "recovery.engines": {"recovery.common"},
    "recovery.process_group": {"recovery.common", "recovery.job_store", "recovery.generation",
                               "recovery.recipe"},
    "recovery.resize": {"recovery.common", "recovery.job_store", "recovery.generation",
                        "recovery.recipe", "recovery.process_group", "recovery.loader"},
    "recovery.durable": {"recovery.common", "recovery.job_store", "recovery.generation",
                         "recovery.recipe", "recovery.schedules"},
    "recovery.runtime": {"recovery.common", "recovery.job_store", "recovery.generation",
                         "recovery.faults", "recovery.recipe", "recovery.schedules",
                         "recovery.loader", "recovery.process_group", "recovery.resize",
                         "recovery.durable", "recovery.engines"},
    "recovery.integrations": {"recovery.common", "recovery.job_store", "recovery.generation",
                              "recovery.faults", "recovery.recipe", "recovery.schedules",
                              "recovery.loader", "recovery.process_group", "recovery.resize",
                              "recovery.durable", "recovery.runtime", "recovery.engines"},
    "recovery": {"recovery.common", "recovery.runtime"},
    "replication.errors": set(),
    "replication.contract": set(),
    "replication.config": set(),
    "replication.forked": set(),
    "replication.training_state": {"replication.errors", "replication.config"},
    "replication.snapshots": {"replication.errors", "replication.config",
                              "replication.training_state"},
    "replication.side_channel": {"replication.errors", "replication.contract",
                                 "replication.config", "replication.training_state",
                                 "replication.snapshots"},
    "replication.replica_protocol": {"replication.errors", "replication.contract",
                                     "replication.config", "replication.training_state",
                                     "replication.snapshots", "replication.side_channel"},
    "replication.durable": {"replication.errors", "replication.contract", "replication.config",
                            "replication.forked", "replication.training_state",
                            "replication.snapshots", "replication.side_channel"},
    "replication": set(),
}
#: The most entries (files and folders) ``recovery/`` may hold at its top level.
MAX_RECOVERY_ENTRIES = 15


def _modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """Every absolute module this file imports (relative imports resolved), with lines."""
    tree = ast.parse(path.read_text(), str(path))
    # The package a relative import starts from (``__package__``): the directory that
    # holds the file, for a package's ``__init__.py`` as for any other module, so
    # ``from . import x`` in ``a/b/__init__.py`` is ``a.b.x`` and ``from .. import x``
    # is ``a.x``.
    package = path.relative_to(root).parent.parts
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - node.level + 1])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if (root / Path(*mod.split("."))).is_dir():
                # ``from package import x``: x is a module of the package (or a name its
                # __init__ defines); either way the dependency is on package.x.
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def _violations() -> list[str]:
    """One line per offending import statement."""
    found: dict[tuple[Path, int], str] = {}
    for path in _modules():
        rel = path.relative_to(ROOT)
        pkg = rel.parts[0]
        in_recipe = rel.parts[:2] == ("recovery", "recipe")
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            allowed = any(mod == a or mod.startswith(a + ".") for a in ALLOWED[pkg])
            if top in FORBIDDEN[pkg] and not allowed:
                found.setdefault((rel, line), f"{rel}:{line} imports {mod} ({pkg} never "
                                 f"imports {top})")
            if in_recipe and top in PACKAGES and not any(
                mod == a or mod.startswith(a + ".") for a in RECIPE_MAY_IMPORT
            ):
                found.setdefault((rel, line), f"{rel}:{line} imports {mod} (recovery/recipe "
                                 "imports only configuration sections)")
    return list(found.values())


def test_no_layer_imports_a_higher_one() -> None:
    assert _violations() == []


def test_no_module_is_over_the_size_limit() -> None:
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in _modules()
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert big == []


@pytest.mark.parametrize("source, pkg, expect", [
    ("from launcher.agent import Agent\n", "recovery", "recovery never imports launcher"),
    ("def f():\n    import launcher.cli\n", "replication", "replication never imports launcher"),
    ("from recovery import protocol\n", "dataloader_cache",
     "dataloader_cache never imports recovery"),
    ("from replication.snapshots.snapshot import SnapshotEngine\n", "dataloader_cache",
     "dataloader_cache never imports replication"),
])
def test_the_check_catches_a_forbidden_import(source, pkg, expect) -> None:
    """The rule is live: a module with a forbidden import, dropped into a package, is
    reported (so the test above cannot pass by parsing nothing)."""
    fake = ROOT / pkg / "_layer_probe_tmp.py"
    fake.write_text(source)
    try:
        assert any(expect in v and "_layer_probe_tmp.py" in v for v in _violations())
    finally:
        fake.unlink()


def test_the_recipe_layer_stays_below_the_rest_of_recovery() -> None:
    fake = ROOT / "recovery" / "recipe" / "_layer_probe_tmp.py"
    fake.write_text("from recovery import runtime\n")
    try:
        assert any("recovery/recipe imports only" in v for v in _violations())
    finally:
        fake.unlink()


@pytest.mark.parametrize("name", ["contract.py", "errors.py"])
def test_the_shared_modules_are_stdlib_only(name) -> None:
    """Every layer imports them: they may import nothing of ours and nothing outside
    the standard library."""
    import sys

    mods = {m.split(".")[0] for _, m in _imports(ROOT / "replication" / name)}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_relative_imports_resolve_as_python_resolves_them(tmp_path) -> None:
    """In a package's ``__init__.py`` as in its other modules, ``.`` is the package
    itself and ``..`` its parent (``importlib.util.resolve_name`` with ``__package__``)."""
    import importlib.util

    sub = tmp_path / "pkg" / "sub"
    sub.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    source = "from . import a\nfrom .. import b\nfrom .mod import c\nfrom ..other import d\n"
    for name in ("__init__.py", "mod.py"):
        (sub / name).write_text(source)
        want = [(1, importlib.util.resolve_name(".a", "pkg.sub")),
                (2, importlib.util.resolve_name("..b", "pkg.sub")),
                (3, importlib.util.resolve_name(".mod", "pkg.sub")),
                (4, importlib.util.resolve_name("..other", "pkg.sub"))]
        assert sorted(_imports(sub / name, tmp_path)) == want, name
    assert want == [(1, "pkg.sub.a"), (2, "pkg.b"), (3, "pkg.sub.mod"), (4, "pkg.other")]


def _room_of_file(rel: Path) -> str | None:
    """The room a file of this project belongs to (None outside the two packages)."""
    parts = rel.with_suffix("").parts
    if parts[0] not in ("recovery", "replication") or len(parts) < 2:
        return None
    return parts[0] if parts[1:] == ("__init__",) else f"{parts[0]}.{parts[1]}"


def _room_of_module(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] not in ("recovery", "replication") or len(parts) < 2:
        return None
    return f"{parts[0]}.{parts[1]}"


def _room_violations(root: Path = ROOT) -> list[str]:
    """One line per import between rooms that :data:`ROOMS` does not allow."""
    out = []
    for pkg in ("recovery", "replication"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root)
            room = _room_of_file(rel)
            if room not in ROOMS:
                out.append(f"{rel}: room {room} is not in tests/test_layers.py ROOMS")
                continue
            for line, mod in _imports(path, root):
                target = _room_of_module(mod)
                if (target is None or target == room or target.split(".")[0] != pkg
                        or target in ROOMS[room]):
                    continue
                out.append(f"{rel}:{line} imports {mod} ({room} may not import {target})")
    return out


def _circle(table: dict[str, set[str]]) -> list[str]:
    """A circle among the rooms of ``table`` (empty if there is none)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(room: str) -> list[str]:
        state[room] = 1
        path.append(room)
        for nxt in sorted(table.get(room, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[room] = 2
        path.pop()
        return []

    for room in sorted(table):
        if room not in state and (found := visit(room)):
            return found
    return []


def test_rooms_import_only_the_rooms_the_table_allows() -> None:
    assert _room_violations() == []


def test_the_room_table_has_no_circle_and_names_real_rooms() -> None:
    assert _circle(ROOMS) == []
    for room in ROOMS:
        pkg, _, name = room.partition(".")
        real = (ROOT / pkg / name).is_dir() or (ROOT / pkg / f"{name}.py").is_file()
        assert not name or real, room


def test_the_circle_check_finds_one() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) == []


def test_an_import_the_room_table_forbids_is_reported() -> None:
    """The room rule is live: a module of a low room importing a higher one is named."""
    fake = ROOT / "recovery" / "job_store" / "_layer_probe_tmp.py"
    fake.write_text("from recovery.runtime import checkpointless\n")
    try:
        assert any("_layer_probe_tmp.py" in v and "recovery.job_store may not import "
                   "recovery.runtime" in v for v in _room_violations())
    finally:
        fake.unlink()


def test_recovery_keeps_few_entries_at_its_top_level() -> None:
    entries = sorted(p.name for p in (ROOT / "recovery").iterdir() if p.name != "__pycache__")
    assert len(entries) <= MAX_RECOVERY_ENTRIES, entries


@pytest.mark.parametrize("pkg", ["recovery", "replication"])
def test_every_room_opens_with_a_docstring(pkg) -> None:
    """Each subpackage says what it owns and what it may use."""
    for init in sorted((ROOT / pkg).glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 60, init
