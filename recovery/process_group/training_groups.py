"""Training process groups across generations, and what is let go of a failed one.

The training group is the runtime's own
:class:`recovery.process_group.owned_group.ElasticProcessGroup`
(ADR 0015): the same object for the whole life of the process, so DDP, FSDP2, DeviceMesh
and the user's ``dist.*`` calls keep it, while its inner gloo/NCCL backend is replaced
for each generation. A failure fails its pending collectives and aborts the inner
backend (its sockets are shut down), which then destroys in milliseconds: nothing of
the failed generation keeps a thread or a socket.

The side channel's groups and framework objects still tied to a failed generation go to
a reaper (:func:`keep`) that drops them once their operations have ended.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from recovery.process_group import (
    controller,
    ddp_layout,
    init_hook,
    owned_group,
    pipeline_schedules,
)
from replication.side_channel import work_waiter

_graveyard: list[tuple[float, Any]] = []
_reaper: threading.Thread | None = None
_graveyard_lock = threading.Lock()


def setup_training_group(
    store: dist.Store, gen: int, rank: int, world_size: int, timeout_s: float, backend: str,
    ordered_allreduce: bool = False, nccl_fixed_algorithm: bool = False,
) -> bool:
    """Bind the default process group to generation ``gen``, creating it if needed.

    A script that called ``init_process_group`` under ``checkpointless run`` already has
    the owned group (:func:`recovery.process_group.init_hook.install_init_hook`); otherwise the
    runtime creates it here with ``backend`` as the inner backend. Returns True when
    it created the group (then the runtime destroys it at the end, not the script).
    """
    ctl = controller.controller()
    ctl.ordered_allreduce = ordered_allreduce
    ctl.nccl_fixed_algorithm = nccl_fixed_algorithm
    if ctl.store is None:
        ctl.configure(store, timeout_s, init_hook.inner_backends_for(backend))
    created = not dist.is_initialized()
    if created:
        controller.register_backend()
        original = init_hook._original_init or dist.init_process_group
        original(owned_group.BACKEND_NAME, store=dist.HashStore(), rank=rank,
                 world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    elif not owned_group.is_owned(dist.group.WORLD) and world_size > 1:
        raise RuntimeError(
            "checkpointless: the default process group was not made by checkpointless "
            f"({dist.get_backend()}); start the script with `checkpointless run` so that "
            "init_process_group() gives the runtime's group")
    ctl.activate(gen)
    return created


def fail_training_groups(reason: str, wait_s: float = 5.0) -> None:
    """Fail every collective in flight on the owned groups and free their backends."""
    ctl = controller.controller()
    ctl.fail(reason)
    t0 = time.monotonic()
    if not ctl.wait_released(wait_s):
        print(f"checkpointless: the failed generation's process groups still run "
              f"operations {time.monotonic() - t0:.1f}s after their abort ({ctl.stuck()}); "
              "they are freed when those end", file=sys.stderr, flush=True)


def reset_parallel_modules(fresh_process: bool,
                           ddps_rebuilt: int | None = None) -> tuple[int, int, int]:
    """Bring the user's DDP and FSDP2 modules and pipeline schedules to where a
    replacement's are after a recovery; returns how many DDP and root FSDP2 modules and
    schedules were reset (:mod:`recovery.process_group.pipeline_schedules`). One pass
    over the collector's objects finds them all (about 30 ms in a process of a few
    million objects: the runtime holds no list of them, since Lightning and users build
    them wherever they like).

    ``fresh_process``: this process has not trained a step yet (a replacement), so its
    modules already are in the state every other rank's are brought to, and
    rebuilding its DDP reducers again would only cost time (a quarter of a second for
    50 MB of parameters).

    ``ddps_rebuilt``: the training state's restore already gave this many DDPs reducers
    over the target step's bucket layout (:mod:`recovery.process_group.ddp_layout`), so DDPs are
    left
    alone; ``None`` (a state without that entry) rebuilds them over DDP's construction
    layout, as torch's ``__setstate__`` does.
    """
    if fresh_process:
        return 0, 0, 0
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = ()  # isinstance(x, ()) is always False
    schedule, multi = pipeline_schedules.schedule_types()
    ddps, fsdps, schedules = [], [], 0
    with warnings.catch_warnings():
        # isinstance() on torch's deprecated ``dist.reduce_op`` object warns
        # (a FutureWarning per recovery, on every rank's console).
        warnings.simplefilter("ignore", FutureWarning)
        objects = [obj for obj in gc.get_objects()
                   if isinstance(obj, (torch.nn.Module, schedule))]
    modules = []
    for obj in objects:
        if isinstance(obj, schedule):
            schedules += pipeline_schedules.reset_schedule(obj, multi)
        else:
            modules.append(obj)
    del objects
    for obj in modules:
        if isinstance(obj, DistributedDataParallel):
            if owned_group.is_owned(getattr(obj, "process_group", None)):
                ddps.append(obj)
        elif isinstance(obj, FSDPModule) and obj._get_fsdp_state()._is_root:
            fsdps.append(obj)  # _is_root: None before the first forward, False inside
    if ddps_rebuilt is None:
        for ddp in ddps:
            ddp_layout.rebuild_reducer(ddp, None)
    for root in fsdps:
        _reset_fsdp_root(root)
    return len(ddps) if ddps_rebuilt is None else ddps_rebuilt, len(fsdps), schedules


def _reset_fsdp_root(root: Any) -> None:
    """Bring a root FSDP2 module back to the start of an iteration.

    A failure can interrupt FSDP2 in the middle of a forward or a backward: a survivor
    then keeps unsharded parameters, a pending all-gather or reduce-scatter state, and
    per-iteration trackers, while a replacement's modules are fresh. Its next forward
    would skip the all-gathers the replacement issues, and the two sides would wait on
    different collectives. torch's own recovery entry point,
    ``FSDPModule.reset_iter_state()`` on the root module, reshards every parameter group
    and clears those trackers. Gradients of the interrupted step are dropped: the state
    restore clears the sharded parameters' ``.grad``, and this the unsharded copies'
    (which ``reset_iter_state`` keeps). The all-gather results of the failed generation
    are dropped first: their works were failed, and waiting on them would re-raise.
    """
    state = root._get_fsdp_state()
    state._comm_ctx.all_gather_state = None
    for other in state._state_ctx.all_states:
        for group in other._fsdp_param_groups:
            group._all_gather_result = None
            for param in group.fsdp_params:
                _drop_unsharded_grad(param)
    root.reset_iter_state()


def _drop_unsharded_grad(param: Any) -> None:
    """Forget the interrupted backward's gradient on an FSDP2 parameter's unsharded copy.

    Autograd accumulates into the unsharded parameter, and FSDP2 moves that gradient
    out only in the group's post-backward: a backward interrupted in between leaves it
    there (``reset_iter_state`` does not clear it), and the replayed backward would add
    onto it.
    """
    # A plain attribute until torch 2.14; a read-only view of ``_unsharded_param.grad``
    # (cleared below) from 2.15.
    prop = getattr(type(param), "unsharded_accumulated_grad", None)
    if not isinstance(prop, property) or prop.fset is not None:
        param.unsharded_accumulated_grad = None
    unsharded = getattr(param, "_unsharded_param", None)
    if unsharded is not None:
        unsharded.grad = None


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
        if _graveyard:
            return True
    if work_waiter.abandoned_waits():  # an aborted side channel's gloo wait, not ended
        return True
    return controller.controller().holding()


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
_exit_status: int | None = None  # a SystemExit's status, noted on its way out (note_exit)


def install_exit_guard() -> None:
    """Exit without running gloo destructors that could block on abandoned operations.

    At interpreter exit, groups still held from a failed generation would be destroyed
    and wait out their pending operations (up to the collective timeout). If any are
    held, the guard flushes output and ends the process at once, with the status of the
    ``SystemExit`` that ended the script (:func:`note_exit`, called where the launcher
    runs it), else 1 after an unhandled exception and 0 otherwise. An ``atexit`` hook
    cannot see that status itself: the guard once turned the runtime's own exit for a
    stopped job (``SystemExit(EXIT_FAILED)``) into a 0, and the agent then counted the
    rank as finished.
    """
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        global _unhandled
        _unhandled = True
        previous(*exc_info)

    sys.excepthook = hook
    atexit.register(_exit_now_if_holding)


def note_exit(code: object) -> None:
    """The script ends with ``SystemExit(code)``: the status the exit guard uses
    (``None`` is 0, a message is 1, as Python has it)."""
    global _exit_status
    _exit_status = 0 if code is None else code if isinstance(code, int) else 1


def _exit_now_if_holding() -> None:
    if holding():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status if _exit_status is not None else 1 if _unhandled else 0)
