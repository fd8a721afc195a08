"""Every Python block of the README and of the guide's loop page runs as written.

The training loops (the README's, and the guide's plain and DDP loops in
docs/guide/loops.md) run under the launcher with a worker killed; the replacement
snippet runs as a plain script, as a first process and as a replacement. Each is
extracted from its page and run with a prelude that defines only the names the page
leaves to the reader (``MyDataset``, ``dataset``, ``build_model``, ``loss_fn``) and the
imports it assumes. A snippet that stops working, or drifts from the API, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.recovery_harness import assert_succeeded, run_job

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = '''\
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from recovery import Checkpointless

def MyDataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))

dataset = MyDataset()
build_model = lambda: nn.Linear(8, 1)
loss_fn = nn.functional.mse_loss
'''


def _snippet(section: str, page: str = "docs/guide/loops.md") -> str:
    text = (ROOT / page).read_text()
    start = text.index(section)
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no Python block after {section!r}"
    return block.group(1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page,section", [
    ("README.md", "## Three ways to use it"),
    ("docs/guide/loops.md", "## A plain loop"),
    ("docs/guide/loops.md", "## Keep your DDP or FSDP2 loop"),
])
def test_the_documented_loop_runs_as_written(tmp_path, page, section):
    code = _snippet(section, page)
    assert "cl.epochs(" in code and "cl.training_step()" in code, code
    script = tmp_path / "snippet.py"
    script.write_text(PRELUDE + "\n" + code)
    job = run_job(tmp_path / "run", nproc=2, script=str(script), script_args=(),
                  timeout_s=240, overrides=("recovery.fault=1:7:backward:sigkill",),
                  spares=1)
    assert_succeeded(job)
    assert job.events("recovery"), job.output()
    done = job.events("worker_done")
    assert sorted(e["step"] for e in done if "step" in e)[-1] == 40, job.output()


@pytest.mark.parametrize("replacement", ["0", "1"])
def test_the_replacement_snippet_runs_as_written(tmp_path, replacement):
    """The third Python block (skip initialisation in a replacement) builds a model
    whose parameters live on the CPU either way (values arrive later in a replacement)."""
    import os
    import subprocess
    import sys

    from replication.contract import ENV_REPLACEMENT

    code = _snippet("so skip expensive initialisation there")
    assert "is_replacement" in code, code
    script = tmp_path / "snippet.py"
    script.write_text(PRELUDE + "\n" + code + "\nassert next(model.parameters()).device.type"
                      " == 'cpu'\nprint('ok', next(model.parameters()).shape)\n")
    env = {**os.environ, ENV_REPLACEMENT: replacement, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
