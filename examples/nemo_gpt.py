"""A small GPT as a NeMo ``ModelPT``, trained through NeMo's Hydra + ``exp_manager`` flow.

    checkpointless run --nnodes 2 --nproc-per-node 2 ... --recipe examples/nemo_gpt.yaml \
        examples/nemo_gpt.py [hydra overrides, e.g. trainer.max_epochs=3]

Nothing here is checkpointless-specific: the strategy (and any plugins or callbacks)
come from ``trainer:`` in ``examples/nemo_gpt.yaml`` as ``_target_`` entries, the
``checkpointless:`` block nested in that YAML configures the runtime, and the script
is the usual NeMo shape: ``hydra_runner`` -> Trainer -> ``exp_manager`` -> model ->
``fit``. Each rank writes ``final_rank<r>.json`` (model+optimizer digest, step, data
order) so a run with failures can be compared with one without.

Needs the NeMo environment (``make setup-nemo``): nemo_toolkit 3.x pins lightning 2.4.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal

import hydra
import torch
from lightning.pytorch import Trainer
from nemo.core import ModelPT
from nemo.core.config import hydra_runner
from nemo.utils.exp_manager import exp_manager
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

try:  # run as `-m examples.nemo_gpt`
    from examples.gpt import TinyGPT, Windows, loss_fn, lr_lambda, state_digest
except ImportError:  # run as a script path: examples/ is sys.path[0]
    from gpt import TinyGPT, Windows, loss_fn, lr_lambda, state_digest

if "CHECKPOINTLESS_INTERNAL_STORE" not in os.environ:  # the launcher registers it itself
    import recovery.integrations.lightning  # noqa: F401




class NemoGPT(ModelPT):
    """The ModelPT contract: data set-up from ``cfg.train_ds``/``validation_ds``, and the
    Lightning steps. The optimizer comes from ``configure_optimizers`` (plain AdamW and a
    per-step LambdaLR, as in examples/lightning_gpt.py)."""

    def __init__(self, cfg: DictConfig, trainer: Trainer | None = None) -> None:
        self.world = trainer.world_size if trainer is not None else 1
        super().__init__(cfg=cfg, trainer=trainer)
        vocab = Windows(1, cfg.seq_len, cfg.seed).vocab_size
        self.model = TinyGPT(vocab, cfg.dim, cfg.layers, seq_len=cfg.seq_len)
        self.order_hash = "0" * 64

    # -- ModelPT ---------------------------------------------------------------------
    def setup_training_data(self, cfg: DictConfig) -> None:
        self._train_dl = DataLoader(Windows(cfg.samples, self.cfg.seq_len, self.cfg.seed),
                                    batch_size=cfg.batch_size, shuffle=True)

    def setup_validation_data(self, cfg: DictConfig) -> None:
        self._validation_dl = DataLoader(
            Windows(cfg.samples, self.cfg.seq_len, self.cfg.seed + 1), batch_size=cfg.batch_size)

    @classmethod
    def list_available_models(cls) -> list:
        return []

    # -- Lightning -------------------------------------------------------------------
    def training_step(self, batch, batch_idx):
        x, y = batch
        self.order_hash = hashlib.sha256(self.order_hash.encode() + x.numpy().tobytes()).hexdigest()
        return loss_fn(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        self._maybe_die_in_validation(batch_idx)
        x, y = batch
        loss = loss_fn(self.model(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        total = self._trainer.max_steps if self._trainer.max_steps > 0 else (
            self._trainer.max_epochs * len(self._train_dl) // self.world)
        opt = torch.optim.AdamW(self.parameters(), lr=self.cfg.optim.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, total // 5), total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["order_hash"] = self.order_hash

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.order_hash = checkpoint["order_hash"]

    def _maybe_die_in_validation(self, batch_idx: int) -> None:
        """``model.kill_in_validation=RANK:STEP``: SIGKILL that rank once, mid-validation."""
        spec = str(self.cfg.get("kill_in_validation") or "")
        if not spec or self._trainer.sanity_checking or batch_idx != 0:
            return
        rank, step = (int(v) for v in spec.split(":"))
        if self.global_rank != rank or self.global_step != step:
            return
        marker = os.path.join(os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR", "."),
                              "killed-in-validation")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


@hydra_runner(config_path=".", config_name="nemo_gpt")
def main(cfg: DictConfig) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(cfg.model.seed)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_cfg["devices"] = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer_cfg["num_nodes"] = int(os.environ.get("GROUP_WORLD_SIZE", 1))
    trainer: Trainer = hydra.utils.instantiate(trainer_cfg)
    exp_manager(trainer, cfg.get("exp_manager"))
    model = NemoGPT(cfg.model, trainer=trainer)
    trainer.fit(model)

    out = os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR") or cfg.get("out") or "."
    rank = trainer.global_rank
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": trainer.global_step,
                   "digest": state_digest(model.model, trainer.optimizers[0]),
                   "data_order": model.order_hash, "position": trainer.global_step}, f)


if __name__ == "__main__":
    main()
