"""Train a small GPT with Lightning, surviving rank and node failures in-process.

    checkpointless run --nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-endpoint H:29500 \
        --recipe examples/recipes/lightning_gpt.yaml examples/lightning_gpt.py

The only checkpointless line is ``Trainer(strategy="checkpointless")``: under
``checkpointless run`` the strategy is registered as soon as Lightning is imported, and
the script needs no other change (run directly, it imports the integration itself and
trains as a single process). Every rank writes ``final_rank<r>.json`` at the end (a
digest of model and optimizer state, the step, and a hash of the data order), so a run
with failures can be compared with one without. ``--strategy ddp`` runs the same job
with Lightning's own DDP (the benchmark's torchrun baseline).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

try:  # run as `-m examples.lightning_gpt`
    from examples.gpt import TinyGPT, Windows, loss_fn, lr_lambda, state_digest
except ImportError:  # run as a script path: examples/ is sys.path[0]
    from gpt import TinyGPT, Windows, loss_fn, lr_lambda, state_digest

LAUNCHED = "CHECKPOINTLESS_INTERNAL_STORE" in os.environ
if not LAUNCHED:  # under `checkpointless run` the worker bootstrap has registered it
    import recovery.integrations.lightning  # noqa: F401




class GPT(L.LightningModule):
    def __init__(self, vocab: int, dim: int, layers: int, seq_len: int, lr: float,
                 total_steps: int, kill_in_validation: str = "", out: str = "",
                 step_sleep: float = 0.0, progress: str = "",
                 kill_after_restore: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(vocab, dim, layers, seq_len=seq_len)
        self.order_hash = "0" * 64  # every batch this rank trained on, in order
        self.restored = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        if self.restored:  # the first step after a restore (a recovery, or ckpt_path)
            self.restored = False
            self._maybe_die_after_restore()
        self.order_hash = hashlib.sha256(
            self.order_hash.encode() + x.numpy().tobytes()).hexdigest()
        loss = loss_fn(self.model(x), y)
        if self.hparams.step_sleep:
            time.sleep(self.hparams.step_sleep)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.hparams.progress:  # when each rank finished each step (benchmarks)
            with open(self.hparams.progress, "a") as f:
                f.write(json.dumps({"rank": self.global_rank, "step": self.global_step,
                                    "ts": time.time()}) + "\n")
        if os.environ.get("LIGHTNING_GPT_TRACE"):  # per-step state digests (debugging)
            with open(os.path.join(self.hparams.out, f"trace_rank{self.global_rank}.jsonl"),
                      "a") as f:
                f.write(json.dumps({"step": self.global_step, "loss": float(outputs["loss"]),
                                    "digest": state_digest(self.model,
                                                           self.trainer.optimizers[0])}) + "\n")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self._maybe_die_in_validation(batch_idx)
        x, y = batch
        self.log("val_loss", loss_fn(self.model(x), y), sync_dist=True)

    def _maybe_die_in_validation(self, batch_idx: int) -> None:
        """``--kill-in-validation RANK:STEP``: SIGKILL this rank once, mid-validation."""
        spec = self.hparams.kill_in_validation
        if not spec or self.trainer.sanity_checking or batch_idx != 0:
            return
        rank, step = (int(v) for v in spec.split(":"))
        if self.global_rank != rank or self.global_step != step:
            return
        try:  # once per job: the replayed validation must not die again
            os.close(os.open(os.path.join(self.hparams.out, "killed-in-validation"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    def _maybe_die_after_restore(self) -> None:
        """``--kill-after-restore RANK``: SIGKILL this rank in the first step after the
        first recovery, once (a failure while the job is still recovering its pace)."""
        if self.global_rank != self.hparams.kill_after_restore:
            return
        try:
            os.close(os.open(os.path.join(self.hparams.out, "killed-after-restore"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(max(1, self.hparams.total_steps // 5), self.hparams.total_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["order_hash"] = self.order_hash

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.order_hash = checkpoint["order_hash"]
        self.restored = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=96, help="training samples (all ranks)")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-every", type=int, default=4,
                    help="validate every N batches (0: no validation)")
    ap.add_argument("--strategy", default="checkpointless")
    ap.add_argument("--recipe", default="", help="recipe for a direct (unlaunched) run")
    ap.add_argument("--ckpt-dir", default="", help="ModelCheckpoint dirpath (any fsspec URL)")
    ap.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every N steps")
    ap.add_argument("--resume", default="", help="fit(ckpt_path=...)")
    ap.add_argument("--kill-in-validation", default="", help="RANK:STEP (tests)")
    ap.add_argument("--kill-after-restore", type=int, default=-1, metavar="RANK",
                    help="SIGKILL RANK in the first step after a recovery (tests)")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--progress", default="", help="append per-step JSON lines here")
    ap.add_argument("--die-at", type=int, default=-1,
                    help="rank 1 SIGKILLs the whole job after this step (torchrun baseline)")
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = args.out or os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR") or "."
    os.makedirs(out, exist_ok=True)

    L.seed_everything(args.seed, verbose=False)
    train = Windows(args.samples, args.seq_len, args.seed)
    val = Windows(16, args.seq_len, args.seed + 1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    per_rank = -(-args.samples // world) // args.batch
    model = GPT(train.vocab_size, args.dim, args.layers, args.seq_len, 3e-3,
                args.epochs * per_rank, args.kill_in_validation, out, args.step_sleep,
                args.progress, args.kill_after_restore)

    strategy = args.strategy
    if strategy == "checkpointless" and args.recipe and not LAUNCHED:
        from recovery.integrations.lightning import CheckpointlessStrategy

        strategy = CheckpointlessStrategy(recipe=args.recipe)
    callbacks = []
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=-1,
                                         every_n_train_steps=args.ckpt_every or None))
    if args.die_at >= 0:
        callbacks.append(_DieAt(args.die_at))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        max_epochs=args.epochs, val_check_interval=args.val_every or 1.0,
        limit_val_batches=2 if args.val_every else 0,
        num_sanity_val_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=bool(args.ckpt_dir),
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True),
                DataLoader(val, batch_size=args.batch), ckpt_path=args.resume or None)

    rank = trainer.global_rank
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": trainer.global_step, "epoch": trainer.current_epoch,
                   "digest": state_digest(model.model, trainer.optimizers[0]),
                   "data_order": model.order_hash, "position": trainer.global_step}, f)


class _DieAt(L.Callback):
    """The torchrun baseline's failure: rank 1 kills the whole job after step N, once."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        marker = os.path.join(pl_module.hparams.out, "died")
        if trainer.global_rank == 1 and trainer.global_step == self.step \
                and not os.path.exists(marker):
            open(marker, "w").close()
            if pl_module.hparams.progress:
                with open(pl_module.hparams.progress, "a") as f:
                    f.write(json.dumps({"event": "kill", "step": self.step,
                                        "ts": time.time()}) + "\n")
            os.killpg(os.getpgid(0), signal.SIGKILL)


if __name__ == "__main__":
    main()
