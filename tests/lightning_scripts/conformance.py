"""A Lightning job that uses what Lightning users observe, for the conformance suite.

A small classifier (with batch norm) on generated data under ``Trainer(strategy="checkpointless")``:
validation every 4 batches, ``self.log`` with mean and sum reductions on step and
epoch, torchmetrics ``Accuracy`` objects logged for training and validation,
``EarlyStopping`` and ``ModelCheckpoint(monitor="val_loss")``, a ``CSVLogger``,
gradient accumulation, SGD with momentum and a per-step ``StepLR`` plus an epoch-level
``ReduceLROnPlateau`` on ``val_loss``.

Everything a user could look at is written to ``final_rank<r>.json`` at the end: the
weights and optimizer digest, the data order, the callbacks' states, every value of
``trainer.callback_metrics`` a callback saw after each validation and each training
epoch, the final ``callback_metrics``, and the learning rate. The test compares that,
the CSV logger's rows and the checkpoints written with a failure-free run.

``--kill-in-validation R:S`` SIGKILLs rank R inside the validation that follows step S
(once per job: a marker file in the run directory).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from examples.gpt import state_digest
from tests.lightning_scripts.demo_models import BatchOrder

CLASSES = 4


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, CLASSES, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def _f(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else value


class Classifier(pl.LightningModule):
    def __init__(self, kill_in_validation: str = "", out: str = ".") -> None:
        super().__init__()
        self.save_hyperparameters()
        # batch norm: running statistics that follow each rank's own batches (DDP
        # broadcasts rank 0's at every forward), so ranks differ at a step's end
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                 nn.Dropout(0.1), nn.Linear(32, CLASSES))
        self.train_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train_seen", float(len(y)), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._maybe_die(batch_idx)
        x, y = batch
        logits = self.net(x)
        self.val_acc(logits, y)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)
        self.log("val_seen", float(len(y)), reduce_fx="sum", sync_dist=True)

    def _maybe_die(self, batch_idx: int) -> None:
        spec = self.hparams.kill_in_validation
        if not spec or batch_idx != 1:
            return
        rank, step = (int(v) for v in spec.split(":"))
        marker = os.path.join(self.hparams.out, "killed-in-validation")
        if self.global_rank == rank and self.global_step == step and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
        step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": step_lr, "interval": "step"}}


class Plateau(pl.Callback):
    """ReduceLROnPlateau on ``val_loss`` at each training epoch's end (what a user writes
    when the module already has a per-step scheduler); its state is a checkpointed one."""

    def __init__(self) -> None:
        self.plateau: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plateau is None:
            self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
                trainer.optimizers[0], patience=0, factor=0.5)
        else:
            self.plateau.optimizer = trainer.optimizers[0]
        if getattr(self, "_pending", None):
            self.plateau.load_state_dict(self._pending)
            self._pending = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.plateau.step(float(trainer.callback_metrics["val_loss"]))

    def state_dict(self) -> dict[str, Any]:
        if self.plateau is None:
            return {}
        return {k: v for k, v in self.plateau.state_dict().items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict) or None


class Seen(pl.Callback):
    """Every value of ``callback_metrics`` after each validation and each training epoch:
    what ``EarlyStopping``-like callbacks act on (stateful, so a restore rolls it back)."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []

    def _record(self, trainer: pl.Trainer, where: str) -> None:
        self.history.append({"where": where, "step": trainer.global_step,
                             **{k: _f(v) for k, v in sorted(trainer.callback_metrics.items())}})

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, "validation")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, "train_epoch")

    def state_dict(self) -> dict[str, Any]:
        return {"history": json.dumps(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = json.loads(state_dict["history"])


class RemoteRows(Logger):
    """A logger with no local directory, as W&B or MLflow look to Lightning: it sends
    each row away (here: appends it to a file the test reads) and can never read back
    what it sent."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._path = path

    @property
    def name(self) -> str:
        return "remote"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        row = {"step": step, **{k: round(float(v), 6) for k, v in sorted(metrics.items())}}
        with open(self._path, "a") as f:
            f.write(json.dumps(row) + "\n")


class Tally(pl.Callback):
    """A third-party callback's habit: its state in plain attributes and no
    ``state_dict`` (a batch count, a loss history, per-epoch sums). Lightning never sees
    it; after a recovery it must equal the failure-free run's all the same."""

    def __init__(self) -> None:
        self.batches = 0
        self.losses: list[float] = []
        self.per_epoch: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = float(outputs["loss"])
        self.batches += 1
        self.losses.append(round(loss, 6))
        self.per_epoch[trainer.current_epoch] = self.per_epoch.get(trainer.current_epoch,
                                                                   0.0) + loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--kill-in-validation", default="")
    ap.add_argument("--remote-only", action="store_true",
                    help="only the logger without a local directory (no CSVLogger)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR") or "."
    pl.seed_everything(0, verbose=False)
    model = Classifier(kill_in_validation=args.kill_in_validation, out=out)
    order, seen, tally = BatchOrder(), Seen(), Tally()
    early = EarlyStopping(monitor="val_loss", patience=1000)
    best = ModelCheckpoint(dirpath=os.path.join(out, "ckpts"), monitor="val_loss",
                           save_top_k=2, save_last=True,
                           filename="{epoch}-{step}-{val_loss:.4f}")
    trainer = pl.Trainer(
        strategy="checkpointless", accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        max_epochs=args.epochs, accumulate_grad_batches=2, val_check_interval=4,
        limit_val_batches=3, num_sanity_val_steps=0, log_every_n_steps=1,
        logger=[*([] if args.remote_only else [CSVLogger(out, name="csv")]),
                RemoteRows(os.path.join(out, "remote.jsonl"))],
        enable_progress_bar=False,
        enable_model_summary=False, callbacks=[order, seen, early, best, Plateau(), tally],
    )
    train = DataLoader(dataset(192, 0), batch_size=4, shuffle=True)
    val = DataLoader(dataset(48, 1), batch_size=4)
    trainer.fit(model, train, val)
    rank = trainer.global_rank
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({
            "rank": rank, "step": trainer.global_step,
            "digest": state_digest(model, trainer.optimizers[0]),
            "data_order": order.digest, "position": order.batches,
            "seen": seen.history,
            "tally": {"batches": tally.batches, "losses": tally.losses,
                      "per_epoch": {str(k): round(v, 5) for k, v in tally.per_epoch.items()}},
            "callback_metrics": {k: _f(v) for k, v in sorted(trainer.callback_metrics.items())},
            "early_stopping": {k: _f(v) for k, v in early.state_dict().items()},
            "model_checkpoint": {
                "best_model_path": os.path.basename(best.best_model_path),
                "best_model_score": _f(best.best_model_score),
                "best_k_models": sorted((os.path.basename(k), _f(v))
                                        for k, v in best.best_k_models.items()),
                "last_model_path": os.path.basename(best.last_model_path),
            },
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "log_version": trainer.logger.version if rank == 0 else None,
        }, f)


if __name__ == "__main__":
    main()
