"""Make ``Trainer(strategy="checkpointless")`` resolve without an import in the script.

Lightning resolves strategy names through its registry when the ``Trainer`` is built,
and it has no entry-point group for strategies, so the registration has to run in the
worker before the script builds its Trainer. Importing Lightning eagerly in every worker
would cost seconds for scripts that never use it, so :func:`install` only adds an import
hook: the moment ``lightning.pytorch`` finishes importing (wherever the script imports
it), :func:`recovery.integrations.lightning.registration.register` runs.

This module must stay free of torch and Lightning imports (and outside the Lightning
subpackage, whose ``__init__`` imports Lightning): the launcher's bootstrap and warm
spares import it in every worker.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

from replication import contract

TARGET = "lightning.pytorch"
#: Modules a warm spare should import once a worker of the job has used Lightning
#: (see :func:`mark_for_spares` and ``launcher.spare``).
SPARE_WARM = ("lightning.pytorch", "recovery.integrations.lightning")


class _Loader(importlib.abc.Loader):
    """Delegates to the real loader, then registers once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        _registered_after_import()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``lightning.pytorch``; every other import is untouched."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def install() -> bool:
    """Register the strategy as soon as Lightning is imported; True if Lightning exists.

    Idempotent. If ``lightning.pytorch`` is already imported, registers at once.
    """
    if TARGET in sys.modules:
        _registered_after_import()
        return True
    if importlib.util.find_spec("lightning") is None:
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return True


def _registered_after_import() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    from recovery.integrations.lightning.registration import register

    register()
    mark_for_spares()


def mark_for_spares() -> None:
    """Tell this job's warm spares to import Lightning too (see ``launcher.spare``).

    A replacement for a Lightning worker would otherwise pay Lightning's import (seconds)
    on the recovery path. The marker is a file per module under ``<run_dir>/warm/``;
    only launched workers (with a run directory from the agent) write it.
    """
    run_dir = os.environ.get(contract.ENV_RUN_DIR)
    if not run_dir or not os.environ.get(contract.ENV_STORE):
        return
    warm = os.path.join(run_dir, "warm")
    try:
        os.makedirs(warm, exist_ok=True)
        for name in SPARE_WARM:
            path = os.path.join(warm, name)
            if not os.path.exists(path):
                open(path, "a").close()
    except OSError:
        pass  # an optimisation only
