"""Routes ``torch.distributed.init_process_group`` to the runtime's owned group.

Scripts written for ``torchrun`` call ``init_process_group`` (and ``new_group``) with
a backend of their choosing; under ``checkpointless run`` those calls must build an
:class:`~recovery.process_group.owned_group.ElasticProcessGroup` instead, or the group would not
survive a recovery. This module holds those hooks, installed only in workers the
launcher starts (:func:`install_init_hook`), and the translation of a backend name into
the inner backends per device (:func:`inner_backends_for`).
"""

from __future__ import annotations

import datetime
import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from recovery.process_group import device_placement
from recovery.process_group.controller import controller, register_backend
from recovery.process_group.owned_group import BACKEND_NAME, ElasticProcessGroup, is_owned

_INNER_DEFAULT = {"cpu": "gloo", "cuda": "nccl"}


def inner_backends_for(backend: str | None) -> dict[str, str]:
    """``init_process_group``'s backend argument as device -> inner backend."""
    if backend is None or backend in ("", BACKEND_NAME, "undefined"):
        kinds = dict(_INNER_DEFAULT)
        if not torch.cuda.is_available():
            kinds.pop("cuda")
        return kinds
    text = str(backend).lower()
    if ":" in text:
        pairs = dict(part.split(":", 1) for part in text.split(","))
        return {dev.strip(): kind.strip() for dev, kind in pairs.items()}
    if text == "nccl":
        return {"cpu": "gloo", "cuda": "nccl"}
    if text == "gloo":  # torch's gloo group takes CUDA tensors too (copied through host)
        return {"cpu": "gloo", "cuda": "gloo"} if torch.cuda.is_available() else {"cpu": "gloo"}
    raise ValueError(f"checkpointless: backend {backend!r} is not supported "
                     "(gloo, nccl or cpu:gloo,cuda:nccl)")


_original_init: Callable[..., Any] | None = None


def install_init_hook(environ: dict[str, str] | None = None) -> None:
    """Route ``torch.distributed.init_process_group`` to the owned group.

    Installed only in workers started by ``checkpointless run``. The script's backend
    name picks the inner backends; its ``init_method``/``store`` are not used (the job
    store is), and a ``rank``/``world_size`` that disagrees with the launcher is refused.
    """
    global _original_init
    register_backend()
    if _original_init is not None:
        return
    _original_init = dist.init_process_group
    original = _original_init

    @functools.wraps(original)
    def init_process_group(backend: str | None = None, init_method: str | None = None,
                           timeout: datetime.timedelta | None = None,
                           world_size: int = -1, rank: int = -1, store: Any = None,
                           **kwargs: Any) -> None:
        env = dict(os.environ if environ is None else environ)
        want_rank, want_world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        if (rank not in (-1, want_rank)) or (world_size not in (-1, want_world)):
            raise ValueError(
                f"checkpointless: init_process_group(rank={rank}, world_size={world_size}) "
                f"disagrees with the launcher (rank {want_rank} of {want_world}); "
                "leave rank and world_size out under `checkpointless run`")
        join_default_group(want_rank, want_world, inner_backends_for(backend),
                           timeout.total_seconds() if timeout else None, env, **kwargs)

    _rebind(original, init_process_group)
    _install_new_group_hook()
    _install_module_sync_hook()


def _rebind(original: Callable[..., Any], hook: Callable[..., Any]) -> None:
    """Put ``hook`` in place of ``original`` wherever torch's own modules hold it.

    ``torch.distributed.device_mesh`` imported ``init_process_group`` and ``new_group``
    by name: ``init_device_mesh`` called before any ``init_process_group`` (as the
    tensor-parallel tutorials write it) creates the default group through its own
    binding, which a hook on ``torch.distributed`` alone never sees; the job then
    stopped at ``Checkpointless(...)`` with "the default process group was not made
    by checkpointless", under ``checkpointless run``. Modules of torch imported later
    than this call are not rebound; every one that binds these names is imported by
    ``torch.distributed`` itself."""
    name = original.__name__
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "torch.distributed"
                                  or module_name.startswith("torch.distributed.")):
            continue
        if getattr(module, name, None) is original:
            setattr(module, name, hook)


