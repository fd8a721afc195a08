"""A Lightning script that never imports checkpointless: is the strategy there anyway?"""

import sys

import lightning.pytorch as pl
from lightning.pytorch.strategies import StrategyRegistry

assert "checkpointless" not in sys.modules.get("__main__").__dict__
trainer = pl.Trainer(strategy="checkpointless", accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False)
print("registered", "checkpointless" in StrategyRegistry, type(trainer.strategy).__name__,
      flush=True)
