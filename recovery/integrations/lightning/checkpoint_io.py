"""Lightning checkpoints through the durable tier: asynchronous, per rank, DCP, any fsspec URL.

``ModelCheckpoint`` and ``trainer.save_checkpoint(path)`` hand Lightning's checkpoint
dictionary to :class:`CheckpointlessCheckpointIO`. The save copies it into a host buffer
(the only part training waits for) and a background writer persists it with the durable
tier (``replication.durable``): ``path`` becomes a durable root holding one step,
``<path>/step_<global_step>/rank_<r>/`` (standard DCP) and a ``MANIFEST.json`` written
last. Under the checkpointless strategy every rank writes its own part (so per-rank RNG
streams and data positions come back exactly); under another strategy only rank 0 saves
and the checkpoint is a one-rank checkpoint.

Loading accepts such a path, a durable root (its newest valid checkpoint: also the
``persistence.path`` the runtime persists committed snapshots to), a ``step_<N>``
directory, or :data:`LATEST`. Hyper-parameters are saved when the pickle-free codec can
hold them, and left out with a warning otherwise (they are not needed to resume).
"""

from __future__ import annotations

import logging
import posixpath
import threading
import time
from collections import deque
from typing import Any

import fsspec
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from recovery.integrations.lightning.state import (
    ENTRY_NAMES,
    HPARAM_KEYS,
    LightningState,
    split_checkpoint,
    to_plain_lightning,
)
from replication.config import PersistenceConfig
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.codec import CodecError, encode
from replication.training_state.state import TrainingState

log = logging.getLogger("checkpointless.lightning")

#: ``ckpt_path`` of the in-memory state the strategy restored (internal).
MEMORY = "checkpointless://memory"
#: ``ckpt_path`` meaning the newest durable checkpoint (under ``persistence.path``, or the
#: ``ModelCheckpoint`` directories).
LATEST = "checkpointless://latest"


class _Fixed:
    """A constant state dict as a registry entry (what a save captures)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover
        self._state = state_dict


def _encodable(value: Any) -> bool:
    try:
        encode(value, lambda t, path: 0)
        return True
    except CodecError:
        return False


class CheckpointlessCheckpointIO(CheckpointIO):
    """Async, per-rank durable checkpoints for Lightning (see the module docstring)."""

    def __init__(
        self,
        storage_options: dict | None = None,
        *,
        max_pending: int = 2,
        rng: bool = True,
    ) -> None:
        """``max_pending`` bounds the saves in flight per rank (each holds a host copy of
        the state): a further save waits for the oldest, it is never dropped. ``rng``
        adds this rank's RNG streams, which Lightning does not save."""
        self.storage_options = dict(storage_options or {})
        self.max_pending = max(1, max_pending)
        self.rng = rng
        self.rank, self.world_size = 0, 1
        self.under_strategy = False  # set_world is only called by the strategy
        self.run_id: str | None = None
        self.flush_on_teardown = True
        self._pending: deque[tuple[str, Any, threading.Thread]] = deque()
        self._lock = threading.Lock()
        self._warned_hparams = False

    def set_world(self, rank: int, world_size: int, run_id: str | None = None) -> None:
        """Every rank of ``world_size`` saves its own part (set by the strategy)."""
        self.rank, self.world_size, self.run_id = rank, world_size, run_id
        self.under_strategy = True

    # -- save ---------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        from replication.durable import DurableWriter

        url = str(path)
        opts = {**self.storage_options, **(storage_options or {})}
        registry = self._registry(checkpoint)
        step = int(checkpoint.get("global_step", 0))
        engine = SnapshotEngine(registry, pin_memory=False, checksum="inline")
        slot = engine.capture(step)  # the copy training waits for; the rest is background
        meta = engine.seal(slot)
        self._make_room()
        cfg = PersistenceConfig(path=url, every_n_steps=1, keep_last=1, storage_options=opts)
        # keep_last=1 with pruning: a path saved again (``last.ckpt``, a fixed filename)
        # keeps only its newest complete step, as a file would be overwritten.
        writer = DurableWriter(cfg, self.rank, self.world_size, run_id=self.run_id,
                               isolation="thread", staging=False, prune=True)
        ticket = writer.submit(meta, slot.buffer)

        def finish() -> None:
            try:
                result = ticket.result()
                if result.status not in ("ok", "exists"):
                    log.error("checkpoint %s (step %d) on rank %d: %s %s", url, step,
                              self.rank, result.status, result.error or "")
            finally:
                writer.close()

        closer = threading.Thread(target=finish, daemon=True, name="checkpointless-ckpt-io")
        closer.start()
        with self._lock:
            self._pending.append((url, ticket, closer))

    def _registry(self, checkpoint: dict[str, Any]) -> TrainingState:
        parts = split_checkpoint(checkpoint)
        hparams = {k: v for k, v in checkpoint.items() if k in HPARAM_KEYS}
        if hparams:
            if _encodable(hparams):
                parts["trainer"]["__hparams__"] = hparams
            elif not self._warned_hparams:
                log.warning("hyper-parameters of this checkpoint hold values the pickle-free "
                            "snapshot codec refuses; they are left out (not needed to resume)")
                self._warned_hparams = True
        registry = TrainingState(rng=self.rng)
        for name in ENTRY_NAMES:
            registry.register(name, _Fixed(parts[name]))
        if self.rng:
            registry = _with_save_marker(registry)
        return registry

    def _make_room(self) -> None:
        while True:
            with self._lock:
                while self._pending and not self._pending[0][2].is_alive():
                    self._pending.popleft()
                if len(self._pending) < self.max_pending:
                    return
                oldest = self._pending[0][2]
            oldest.join()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for every save in flight; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            threads = [t for _, _, t in self._pending]
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._pending = deque(p for p in self._pending if p[2].is_alive())
            return not self._pending

    # -- load ---------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        url = str(path)
        if url in (LATEST, MEMORY):
            raise ValueError(
                f"ckpt_path={url!r} needs Trainer(strategy='checkpointless'); with another "
                "strategy pass a checkpoint path (`checkpointless ckpt latest DIR` prints "
                "the newest one)")
        checkpoint, _ = load_durable(url, self.rank, self.world_size, self.storage_options)
        if not self.under_strategy:  # plain Lightning: no wrapped loaders, no deferred RNG
            return to_plain_lightning(checkpoint)
        return checkpoint

    # -- remove -------------------------------------------------------------------------
    def remove_checkpoint(self, path: Any, wait_s: float = 60.0) -> None:
        """Delete a checkpoint written by this IO, once every rank has finished it."""
        from replication.durable import latest_checkpoint

        url = str(path)
        with self._lock:
            mine = [t for u, _, t in self._pending if u == url]
        for t in mine:
            t.join()
        deadline = time.monotonic() + wait_s
        while (self.world_size > 1 and latest_checkpoint(url, self.storage_options) is None
               and time.monotonic() < deadline):
            time.sleep(0.2)  # other ranks may still be writing their parts
        fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        if fs.exists(root):
            fs.rm(root, recursive=True)

    def teardown(self) -> None:
        if self.flush_on_teardown:
            self.flush()