def _install_new_group_hook() -> None:
    """``new_group(backend="gloo")`` (Lightning's ``prepare_data`` barrier, libraries
    that want a CPU side group) makes an owned group too, once the default one is.

    A plain gloo group would rendezvous through the default group's store, which is
    this process's alone, and hang; it would also outlive a failure unaborted.
    """
    original = dist.distributed_c10d.new_group
    signature = inspect.signature(original)
    if "backend" not in signature.parameters:  # pragma: no cover - another torch
        return

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind_partial(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is not None and str(backend).lower() != BACKEND_NAME and \
                dist.is_initialized() and is_owned(dist.distributed_c10d._get_default_group()):
            bound.arguments["backend"] = None  # inherit the default: checkpointless
            bound.arguments.pop("pg_options", None)
        return original(*bound.args, **bound.kwargs)

    _rebind(original, new_group)


def _install_module_sync_hook() -> None:
    """Skip the weight broadcast of DDP's constructor where it cannot change anything.

    DDP's constructor (and FSDP's ``sync_module_states``) calls
    ``torch.distributed.utils._sync_params_and_buffers``, which copies every parameter
    and buffer into flat buckets, broadcasts them, and copies them back. In a replacement
    that has not joined a generation yet the broadcast completes locally (see
    :mod:`recovery.process_group.owned_group`), so the whole call leaves every value as it was; yet
    it cost 0.07 s for a 67 MB model on the test host (a fresh bucket faulted in, two
    copies), on the recovery's critical path: the survivors wait for the replacement to
    reach its rendezvous. There it is skipped (and counted as a local collective); on
    any other group, or once joined, it runs unchanged.
    """
    import torch.distributed.utils as dist_utils

    original = getattr(dist_utils, "_sync_params_and_buffers", None)
    if original is None or getattr(original, "checkpointless_hook", False):
        return  # pragma: no cover - another torch, or installed already

    @functools.wraps(original)
    def sync_params_and_buffers(process_group: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(process_group, ElasticProcessGroup) and process_group.completes_locally():
            controller().local_collectives += 1
            return None
        return original(process_group, *args, **kwargs)

    sync_params_and_buffers.checkpointless_hook = True  # type: ignore[attr-defined]
    dist_utils._sync_params_and_buffers = sync_params_and_buffers


def join_default_group(rank: int, world_size: int, inner: dict[str, str],
                       timeout_s: float | None, env: dict[str, str] | None = None,
                       **kwargs: Any) -> None:
    """Create the default (WORLD) group as an :class:`ElasticProcessGroup`.

    Under the launcher it binds to generation 0 at once when this process starts the
    job; a replacement (or a process that finds a later generation) stays unbound until
    the runtime joins it to the current generation.
    """
    from recovery.common.env import WorkerEnv
    from recovery.generation import protocol
    from recovery.recipe import worker_config

    register_backend()
    wenv = WorkerEnv.from_environ(env)
    # Scripts build and move their model after this call: the rank's GPU is chosen here
    # (the ``device_id`` the script names, else LOCAL_RANK's), not at the runtime's start.
    device_id = kwargs.get("device_id")
    if isinstance(device_id, torch.device) and device_id.type == "cuda":
        torch.cuda.set_device(device_id)
    else:
        device_placement.place(wenv.local_rank)
    settings = worker_config(wenv.config_json)
    ctl = controller()
    ctl.ordered_allreduce = settings.recovery.ordered_allreduce
    ctl.nccl_fixed_algorithm = settings.recovery.nccl_fixed_algorithm
    if ctl.store is None:
        ctl.configure(wenv.connect_store(), timeout_s or settings.recovery.collective_timeout_s,
                      inner)
    else:
        ctl.inner_backends = dict(inner)
    starting = not wenv.replacement and protocol.current_generation(ctl.store) == 0
    original = _original_init or dist.init_process_group
    kwargs.pop("device_id", None)  # the inner NCCL group binds lazily (placed above)
    original(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size,
             timeout=datetime.timedelta(seconds=ctl.timeout_s), **kwargs)
    if starting and ctl.gen is None:
        ctl.activate(0)

