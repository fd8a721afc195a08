"""Training process groups, one set per generation, and how old ones are let go.

Gloo cannot abort an operation, and destroying a gloo group joins its worker threads,
which blocks while an operation is still pending on a live but silent peer. So a
failed generation's groups are never destroyed on the training thread: we unregister
them and hand the last reference to a reaper thread, which drops it when it can. A
dropped group closes its sockets, which makes peers still blocked in that generation's
collectives fail at once; the failure cascades instead of waiting for timeouts.

With NCCL (``recovery.abort_backend=nccl``, untested on this CPU-only machine) the
communicator is aborted instead, which unblocks pending kernels directly.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from recovery.protocol import gen_prefix

_graveyard: list[Any] = []
_graveyard_lock = threading.Lock()


def init_training_group(
    store: dist.Store, gen: int, rank: int, world_size: int, timeout_s: float, backend: str
) -> None:
    """Create the default process group of generation ``gen``."""
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{gen_prefix(gen)}/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def abandon_training_group(abort_backend: str = "gloo") -> None:
    """Unregister the default group without blocking on in-flight gloo operations."""
    if not dist.is_initialized():
        return
    pg = dist.group.WORLD
    if abort_backend == "nccl":  # pragma: no cover - needs GPUs
        try:
            pg._get_backend(torch.device("cuda")).abort()  # type: ignore[union-attr]
        except Exception:
            pass
    keep(pg)
    if not _forget_default_group():
        # Unknown torch internals: fall back to the public call, off the training thread.
        threading.Thread(target=_destroy_quietly, daemon=True).start()
        deadline = time.monotonic() + 5.0
        while dist.is_initialized() and time.monotonic() < deadline:
            time.sleep(0.01)


def _destroy_quietly() -> None:
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def _forget_default_group() -> bool:
    """Drop torch's registration of every group *without* ``shutdown()``.

    ``destroy_process_group`` shuts each backend down, and a gloo shutdown waits for
    pending operations: exactly what a failed generation has. This mirrors its
    bookkeeping (torch 2.4-2.13 ``_world`` internals) minus the shutdown; the group
    objects themselves go to the reaper. Returns False if the internals differ.
    """
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)
    names = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
             "tags_to_pg", "pg_coalesce_state")
    if world is None or not all(hasattr(world, n) for n in names):
        return False
    if not hasattr(c10d, "_update_default_pg"):
        return False
    for pg in list(world.pg_map):
        keep(pg)
    c10d._update_default_pg(None)
    for n in names:
        getattr(world, n).clear()
    if hasattr(c10d, "_unregister_all_process_groups"):
        c10d._unregister_all_process_groups()
    world.group_count = 0
    return True


def keep(obj: Any) -> None:
    """Hold ``obj`` until a reaper thread can drop it without blocking training."""
    with _graveyard_lock:
        _graveyard.append(obj)
    threading.Thread(target=_reap, name="checkpointless-reaper", daemon=True).start()


def _reap() -> None:
    with _graveyard_lock:
        victims = list(_graveyard)
        _graveyard.clear()
    # A gloo destructor joins its worker threads and runs with the GIL held, so dropping
    # a group with a pending operation would freeze every Python thread. ``shutdown``
    # first stops the workers without waiting (it releases the GIL); the drop that
    # follows closes the sockets, which fails the peers' pending operations at once.
    for obj in victims:
        shutdown = getattr(obj, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:
                pass
    del victims
