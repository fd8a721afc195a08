"""Which frameworks a training script imports, read from its source (never run).

The zygote imports them before it forks the first workers (ADR 0029), so the workers of
a Lightning script share one ``import lightning`` (about 3 s of CPU here) instead of
paying one each. Only frameworks that the zygote already imports for spares once a
worker asks (``recovery.integrations.autoload.SPARE_WARM``) qualify: their import is
known to leave nothing behind that a fork would break. Whatever else a script imports
stays its own business, paid in each worker as before.
"""

from __future__ import annotations

import ast
import os
import sys

from recovery.integrations.autoload import SPARE_WARM

#: Top-level packages whose import in a script means "warm SPARE_WARM in the zygote".
FRAMEWORKS = ("lightning",)


def frameworks_to_warm(script: str, module: bool) -> tuple[str, ...]:
    """The modules to import in the zygote for ``script``: ``SPARE_WARM`` when the
    script imports Lightning at module level (also inside a top-level ``if`` or
    ``try``), else nothing. A module run with ``-m``, or a file that cannot be read or
    parsed, gets nothing: the workers then import what they need, as before."""
    if module:
        return ()
    tree = _parse(script)
    if tree is None:
        return ()
    return SPARE_WARM if _top_level_packages(tree.body) & set(FRAMEWORKS) else ()


def _top_level_packages(body: list[ast.stmt]) -> set[str]:
    return {name.split(":")[0].split(".")[0] for name in _top_level_modules(body)}


#: Modules a package imports lazily the first time a script uses it, which a replacement
#: would otherwise import after the failure: the first ``torch.optim`` optimizer imports
#: ``torch._dynamo`` (0.9 s here), and ``deepspeed.initialize`` its Muon optimizer's
#: module, which imports the compiler stack (0.8 s more). A script that imports the
#: package gets them preloaded too, marked :data:`OPTIONAL` (a version without them skips
#: them quietly; :mod:`launcher.preload`).
IMPLIED = {
    "torch": ("torch._dynamo",),
    "deepspeed": ("deepspeed.runtime.zero.muon.muon_optimizer",
                  "deepspeed.module_inject.auto_ep_layer"),
}
OPTIONAL = "?"
#: Packages of this project: a spare imports them already (``launcher.spare.WARM_MODULES``).
OWN_PACKAGES = frozenset({"recovery", "replication", "launcher", "dataloader_cache"})
#: How deep :func:`modules_to_preload` follows the script's local modules.
LOCAL_DEPTH = 3


def modules_to_preload(script: str, module: bool, extra: tuple[str, ...] = (),
                       deny: tuple[str, ...] = ()) -> list[str]:
    """The modules a zygote should import for ``script`` before it forks, in the order
    the script imports them: every module-level import of the script, and of the local
    modules it imports (files beside it, followed ``LOCAL_DEPTH`` deep; never imported
    themselves, since a local module may do the rank's own work), that is neither in
    the standard library nor of this project, and each name a ``from`` import takes of
    it (``module:name``: some packages load a name's module only when it is looked up);
    then ``extra``, then what those packages import lazily (:data:`IMPLIED`). A name in
    ``deny``, or under one, is left out; ``deny=("*",)`` leaves out everything. Whether
    each is safe to import before a fork is the zygote's check (:mod:`launcher.preload`)."""
    if "*" in deny:
        return []
    found: list[str] = []
    if not module:
        _collect(os.path.abspath(script), found, set(), LOCAL_DEPTH)
    tops = dict.fromkeys(m.split(":")[0].split(".")[0] for m in [*found, *extra])
    implied = [OPTIONAL + m for top in tops for m in IMPLIED.get(top, ())]
    return [m for m in dict.fromkeys([*found, *extra, *implied])
            if not any(m.lstrip(OPTIONAL).split(":")[0] == d
                       or m.lstrip(OPTIONAL).startswith(d + ".") for d in deny)]


def _collect(path: str, found: list[str], seen: set[str], depth: int) -> None:
    if path in seen or depth < 0:
        return
    seen.add(path)
    tree = _parse(path)
    if tree is None:
        return
    here = os.path.dirname(path)
    for name in _top_level_modules(tree.body):
        top = name.split(".")[0].split(":")[0]
        local = _local_file(here, top)
        if local is not None:
            _collect(local, found, seen, depth - 1)
        elif top not in sys.stdlib_module_names and top not in OWN_PACKAGES \
                and top != "__future__":
            found.append(name)


def _parse(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _local_file(here: str, top: str) -> str | None:
    """The file of a module that lives beside the script (its directory is first on the
    worker's ``sys.path``), or None."""
    for candidate in (os.path.join(here, f"{top}.py"), os.path.join(here, top, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _top_level_modules(body: list[ast.stmt]) -> list[str]:
    """Absolute modules imported at module level (also inside a top-level ``if`` or
    ``try``), in order; ``from a.b import c`` gives ``a.b`` and ``a.b:c``."""
    found: list[str] = []
    for node in body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # ``from transformers import GPT2LMHeadModel``: the names too, since a
            # package may load a name's module only when it is first looked up
            found.append(node.module)
            found += [f"{node.module}:{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                found += _top_level_modules(block)
    return found