def _with_save_marker(registry: TrainingState) -> TrainingState:
    """Tag the RNG entry as captured at save time (restored at load, not deferred)."""
    out = TrainingState(rng=False)
    for name, obj in registry:
        out.register(name, _SaveRNG(obj) if name == "rng" else obj)
    return out


class _SaveRNG:
    def __init__(self, rng: Any) -> None:
        self._rng = rng

    def state_dict(self) -> dict[str, Any]:
        return {"at": "save", **self._rng.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover
        self._rng.load_state_dict(state_dict)


def is_durable(url: str, storage_options: dict | None = None) -> bool:
    """Whether ``url`` is a durable checkpoint, a ``step_<N>`` directory or a root of them."""
    from replication.durable import latest_checkpoint
    from replication.durable.format import parse_step

    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if not fs.isdir(root):
            return False
    except (OSError, ValueError):
        return False
    if parse_step(posixpath.basename(root.rstrip("/"))) is not None:
        return fs.exists(posixpath.join(root, "MANIFEST.json"))
    return latest_checkpoint(url, storage_options) is not None


def load_durable(
    url: str, rank: int, world_size: int, storage_options: dict | None = None,
) -> tuple[dict[str, Any], LightningState]:
    """A Lightning checkpoint dictionary from a durable checkpoint, verified.

    Returns the dictionary and the :class:`LightningState` it was read into (its
    ``rng.pending`` holds this rank's RNG streams, if the checkpoint has them and was
    written at this world size).
    """
    from replication.durable import load, open_checkpoint

    info = open_checkpoint(url, storage_options)
    state = LightningState()
    same_world = info.world_size == world_size
    registry = state.registry
    names = set(info.manifest.ranks[0].segments) if info.manifest else set()
    if "rng" not in names or not same_world:
        registry = TrainingState(rng=False)  # another world size: no per-rank streams
        for name, obj in state.registry:
            if name != "rng":
                registry.register(name, obj)
    if same_world:
        load(info, registry, rank=rank, storage_options=storage_options)
    else:
        log.warning("%s was written by %d rank(s), this job has %d: every rank loads rank 0's "
                    "copy; RNG streams and data positions are rank 0's", url, info.world_size,
                    world_size)
        load(info, registry, rank=rank, world_size=world_size, source_rank=0,
             storage_options=storage_options)
    checkpoint = state.take_checkpoint()
    hparams = checkpoint.pop("__hparams__", None)
    if isinstance(hparams, dict):
        checkpoint.update(hparams)
    if state.rng.pending is not None:
        checkpoint.setdefault("__checkpointless_rng__", True)
    return checkpoint, state


def newest_durable(urls: list[str], storage_options: dict | None = None) -> str | None:
    """The newest valid checkpoint (by manifest time) among durable roots and their
    immediate subdirectories (``ModelCheckpoint`` directories hold one root per file)."""
    from replication.durable import newest_checkpoint

    info = newest_checkpoint(urls, storage_options)
    return info.url if info is not None else None


__all__ = ["LATEST", "MEMORY", "CheckpointlessCheckpointIO", "is_durable", "load_durable",
           "newest_durable"]
