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
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return ()
    return SPARE_WARM if _top_level_packages(tree.body) & set(FRAMEWORKS) else ()


def _top_level_packages(body: list[ast.stmt]) -> set[str]:
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                found |= _top_level_packages(block)
    return found
