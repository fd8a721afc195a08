"""The Lightning integration: ``Trainer(strategy="checkpointless")``.

Importing this package registers the strategy with Lightning's registry. Under
``checkpointless run`` nothing needs importing: the worker bootstrap registers it as soon
as the script imports Lightning (:mod:`.autoload`). See ``docs/integrations.md``.
"""

from recovery.integrations.lightning.checkpoint_io import (
    LATEST,
    CheckpointlessCheckpointIO,
    load_durable,
)
from recovery.integrations.lightning.registration import register
from recovery.integrations.lightning.strategy import CheckpointlessStrategy

register()

__all__ = ["LATEST", "CheckpointlessCheckpointIO", "CheckpointlessStrategy", "load_durable",
           "register"]
