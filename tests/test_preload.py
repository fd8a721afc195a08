"""The zygote imports what the training script imports, where a fork survives it.

Stand-in modules on ``PYTHONPATH`` play the parts: one that is slow and harmless (the
``transformers`` of these tests), one that fails to import, one that starts a thread,
one that hangs, and one that loads a shared library named ``libcuda.so`` at import, as
any CUDA call does: the zygote's own fork check (``launcher.zygote.fork_hazard``) reads
the driver's mapping from ``/proc/self/maps``, so the stand-in trips the same check a
real CUDA initialisation does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.script_imports import modules_to_preload
from tests.launcher_scripts.harness import REPO, Agents, clean_env, events

STAND_INS = {
    "slow_ok": "import time\ntime.sleep(0.3)\nVALUE = 42\n",
    "also_ok": "import slow_ok\n",
    "raises_at_import": "raise RuntimeError('no licence server')\n",
    "threads_at_import": ("import threading, time\n"
                          "threading.Thread(target=time.sleep, args=(3600,),\n"
                          "                 daemon=True).start()\n"),
    "hangs_at_import": "import time\ntime.sleep(3600)\n",
    "cuda_at_import": "import ctypes, os\nctypes.CDLL(os.environ['FAKE_LIBCUDA'])\n",
}


@pytest.fixture
def site(tmp_path) -> tuple[Path, dict[str, str]]:
    """A directory of stand-in modules and the environment that puts it on the path."""
    where = tmp_path / "site"
    where.mkdir()
    for name, body in STAND_INS.items():
        (where / f"{name}.py").write_text(body)
    lib = tmp_path / "lib" / "libcuda.so"
    lib.parent.mkdir()
    src = tmp_path / "lib" / "fake.c"
    src.write_text("int fake_cuda_stand_in(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    env = clean_env()
    env["PYTHONPATH"] = f"{where}:{REPO}"
    env["FAKE_LIBCUDA"] = str(lib)
    return where, env


# --- which modules -----------------------------------------------------------------------
def test_the_scripts_imports_and_its_local_modules_imports_are_found(tmp_path) -> None:
    (tmp_path / "helpers.py").write_text("import yaml\nfrom mylib.models import GPT\nimport os\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import transformers\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from __future__ import annotations
        import json, os
        import torch.nn.functional as F
        import numpy as np
        from recovery import Checkpointless
        import helpers
        from pkg import thing
        from . import sibling
        try:
            import wandb
        except ImportError:
            wandb = None
        if os.environ.get("X"):
            import tensorboard
        def main():
            import late_import
        """))
    found = modules_to_preload(str(script), module=False)
    assert found == ["torch.nn.functional", "numpy", "yaml", "mylib.models", "mylib.models:GPT",
                     "transformers", "wandb", "tensorboard",
                     "?torch._dynamo"]  # the first torch.optim optimizer imports it
    assert modules_to_preload(str(script), False, extra=("scipy",), deny=("torch", "mylib")) \
        == ["numpy", "yaml", "transformers", "wandb", "tensorboard", "scipy"]
    assert modules_to_preload(str(script), False, extra=("scipy",), deny=("*",)) == []
    assert modules_to_preload("some.module", module=True, extra=("scipy",)) == ["scipy"]
    (tmp_path / "bad.py").write_text("def (\n")
    assert modules_to_preload(str(tmp_path / "bad.py"), module=False) == []
    assert modules_to_preload(str(tmp_path / "missing.py"), module=False) == []


def test_local_modules_that_import_each_other_are_read_once(tmp_path) -> None:
    (tmp_path / "a.py").write_text("import b\nimport numpy\n")
    (tmp_path / "b.py").write_text("import a\nimport yaml\n")
    (tmp_path / "train.py").write_text("import a\n")
    assert modules_to_preload(str(tmp_path / "train.py"), module=False) == ["yaml", "numpy"]


