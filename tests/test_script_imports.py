"""Which frameworks the zygote warms for a script's first workers (ADR 0029), read from
the script's source without running it."""

from __future__ import annotations

import textwrap

import pytest

from launcher.script_imports import frameworks_to_warm
from recovery.integrations.autoload import SPARE_WARM


@pytest.mark.parametrize(("source", "warm"), [
    ("import lightning as L\n", True),
    ("from lightning.pytorch import Trainer\n", True),
    ("import torch, lightning.pytorch\n", True),
    ("try:\n    import lightning\nexcept ImportError:\n    lightning = None\n", True),
    ("if True:\n    from lightning import LightningModule\n", True),
    ("import torch\nimport lightning_utilities\n", False),  # not Lightning itself
    ("def main():\n    import lightning\n", False),  # imported only when main() runs
    ("from .lightning import thing\n", False),  # a relative import of the user's own
    ("import torch\n", False),
])
def test_a_script_that_imports_lightning_gets_it_warmed(tmp_path, source, warm):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    assert frameworks_to_warm(str(script), module=False) == (SPARE_WARM if warm else ())


def test_what_cannot_be_read_warms_nothing(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import lightning\ndef (:\n")
    assert frameworks_to_warm(str(bad), module=False) == ()
    assert frameworks_to_warm(str(tmp_path / "missing.py"), module=False) == ()
    binary = tmp_path / "binary.py"
    binary.write_bytes(b"\xff\xfe\x00import lightning")
    assert frameworks_to_warm(str(binary), module=False) == ()
    assert frameworks_to_warm("some.module", module=True) == ()
