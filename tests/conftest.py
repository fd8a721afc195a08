"""Suite-wide collection rules.

``tests/nemo_toolkit/`` needs NeMo, whose 3.x release pins Lightning 2.4: it runs in its
own environment (``.venv-nemo``, ``make test-nemo``, part of ``make test``), not in the
main one, which has a newer Lightning.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

collect_ignore: list[str] = []
try:
    version("nemo_toolkit")
except PackageNotFoundError:
    collect_ignore.append("nemo_toolkit")
