"""Make ``Trainer(strategy="checkpointless")`` resolve without an import in the script,
and prepare DeepSpeed for the runtime the moment the script imports it.

Lightning resolves strategy names through its registry when the ``Trainer`` is built,
and it has no entry-point group for strategies, so the registration has to run in the
worker before the script builds its Trainer. Importing Lightning eagerly in every worker
would cost seconds for scripts that never use it, so :func:`install` only adds an import
hook: the moment ``lightning.pytorch`` finishes importing (wherever the script imports
it), :func:`recovery.integrations.lightning.registration.register` runs. The same hook
runs :func:`recovery.engines.deepspeed_engine.install` once ``deepspeed`` is imported,
before the script's ``deepspeed.init_distributed()`` (which would otherwise build a
shared-memory all-reduce outside the runtime's process group).

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
DEEPSPEED = "deepspeed"
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
        _AFTER_IMPORT[module.__name__]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loaders of ``lightning.pytorch`` and ``deepspeed``; every other import
    is untouched."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _AFTER_IMPORT or fullname in self.done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


    def __init__(self) -> None:
        self.done: set[str] = set()  # targets whose hook ran


_FINDER = _Finder()


def install() -> bool:
    """Register the strategy as soon as Lightning is imported; True if Lightning exists.

    Idempotent. A target already imported gets its hook at once. DeepSpeed's is
    installed whether Lightning exists or not.
    """
    if DEEPSPEED in sys.modules:
        _deepspeed_imported()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    if TARGET in sys.modules:
        _registered_after_import()
        return True
    return importlib.util.find_spec("lightning") is not None


def _registered_after_import() -> None:
    _FINDER.done.add(TARGET)
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


def _deepspeed_imported() -> None:
    _FINDER.done.add(DEEPSPEED)
    try:
        from recovery.engines import deepspeed_engine

        deepspeed_engine.install()
    except Exception as exc:  # never break the script's own import of DeepSpeed
        print(f"checkpointless: DeepSpeed's shared-memory all-reduce stays on ({exc}); it "
              "bypasses the runtime's process group", file=sys.stderr, flush=True)


_AFTER_IMPORT = {TARGET: _registered_after_import, DEEPSPEED: _deepspeed_imported}
