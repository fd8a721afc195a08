"""Lightning: a recovery keeps the model and the optimizer state on their device.

Lightning's own teardown moves the model and the optimizer state to the CPU; a recovery
that went through it paid, on a GPU, two passes of the whole state over PCIe (to the
host, and back in the next attempt's ``model_to_device``) for state the restore then
overwrites. These runs make a real in-process recovery (an injected exception in one
process; a SIGKILLed peer under ``checkpointless run``) and record, in the worker, every
call that moves the LightningModule (``Module.cpu``/``to``/``cuda``) or an optimizer's
state (Lightning's ``_optimizer_to_device``) and when it happened. On the CPU such a move
is free but still a call: none may happen between the failed attempt and the next one.

The runtime joins the job before Lightning's ``setup_environment`` runs; the device must
be selected first (on a GPU host: ``torch.cuda.set_device``), or the runtime's group, a
replacement's pinned buffers and its restore use cuda:0 on every local rank.

``test_gpu_recovery_keeps_state_on_the_device`` runs the same recovery on a GPU (the GPU
check, ``make test-gpu``): parameter storage kept across the recovery, optimizer state
back on the card, and a ``process_group_backend="gloo"`` run whose CUDA gradients go
through the runtime's gloo inner backend.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

import torch

from tests.recovery_harness import assert_succeeded, clean_env, run_job

pytestmark = pytest.mark.timeout(300)

#: The worker: a small Lightning fit with the probe installed before anything runs.
WORKER = r'''
import argparse
import functools
import json
import os

import lightning as L
import torch
from lightning.fabric.utilities import optimizer as fabric_optimizer
from lightning.pytorch.strategies import strategy as strategy_module
from torch.utils.data import DataLoader, TensorDataset

import recovery.runtime.checkpointless

LAUNCHED = "CHECKPOINTLESS_INTERNAL_STORE" in os.environ
if not LAUNCHED:
    import recovery.integrations.lightning  # noqa: F401

phase = ["before fit"]
moves = []  # every move of the module or of optimizer state, with the phase it fell in
order = []  # device selection and runtime creation, in order
probe = {"attempts": 0}


def record(what, device):
    moves.append({"phase": phase[0], "what": what, "device": str(device)})


def wrap_module(name, device_of):
    original = getattr(torch.nn.Module, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if isinstance(self, L.LightningModule):
            record(f"module.{name}", device_of(*args, **kwargs))
        return original(self, *args, **kwargs)

    setattr(torch.nn.Module, name, wrapper)


wrap_module("cpu", lambda *a, **k: "cpu")
wrap_module("cuda", lambda device=None, **k: f"cuda:{device}")
wrap_module("to", lambda *a, **k: torch._C._nn._parse_to(*a, **k)[0])

original_opt_to_device = fabric_optimizer._optimizer_to_device


def opt_to_device(optimizer, device):
    if len(optimizer.state):  # an empty state moves nothing
        record("optimizer_state", device)
    return original_opt_to_device(optimizer, device)


fabric_optimizer._optimizer_to_device = opt_to_device  # what _optimizers_to_device calls
strategy_module._optimizer_to_device = opt_to_device  # imported by name there

def wrap_setup_device(cls):
    """Record the device selection of the Trainer's accelerator class."""
    original = cls.setup_device

    def setup_device(self, device):
        order.append(f"setup_device {device}")
        return original(self, device)

    cls.setup_device = setup_device

original_session_init = recovery.runtime.checkpointless.Checkpointless.__init__


def session_init(self, *args, **kwargs):
    order.append(f"runtime backend={kwargs.get('backend')}")
    return original_session_init(self, *args, **kwargs)


recovery.runtime.checkpointless.Checkpointless.__init__ = session_init

original_fit_impl = L.Trainer._fit_impl


@functools.wraps(original_fit_impl)
def fit_impl(self, *args, **kwargs):
    probe["attempts"] += 1
    phase[0] = f"attempt {probe['attempts']}"
    try:
        return original_fit_impl(self, *args, **kwargs)
    except BaseException:
        module = self.lightning_module
        probe["params_at_failure"] = [[id(p), p.data_ptr()] for p in module.parameters()]
        phase[0] = f"recovery after attempt {probe['attempts']}"
        raise
    finally:
        if phase[0].startswith("attempt"):
            phase[0] = "after fit"


L.Trainer._fit_impl = fit_impl


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        if probe["attempts"] > 1 and "params_after_restore" not in probe:
            probe["params_after_restore"] = [[id(p), p.data_ptr()] for p in self.parameters()]
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if probe["attempts"] > 1:  # the state the resumed attempt trains with
            opt = self.trainer.optimizers[0]
            probe["resumed_devices"] = sorted(
                {str(p.device) for p in self.parameters()}
                | {str(v.device) for s in opt.state.values() for k, v in s.items()
                   if torch.is_tensor(v) and k != "step"})

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--pg-backend", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR", "."))
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    from recovery.integrations.lightning import CheckpointlessStrategy

    kwargs = {} if LAUNCHED else {"overrides": ["replication.every_n_steps=2"]}
    strategy = CheckpointlessStrategy(process_group_backend=args.pg_backend, **kwargs)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    trainer = L.Trainer(
        strategy=strategy, accelerator=args.accelerator,
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0)
    wrap_setup_device(type(trainer.accelerator))
    net = Net()
    trainer.fit(net, DataLoader(data, batch_size=4, shuffle=True))
    import hashlib
    digest = hashlib.sha256(b"".join(p.detach().cpu().contiguous().numpy().tobytes()
                                     for p in net.parameters())).hexdigest()
    probe.update(moves=moves, order=order, step=trainer.global_step, digest=digest)
    with open(os.path.join(args.out, f"probe_rank{trainer.global_rank}.json"), "w") as f:
        json.dump(probe, f)


