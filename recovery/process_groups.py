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

import atexit
import datetime
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from recovery.protocol import gen_prefix

_graveyard: list[tuple[float, Any]] = []
_reaper: threading.Thread | None = None
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


def abandon_training_group(abort_backend: str = "gloo", hold_s: float = 180.0) -> None:
    """Unregister the default group without blocking on in-flight gloo operations."""
    if not dist.is_initialized():
        return
    pg = dist.group.WORLD
    if abort_backend == "nccl":  # pragma: no cover - needs GPUs
        try:
            pg._get_backend(torch.device("cuda")).abort()  # type: ignore[union-attr]
        except Exception:
            pass
    keep(pg, hold_s)
    if not _forget_default_group(hold_s):
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


def _forget_default_group(hold_s: float) -> bool:
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
        keep(pg, hold_s)
    c10d._update_default_pg(None)
    for n in names:
        getattr(world, n).clear()
    if hasattr(c10d, "_unregister_all_process_groups"):
        c10d._unregister_all_process_groups()
    world.group_count = 0
    return True


def keep(obj: Any, hold_s: float = 180.0) -> None:
    """Hold ``obj`` until its pending operations must have timed out, then drop it.

    A gloo destructor joins its worker threads while holding the GIL, so dropping a
    group whose operation still waits on a silent peer would freeze every Python
    thread of the process until that operation's timeout. We wait out ``hold_s`` (at
    least the group's timeout) on a reaper thread instead, and drop it then.
    """
    global _reaper
    with _graveyard_lock:
        _graveyard.append((time.monotonic() + hold_s, obj))
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_loop, name="checkpointless-reaper",
                                       daemon=True)
            _reaper.start()


def holding() -> bool:
    """True while some abandoned group may still have an operation pending."""
    with _graveyard_lock:
        return bool(_graveyard)


def _reap_loop() -> None:
    while True:
        time.sleep(1.0)
        now = time.monotonic()
        with _graveyard_lock:
            due = [obj for t, obj in _graveyard if t <= now]
            _graveyard[:] = [(t, obj) for t, obj in _graveyard if t > now]
        for obj in due:
            shutdown = getattr(obj, "shutdown", None)
            if callable(shutdown):
                try:
                    shutdown()
                except Exception:
                    pass
        del due


_unhandled = False


def install_exit_guard() -> None:
    """Exit without running gloo destructors that could block on abandoned operations.

    At interpreter exit, groups still held from a failed generation would be destroyed
    and wait out their pending operations (up to the collective timeout). If any are
    held, the guard flushes output and ends the process at once, with status 1 after an
    unhandled exception and 0 otherwise (``sys.exit(n)`` codes after training are not
    seen here; see the README).
    """
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        global _unhandled
        _unhandled = True
        previous(*exc_info)

    sys.excepthook = hook
    atexit.register(_exit_now_if_holding)


def _exit_now_if_holding() -> None:
    if holding():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _unhandled else 0)
