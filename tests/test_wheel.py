"""The package as a user installs it: a wheel, in a fresh environment, with no checkout.

``python -m build`` makes the sdist and the wheel; the wheel is installed into a new
virtual environment whose only view of the test environment is its third-party
packages (torch and the other dependencies, through a path file: installing torch again
would download hundreds of megabytes). From a directory outside the checkout, with no
``PYTHONPATH``, the installed console script must print its version and the resolved
configuration, and run a two-process job with a killed worker that ends bit-identical
to the same job without the kill. A file the product needs but the wheel lacks (package
data, a module left out of the package list), or an import of the test tree from the
product, fails here and nowhere else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(300)]

SCRIPT = '''\
import json, sys
import torch, torch.distributed as dist
import recovery
from recovery import Checkpointless

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
cl = Checkpointless(model=model, optimizer=opt)

def step(i):
    g = torch.Generator().manual_seed(10 * i + dist.get_rank())
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

cl.run(step, 12)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"weights": [p.tolist() for p in model.parameters()],
                   "module": recovery.__file__}, f)
dist.destroy_process_group()
'''


def _run(cmd: list, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("CHECKPOINTLESS_")}
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh virtual environment with the built wheel installed; returns its bin/."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist_dir = tmp / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist_dir, REPO],
         cwd=tmp)
    wheels, sdists = list(dist_dir.glob("*.whl")), list(dist_dir.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(dist_dir.iterdir())
    venv = tmp / "venv"
    # no pip or setuptools of its own: older copies would shadow the ones torch needs;
    # this environment's pip installs into it (``pip --python``)
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                cwd=tmp).stdout.strip()
    # the dependencies, not this checkout: a plain path entry (the editable install's
    # path file in that directory is not processed from here)
    Path(site, "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index",
          wheels[0]], cwd=tmp)
    return venv / "bin"


def test_the_console_script_says_its_version_and_configuration(installed, tmp_path):
    version = _run([installed / "checkpointless", "--version"], cwd=tmp_path).stdout
    assert version.startswith("checkpointless 0.1.0"), version
    shown = _run([installed / "checkpointless", "config", "show", "--ignore-env",
                  "replication.factor=3"], cwd=tmp_path).stdout
    assert "factor: 3" in shown and "every_n_steps: auto" in shown, shown


def test_a_job_with_a_killed_worker_ends_bit_identical(installed, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    results = {}
    for name, extra in (("reference", []), ("killed", ["recovery.fault=1:6:backward"])):
        out = tmp_path / f"{name}.json"
        _run([installed / "checkpointless", "run", "--standalone", "--nproc-per-node", "2",
              "--spares", "1", "--run-dir", tmp_path / name, "replication.every_n_steps=1",
              *extra, script, out], cwd=tmp_path)
        results[name] = json.loads(out.read_text())
    module = Path(results["killed"]["module"]).resolve()
    assert installed.parent.resolve() in module.parents, f"imported from {module}"
    events = [json.loads(line) for line in (tmp_path / "killed" / "events.jsonl").open()]
    assert any(e["event"] == "recovery" for e in events), "the kill was not recovered"
    assert results["killed"]["weights"] == results["reference"]["weights"]