# --- the probe -----------------------------------------------------------------------------
_PRELOAD = """
import json, sys, threading, torch
from launcher import preload, zygote
names = sys.argv[1].split(",")
report = preload.preload(names, timeout_s=float(sys.argv[2]))
print(json.dumps({**report.as_message(), "hazard": zygote.fork_hazard(),
                  "threads": len(__import__("os").listdir("/proc/self/task")),
                  "loaded_here": [n for n in names if n in sys.modules]}))
"""


def _preload(env: dict[str, str], names: list[str], timeout_s: float = 60.0) -> dict:
    done = subprocess.run([sys.executable, "-c", _PRELOAD, ",".join(names), str(timeout_s)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_only_imports_that_a_fork_survives_are_made_in_the_zygote(site) -> None:
    """Each harmful module is left with its reason; the modules after it are still
    checked (by a new probe) and made; the zygote ends with no CUDA driver and no
    stray thread."""
    _, env = site
    names = ["slow_ok", "raises_at_import", "cuda_at_import", "also_ok", "threads_at_import",
             "json"]
    report = _preload(env, names)
    assert report["preloaded"] == ["slow_ok", "also_ok"], report
    assert report["left"] == {
        "raises_at_import": "failed to import (RuntimeError: no licence server)",
        "cuda_at_import": "loads the CUDA driver at import",
        "threads_at_import": "starts 1 thread(s) at import",
    }, report
    assert report["hazard"] is None
    assert report["loaded_here"] == ["slow_ok", "also_ok", "json"]  # json: imported already


def test_what_a_package_imports_lazily_is_preloaded_and_skipped_quietly_if_absent(
        site, tmp_path) -> None:
    """``deepspeed.initialize`` and the first torch optimizer import ``torch._dynamo`` and
    DeepSpeed's compiler-backed modules: 1.7 s a replacement paid after the failure. A
    script importing the package gets them preloaded; a name another version lacks is
    dropped without a word (``?`` marks it optional), unlike a module the script names."""
    _, env = site
    (tmp_path / "train.py").write_text("import torch\nimport deepspeed\n")
    names = modules_to_preload(str(tmp_path / "train.py"), module=False)
    assert names == ["torch", "deepspeed", "?torch._dynamo",
                     "?deepspeed.runtime.zero.muon.muon_optimizer",
                     "?deepspeed.module_inject.auto_ep_layer"], names
    report = _preload(env, ["torch", "?torch._dynamo", "?no_such.module", "no_such_either"])
    assert report["preloaded"] == ["torch._dynamo"], report
    assert list(report["left"]) == ["no_such_either"], report
    assert report["loaded_here"] == ["torch"]


def test_a_module_that_hangs_at_import_is_left_when_the_time_is_up(site) -> None:
    _, env = site
    report = _preload(env, ["slow_ok", "hangs_at_import", "also_ok"], timeout_s=3.0)
    assert report["preloaded"] == ["slow_ok"], report
    assert report["left"]["hangs_at_import"].startswith("did not finish importing within")
    assert report["left"]["also_ok"].startswith("did not finish importing within")


# --- in a job -------------------------------------------------------------------------------
_SCRIPT = """
import json, os, sys, time
seen = {{m: m in sys.modules for m in ("slow_ok", "cuda_at_import", "threads_at_import")}}
import slow_ok
try:
    import raises_at_import
except RuntimeError:
    pass
{extra}
out = sys.argv[1]
rank, again = os.environ["RANK"], os.environ["CHECKPOINTLESS_INTERNAL_REPLACEMENT"] == "1"
with open(os.path.join(out, f"{{rank}}-{{int(again)}}.json"), "w") as f:
    json.dump({{"seen": seen, "pid": os.getpid()}}, f)
if rank == "1" and not again:
    sys.exit(1)  # replaced by the warm spare
deadline = time.monotonic() + 60
while rank == "0" and not os.path.exists(os.path.join(out, "1-1.json")):
    time.sleep(0.05)
    assert time.monotonic() < deadline
"""


@pytest.mark.parametrize("cuda", [False, True])
def test_workers_and_a_replacement_start_with_the_scripts_imports(site, tmp_path, cuda) -> None:
    """The first workers and the warm spare that replaces rank 1 find the script's slow
    import done; a module that loads the CUDA driver is left to each worker, said in
    the agent's start-up line, and the spares still work."""
    _, env = site
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(extra="import cuda_at_import" if cuda else ""))
    agents = Agents(tmp_path)
    try:
        run_dir = tmp_path / "run"
        proc = agents.start("--standalone", "--nproc-per-node", "2", "--spares", "1",
                            "--run-dir", str(run_dir), str(script), str(out), env=env)
        assert agents.wait(proc, timeout=120) == 0, agents.log(proc)
        log = agents.log(proc)
    finally:
        agents.close()
    for name in ("0-0", "1-0", "1-1"):
        rec = json.loads((out / f"{name}.json").read_text())
        assert rec["seen"] == {"slow_ok": True, "cuda_at_import": False,
                               "threads_at_import": False}, (name, log)
    [assigned] = events(run_dir, "replacement_assigned")
    assert assigned["started"] == "spare", assigned
    [ready] = events(run_dir, "zygote_ready")
    assert ready["preloaded"] == ["slow_ok"], ready
    want = {"raises_at_import": "failed to import (RuntimeError: no licence server)"}
    if cuda:
        want["cuda_at_import"] = "loads the CUDA driver at import"
    assert ready["left"] == want, ready
    line = next(x for x in log.splitlines() if "before forking" in x)
    assert "slow_ok" in line and "raises_at_import (failed to import" in line, line
    assert ("cuda_at_import (loads the CUDA driver at import)" in line) is cuda, line


def test_no_preload_leaves_every_import_to_the_workers(site, tmp_path) -> None:
    _, env = site
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(extra=""))
    agents = Agents(tmp_path)
    try:
        run_dir = tmp_path / "run"
        proc = agents.start("--standalone", "--nproc-per-node", "2", "--spares", "1",
                            "--no-preload", "*", "--run-dir", str(run_dir), str(script),
                            str(out), env=env)
        assert agents.wait(proc, timeout=120) == 0, agents.log(proc)
    finally:
        agents.close()
    assert not json.loads((out / "0-0.json").read_text())["seen"]["slow_ok"]
    [ready] = events(run_dir, "zygote_ready")
    assert ready.get("preloaded", []) == []


