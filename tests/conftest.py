"""Suite-wide collection rules, and one guard every test runs under.

``tests/nemo_toolkit/`` needs NeMo, whose 3.x release pins Lightning 2.4: it runs in its
own environment (``.venv-nemo``, ``make test-nemo``, part of ``make test``), not in the
main one, which has a newer Lightning.

The files in :data:`COMPAT_FILES` are also the compatibility leg (``-m compat``,
``make test-compat``): the same tests on the newest torch and Python 3.12, one file per
capability a user meets (the owned group, DDP and FSDP2 recovery, live rollback, shrink
and grow, Lightning, the durable tier, Slurm, the private torch APIs reached into).
"""

from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

import pytest

collect_ignore: list[str] = []
try:
    version("nemo_toolkit")
except PackageNotFoundError:
    collect_ignore.append("nemo_toolkit")


#: The compatibility leg's files (docs/testing.md, "The compatibility leg").
COMPAT_FILES = frozenset({
    "test_abortable_gloo.py", "test_commit_tree.py", "test_dataloader_cache.py",
    "test_durable.py", "test_durable_runtime.py", "test_durable_slot.py", "test_fsdp2.py",
    "test_fsdp2_training.py", "test_inner_backends.py", "test_lightning_demo_models.py",
    "test_lightning_strategy.py", "test_live_rollback.py", "test_owned_group.py",
    "test_readme_loops.py", "test_recovery_faults.py", "test_shrink.py", "test_slurm.py",
    "test_preload.py", "test_snapshot.py", "test_torch_internals.py",
})

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in COMPAT_FILES:
            item.add_marker(pytest.mark.compat)


_REAL_CLOCKS = {name: getattr(time, name) for name in ("perf_counter", "monotonic", "time")}


@pytest.fixture(autouse=True)
def _clocks_left_real():
    """Fail the test that leaves a fake clock in the ``time`` module: every later test in
    that process would read it (one did, through a "restore" that put the fake back, and
    a timing assertion in another file then failed, in full runs only)."""
    yield
    left = [name for name, real in _REAL_CLOCKS.items() if getattr(time, name) is not real]
    for name in left:
        setattr(time, name, _REAL_CLOCKS[name])
    assert not left, f"this test left time.{', time.'.join(left)} replaced"
