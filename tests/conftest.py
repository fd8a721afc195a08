"""Suite-wide collection rules, and one guard every test runs under.

``tests/nemo_toolkit/`` needs NeMo, whose 3.x release pins Lightning 2.4: it runs in its
own environment (``.venv-nemo``, ``make test-nemo``, part of ``make test``), not in the
main one, which has a newer Lightning.
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
