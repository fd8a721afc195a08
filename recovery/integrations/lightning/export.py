"""A durable Lightning checkpoint as one ``.ckpt`` file that plain Lightning loads.

Under the strategy, a ``ModelCheckpoint`` file is a durable root (a directory of DCP
files, one part per rank, see :mod:`.checkpoint_io`), which plain Lightning cannot open
(``IsADirectoryError``). :func:`export_lightning` reads one rank's part, verified, and
writes the Lightning checkpoint dictionary with ``torch.save``, atomically (a temporary
file renamed into place): ``Model.load_from_checkpoint(dest)`` and
``Trainer(...).fit(model, ckpt_path=dest)`` then work without checkpointless.
``checkpointless ckpt export --lightning SRC DEST`` is the command-line form.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from recovery.integrations.lightning.checkpoint_io import load_durable
from recovery.integrations.lightning.state import to_plain_lightning


def export_lightning(info: Any, dest: str, rank: int = 0,
                     storage_options: dict | None = None) -> dict[str, Any]:
    """Write ``info`` (a complete durable checkpoint) as a plain Lightning ``.ckpt`` file.

    Returns ``{"global_step": ..., "bytes": ...}``. ``rank`` picks whose part: the
    weights and optimizer state are the same on every rank of a data-parallel job, the
    loop counters too; rank 0's is the usual choice.
    """
    world = info.world_size or 1
    if not 0 <= rank < world:
        raise ValueError(
            f"--rank {rank}: {info.url} was written by {world} rank(s) (0..{world - 1})")
    checkpoint, _ = load_durable(info.url, rank, world, storage_options)
    plain = to_plain_lightning(checkpoint)
    folder = os.path.dirname(os.path.abspath(dest))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{dest}.tmp{os.getpid()}"
    try:
        torch.save(plain, tmp)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"global_step": int(plain.get("global_step", 0)), "bytes": os.path.getsize(dest)}