if __name__ == "__main__":
    main()
'''


def _worker(tmp_path: Path) -> Path:
    script = tmp_path / "device_moves_worker.py"
    script.write_text(WORKER)
    return script


def _run_alone(tmp_path: Path, *args: str, fault: str = "0:5:forward:exception") -> dict:
    """One process, no launcher: the injected exception is recovered in-process."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**clean_env(), "CHECKPOINTLESS_RECOVERY_FAULT": fault}
    proc = subprocess.run([sys.executable, str(_worker(tmp_path)), "--out", str(out), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "probe_rank0.json").read_text())


def _assert_recovered_in_place(probe: dict, steps: int = 10) -> None:
    assert probe["attempts"] == 2, f"expected one recovery (two fit attempts): {probe}"
    assert probe["step"] == steps
    during = [m for m in probe["moves"] if m["phase"].startswith("recovery")]
    assert not during, (
        f"the recovery moved the model or the optimizer state ({len(during)} calls): "
        f"{during}")
    assert probe["params_after_restore"] == probe["params_at_failure"], (
        "the restore must load into the same parameter tensors")


def test_recovery_moves_neither_model_nor_optimizer_state(tmp_path):
    """An exception in step 5's forward: the failed attempt is released and ``fit``
    re-entered from the restored state, with no call moving the module or the optimizer
    state in between."""
    probe = _run_alone(tmp_path)
    _assert_recovered_in_place(probe)
    assert probe["resumed_devices"] == ["cpu"]


def test_device_is_selected_before_the_runtime_joins(tmp_path):
    """The accelerator's device is set before the runtime (its process group, a
    replacement's restore) exists: on a GPU host every local rank would otherwise start
    on cuda:0."""
    probe = _run_alone(tmp_path, fault="")
    assert probe["attempts"] == 1
    runtime = [i for i, e in enumerate(probe["order"]) if e.startswith("runtime")]
    selected = [i for i, e in enumerate(probe["order"]) if e.startswith("setup_device")]
    assert runtime and selected, probe["order"]
    assert selected[0] < runtime[0], probe["order"]


@pytest.mark.parametrize("backend,cuda_inner", [(None, "nccl"), ("nccl", "nccl"),
                                                 ("gloo", "gloo")])
def test_runtime_has_a_cuda_backend_on_gpus(backend, cuda_inner):
    """Whatever ``process_group_backend`` a GPU run names, the runtime's group has an
    inner backend for CUDA tensors (DDP's gradients); CPU runs stay gloo-only."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from recovery.integrations.lightning import CheckpointlessStrategy
    from recovery.process_group.init_hook import inner_backends_for

    strategy = CheckpointlessStrategy(process_group_backend=backend,
                                      cluster_environment=LightningEnvironment(),
                                      parallel_devices=[torch.device("cuda", 0)])
    assert inner_backends_for(strategy._get_process_group_backend()) == {
        "cpu": "gloo", "cuda": cuda_inner}
    strategy.parallel_devices = [torch.device("cpu")]
    if backend != "nccl":
        assert inner_backends_for(strategy._get_process_group_backend()) == {"cpu": "gloo"}


def test_survivor_of_a_killed_peer_keeps_its_state_in_place(tmp_path):
    """Two workers under ``checkpointless run``; rank 1 is SIGKILLed in step 5's
    backward and a spare replaces it. Rank 0 recovers in-process without moving its
    model or optimizer state."""
    job = run_job(tmp_path / "run", nproc=2, spares=1, script=str(_worker(tmp_path)),
                  script_args=(), timeout_s=240,
                  overrides=["recovery.fault=1:5:backward", "replication.every_n_steps=2",
                             "recovery.heartbeat_timeout_s=10",
                             "recovery.heartbeat_interval_s=0.5"])
    assert_succeeded(job)
    assert job.events("recovery"), job.output()
    _assert_recovered_in_place(json.loads((job.run_dir / "probe_rank0.json").read_text()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (make test-gpu)")
@pytest.mark.parametrize("backend", [None, "gloo"])
def test_gpu_recovery_keeps_state_on_the_device(tmp_path, backend):
    """On a GPU: no move off the card during the recovery, the same parameter storage
    after it, the optimizer state back on the card, for NCCL and for gloo."""
    args = ["--accelerator", "gpu"] + (["--pg-backend", backend] if backend else [])
    probe = _run_alone(tmp_path, *args)
    _assert_recovered_in_place(probe)
    assert probe["resumed_devices"] == ["cuda:0"], probe
