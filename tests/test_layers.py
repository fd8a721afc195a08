"""The layer rule of ``docs/architecture.md``, checked by parsing every import.

    launcher/          may import everything below
    recovery/          may import replication/ and dataloader_cache/, never launcher/
      recovery/recipe/ (the configuration layer) imports only configuration sections
    replication/       imports neither recovery/ nor launcher/ (nor dataloader_cache/)
    dataloader_cache/  imports neither recovery/ nor launcher/; from replication/ only
                       the stdlib-only process contract (replication/contract.py)

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
#: (``recovery.fault_spec`` is the grammar of the ``recovery.fault`` setting, stdlib-only.)
RECIPE_MAY_IMPORT = ("recovery.recipe", "recovery.config", "recovery.fault_spec",
                     "replication.config", "replication.contract", "replication.errors",
                     "dataloader_cache.config")


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
    ("from replication.snapshot import SnapshotEngine\n", "dataloader_cache",
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
