"""A Lightning job with ``accumulate_grad_batches=2``, for ``tests/test_accumulate_frameworks.py``.

A small classifier (dropout, AdamW, a per-step ``StepLR``) on generated data under
``Trainer(strategy="checkpointless", accumulate_grad_batches=2)``: two batches per
optimizer step, DDP's gradient sync on the second only (Lightning's own
``block_backward_sync``). ``self.log`` on step and epoch goes to a ``CSVLogger``.

What the test compares with a failure-free run is written to ``final_rank<r>.json``:
the weights and optimizer digest, the data order, ``global_step``, the number of
optimizer steps a stateful callback counted (restored with Lightning's checkpoint, so
a rollback rolls it back), AdamW's own step count and the learning rate. The CSV rows
are read by the test.

Where a kill lands is recorded apart from the state: every rank appends one line per
event to ``trace_rank<r>.jsonl`` in the run directory (the process id, the event, the
batch index and ``global_step``), flushed at once, so the lines of a SIGKILLed process
are all there and a rollback never removes any. Events: ``start`` (a batch's
``on_train_batch_start``), ``forward`` (``training_step``), ``backward``
(``on_after_backward``) and ``optimizer`` (``on_before_optimizer_step``: both batches'
backward are done and the step is about to run).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import state_digest
from tests.lightning_scripts.demo_models import BatchOrder

ACCUMULATE = 2
CLASSES = 4


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, CLASSES, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Trace:
    """Append-only record of what this process ran, outside every registered state.

    Opened at the first event, under the rank the Trainer has then: a spare process
    learns its rank only when it takes a lost one's place."""

    def __init__(self, out: str) -> None:
        self._out = out
        self._f: Any = None

    def __call__(self, trainer: pl.Trainer, event: str, batch_idx: int) -> None:
        if self._f is None:
            path = os.path.join(self._out, f"trace_rank{trainer.global_rank}.jsonl")
            self._f = open(path, "a", buffering=1)  # noqa: SIM115 - the process's own
        self._f.write(json.dumps({"pid": os.getpid(), "event": event, "batch_idx": batch_idx,
                                  "global_step": trainer.global_step}) + "\n")
        self._f.flush()


class Classifier(pl.LightningModule):
    def __init__(self, trace: Trace | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(32, CLASSES))
        self._trace = trace
        self._batch_idx = -1

    def _record(self, event: str) -> None:
        if self._trace is not None:
            self._trace(self.trainer, event, self._batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._batch_idx = batch_idx
        self._record("forward")
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_seen", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss

    def on_after_backward(self) -> None:
        self._record("backward")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._record("optimizer")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Steps(pl.Callback):
    """Counts optimizer steps and the batch each one ended on (a stateful callback, so
    Lightning's checkpoint carries it and a rollback rolls it back)."""

    def __init__(self, trace: Trace) -> None:
        self.ended_on: list[int] = []
        self._trace = trace

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._trace(trainer, "start", batch_idx)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.ended_on.append(pl_module._batch_idx)

    def state_dict(self) -> dict[str, Any]:
        return {"ended_on": list(self.ended_on)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.ended_on = [int(b) for b in state_dict["ended_on"]]


def _adam_steps(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(s["step"]) for s in optimizer.state.values() if "step" in s]


def main() -> None:
    torch.set_num_threads(1)
    out = os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR") or "."
    trace = Trace(out)
    pl.seed_everything(0, verbose=False)
    model = Classifier(trace)
    order, steps = BatchOrder(), Steps(trace)
    trainer = pl.Trainer(
        strategy="checkpointless", accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        max_epochs=2, accumulate_grad_batches=ACCUMULATE, limit_val_batches=2,
        num_sanity_val_steps=0, log_every_n_steps=1,
        logger=CSVLogger(out, name="csv"), enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[order, steps],
    )
    train = DataLoader(dataset(192, 0), batch_size=4, shuffle=True)
    val = DataLoader(dataset(32, 1), batch_size=4)
    trainer.fit(model, train, val)
    opt = trainer.optimizers[0]
    with open(os.path.join(out, f"final_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"rank": trainer.global_rank, "step": trainer.global_step,
                   "digest": state_digest(model, opt),
                   "data_order": order.digest, "position": order.batches,
                   "optimizer_steps": len(steps.ended_on), "ended_on": steps.ended_on,
                   "adam_steps": sorted(set(_adam_steps(opt))),
                   "lr": opt.param_groups[0]["lr"]}, f)


if __name__ == "__main__":
    main()
