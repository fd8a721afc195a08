"""Lightning's own demo models, imported unchanged from the ``lightning`` package, trained
with ``Trainer(strategy="checkpointless")`` under ``checkpointless run``.

- ``--model boring``: ``lightning.pytorch.demos.boring_classes.BoringModel`` (its own
  random datasets, built with the global RNG when Lightning asks for a loader);
- ``--model transformer``: ``lightning.pytorch.demos.LightningTransformer`` on
  ``WikiText2``. The package downloads ``./data/wikitext-2.txt`` unless it exists; no
  network here, so this script writes a generated text there first (in the run
  directory) and the class reads it exactly as it would the real one.

What this script adds is only what a test needs to observe the run: a callback that
hashes every training batch in order (its ``state_dict`` travels in Lightning's
checkpoint, as any stateful callback's does), and ``final_rank<r>.json`` with the
weights+optimizer digest at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos import LightningTransformer, WikiText2
from lightning.pytorch.demos.boring_classes import BoringModel

from examples.gpt import state_digest


class BatchOrder(pl.Callback):
    """SHA-256 chain over every training batch this rank ran, in order."""

    def __init__(self) -> None:
        self.digest = "0" * 64
        self.batches = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        tensors = batch if isinstance(batch, (list, tuple)) else [batch]
        h = hashlib.sha256(self.digest.encode())
        for t in tensors:
            h.update(t.detach().contiguous().numpy().tobytes())
        self.digest, self.batches = h.hexdigest(), self.batches + 1

    def state_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.digest, self.batches = state_dict["digest"], int(state_dict["batches"])


def write_corpus(path: str, words: int = 3000, seed: int = 0) -> None:
    """A small generated text in WikiText2's file format (lines of words)."""
    if os.path.exists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(200)]
    lines = [" ".join(rng.choice(vocab) for _ in range(rng.randint(5, 20)))
             for _ in range(words // 12)]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)  # every rank may write it: the last rename wins, same bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["boring", "transformer"], default="boring")
    ap.add_argument("--max-steps", type=int, default=12)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = args.out or os.environ.get("CHECKPOINTLESS_INTERNAL_RUN_DIR") or "."
    os.makedirs(out, exist_ok=True)
    os.chdir(out)  # the demos read and write ./data
    pl.seed_everything(0, verbose=False)
    if args.model == "boring":
        model: pl.LightningModule = BoringModel()
    else:
        write_corpus(os.path.join("data", "wikitext-2.txt"))
        model = LightningTransformer(vocab_size=WikiText2(download=False).vocab_size)
    order = BatchOrder()
    trainer = pl.Trainer(
        strategy="checkpointless", accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)),
        max_steps=args.max_steps, limit_val_batches=2, val_check_interval=4,
        num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, callbacks=[order],
    )
    trainer.fit(model)
    rank = trainer.global_rank
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": trainer.global_step,
                   "digest": state_digest(model, trainer.optimizers[0]),
                   "data_order": order.digest, "position": order.batches}, f)


if __name__ == "__main__":
    main()