@pytest.mark.parametrize("flag, value, message", [
    ("--preload", "not a module", "--preload: 'not a module' is not a module name"),
    ("--no-preload", "x..y", "--no-preload: 'x..y' is not a module name"),
])
def test_a_bad_module_name_is_one_line(tmp_path, flag, value, message) -> None:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "run", "--standalone", flag,
                           value, str(script)], cwd=REPO, env=clean_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("zygote", [True, False])
def test_a_module_only_the_agents_directory_reaches_fails_the_same_way_forked_or_not(
        tmp_path, zygote: bool) -> None:
    """``python scripts/train.py`` puts ``scripts/`` first on ``sys.path``, never the
    working directory. A module found only there (beside the agent, not beside the
    script) must not be preloaded by the zygote, whose own path has the working
    directory: a forked worker would then import it and a worker started as a new
    interpreter (no zygote, or one not ready yet) would not. Both fail alike, with the
    worker's own ``ModuleNotFoundError``, as under torchrun."""
    work = tmp_path / "work"
    (work / "scripts").mkdir(parents=True)
    (work / "cwd_only.py").write_text("VALUE = 1\n")
    (work / "scripts" / "train.py").write_text("import cwd_only\nprint(cwd_only.VALUE)\n")
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node", "1",
         *([] if zygote else ["--no-zygote"]), "--run-dir", str(tmp_path / "run"),
         "scripts/train.py"], cwd=work, env=clean_env(), capture_output=True, text=True,
        timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "No module named 'cwd_only'" in done.stdout + done.stderr, done.stdout + done.stderr
    ready = events(tmp_path / "run", "zygote_ready")
    assert all("cwd_only" not in r.get("preloaded", []) for r in ready)
