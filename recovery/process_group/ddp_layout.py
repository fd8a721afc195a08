"""DDP's gradient bucket layout, carried with the training state (ADR 0034).

A backend's all-reduce adds the ranks' values of an element in an order that depends on
where the element sits in its buffer (gloo's ring, NCCL's ring and tree). With three or
more ranks, a gradient reduced over another bucket layout therefore differs in its last
bits (a + b == b + a, but (a + b) + c != a + (b + c)).

DDP lays its buckets out twice: at construction (all parameters in one bucket, by
default) and once more after the first backward, in the order the gradients became
ready. After a recovery every rank needs a new reducer (a replacement's DDP is new; the
survivors' would otherwise all-reduce against a different layout), and a new reducer
starts from the construction layout, while the failure-free run reduces that step over
the rebuilt one. Summing in rank order (``recovery.ordered_allreduce``) hid the
difference at (N-1)x a ring's traffic; this module removes it instead:

- the layout each DDP will reduce its next step over is an entry of the training state
  (``_ddp_layout``), so a survivor's own snapshot, a replica and a durable checkpoint
  all carry the layout of their step;
- at a capture, a DDP whose one-time rebuild is pending (its first backward ran, its
  next forward has not) rebuilds now (:meth:`BucketLayouts.state_dict`): the same
  layout, computed from the same gradient order, one forward earlier, so the layout a
  committed step names is the one its next step uses;
- restoring the entry gives every DDP, on every rank, a reducer built over the
  restored layout (a layout of ``None``: the construction layout, rebuild pending).

The backend's own all-reduce then sees the same ranks, sizes and buffers as the
failure-free run, and gives the same bytes.

Torch-private names used here: ``_build_params_for_reducer``, ``_ddp_init_helper``,
``_build_debug_param_to_name_mapping`` (as in DDP's ``__setstate__``),
``reducer._rebuild_buckets``, ``reducer._get_zeros_like_grad_buckets``,
``_has_rebuilt_buckets``, and ``dist._compute_bucket_assignment_by_size``, replaced for
the duration of one reducer build.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from recovery.process_group import owned_group

log = logging.getLogger(__name__)

Layout = list[list[int]]
"""Bucket after bucket in the reducer's order, each a list of indices into the DDP's
reducer parameters (``_build_params_for_reducer()``)."""

_KNOWN = "_checkpointless_layout"  # on a DDP: (its reducer's id, layout or None, rebuilt)
_SIGNATURE = "_checkpointless_signature"  # on a DDP: signature()


def find_ddps() -> list[Any]:
    """Every ``DistributedDataParallel`` of this process on the runtime's owned group.

    One pass over the collector's objects (tens of milliseconds in a process of a few
    million objects): the runtime keeps no list, since frameworks and users build DDP
    wherever they like.
    """
    from torch.nn.parallel import DistributedDataParallel

    with warnings.catch_warnings():
        # isinstance() on torch's deprecated ``dist.reduce_op`` object warns.
        warnings.simplefilter("ignore", FutureWarning)
        found = [obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)]
    return [d for d in found if owned_group.is_owned(getattr(d, "process_group", None))]


def signature(ddp: Any) -> str:
    """A name for ``ddp`` that every rank computes alike: the module's class, and the
    count and total size of its reducer parameters. Kept on the DDP once computed: every
    snapshot's capture asks, and the parameters of a DDP do not change."""
    name = getattr(ddp, _SIGNATURE, None)
    if name is None:
        params = ddp._build_params_for_reducer()[0]
        name = (f"{type(ddp.module).__qualname__}:{len(params)}:"
                f"{sum(p.numel() for p in params)}")
        setattr(ddp, _SIGNATURE, name)
    return name


def settle(ddp: Any) -> None:
    """Run DDP's pending one-time bucket rebuild now, if one is pending.

    The rebuild is a collective (rank 0's layout is broadcast), so every rank must call
    this at the same point: a snapshot's capture, which every rank reaches at the same
    step boundary (never inside a backward: torch's reducer asserts there). It is a
    no-op (and no collective) before the first backward and after the rebuild.
    """
    if ddp.reducer._rebuild_buckets():
        ddp._has_rebuilt_buckets = True
        _remember(ddp, _read_layout(ddp))


def current_layout(ddp: Any) -> Layout | None:
    """The layout ``ddp``'s next step reduces over, or ``None`` for the construction
    layout with its rebuild still pending (or never coming: ``find_unused_parameters``)."""
    known = getattr(ddp, _KNOWN, None)
    rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
    if known is not None and known[0] == id(ddp.reducer) and known[2] == rebuilt:
        return known[1]
    if rebuilt:  # rebuilt by DDP's own forward since we last looked
        _remember(ddp, _read_layout(ddp))
        return getattr(ddp, _KNOWN)[1]
    return None


def _remember(ddp: Any, layout: Layout | None) -> None:
    """Note the layout of ``ddp``'s current reducer, valid while neither the reducer nor
    its rebuilt flag changes."""
    setattr(ddp, _KNOWN, (id(ddp.reducer), layout, bool(ddp._has_rebuilt_buckets)))


def _read_layout(ddp: Any) -> Layout:
    """The reducer's buckets as parameter indices (allocates one zeroed copy of the
    gradient buckets: read once per reducer)."""
    index = {id(p): i for i, p in enumerate(ddp._build_params_for_reducer()[0])}
    return [[index[id(p)] for p in bucket.parameters()]
            for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def rebuild_reducer(ddp: Any, layout: Layout | None) -> None:
    """Give ``ddp`` a new reducer over ``layout`` (``None``: DDP's construction layout),
    the way torch's own ``DistributedDataParallel.__setstate__`` builds one, and
    register the script's comm hooks on it again. Builds no collective."""
    parameters, expect_sparse = ddp._build_params_for_reducer()
    if layout is not None and sorted(i for b in layout for i in b) != list(range(len(parameters))):
        log.warning("checkpointless: a DDP's restored bucket layout does not fit its %d "
                    "parameters; using DDP's construction layout (the first step after "
                    "this recovery may differ in its last bits)", len(parameters))
        layout = None
    names = ddp._build_debug_param_to_name_mapping(parameters)
    with _assignment(layout, ddp.bucket_bytes_cap):
        ddp._ddp_init_helper(parameters, expect_sparse, names, ddp.static_graph)
    if getattr(ddp, "_require_manual_backward_finalization", False):
        ddp.require_manual_backward_finalization = True  # torch >= 2.15: the new reducer's
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
        # A new static-graph reducer learns the graph in its first backward, whose
        # gradients DDP all-reduces in one delayed pass it enqueues while this flag is
        # False. The old reducer's True left every gradient unreduced after a recovery.
        ddp._static_graph_delay_allreduce_enqueued = False
    for hook, state in getattr(ddp, "_comm_hooks", []):
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
    _remember(ddp, layout)  # valid until DDP's own rebuild (the same layout, re-read then)


@contextlib.contextmanager
def _assignment(layout: Layout | None, cap: int) -> Iterator[None]:
    """Make DDP's bucket assignment return ``layout`` while its reducer is built.

    DDP reverses the assignment it computes (parameters are assigned in definition
    order, gradients arrive roughly in reverse), so the layout goes in reversed."""
    if layout is None:
        yield
        return
    original = dist._compute_bucket_assignment_by_size

    def assign(*_args: Any, **_kwargs: Any) -> tuple[Layout, list[int]]:
        return [list(b) for b in reversed(layout)], [cap] * len(layout)
    dist._compute_bucket_assignment_by_size = assign
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = original


class BucketLayouts:
    """The ``_ddp_layout`` entry of the training state: each DDP's next-step layout.

    Its state is ``{"ddp": {signature: layout or None}}``. Registered by the runtime on
    every rank; optional (a checkpoint written without it restores, and its DDPs keep
    the construction layout) and exempt from the replay check (it names a layout, not a
    value a step computes).
    """

    NAME = "_ddp_layout"

    def __init__(self, state: Any = None) -> None:
        self._state = state  # its ``measuring`` flag: a capture that only sizes the state
        self._ddps: list[weakref.ref[Any]] = []
        self._scanned = False
        self._empty_scans_left = 3  # a script may wrap its model after the first capture
        self._last_restored: dict[str, Layout | None] = {}  # for DDPs built after a restore
        self.restored: int | None = None  # DDPs a restore handled since take_restored()

    def _live(self) -> list[Any]:
        """The DDPs tracked: found by a scan at the first capture (again at the next few
        while none is found; a job without DDP stops paying for the scan after that), at
        every restore, or adopted."""
        if not self._scanned or (not self._ddps and self._empty_scans_left > 0):
            if self._scanned:
                self._empty_scans_left -= 1
            self._ddps, self._scanned = [weakref.ref(d) for d in find_ddps()], True
        return [d for d in (ref() for ref in self._ddps) if d is not None]

    def state_dict(self) -> dict[str, Any]:
        if getattr(self._state, "measuring", False):
            # Maybe mid-step (a recovery sizes the state before restoring it): a reducer
            # inside an interrupted backward must not be asked to rebuild (torch asserts).
            return {"ddp": {}}
        layouts: dict[str, Layout | None] = {}
        for ddp in self._live():
            settle(ddp)
            layouts[signature(ddp)] = current_layout(ddp)
        return {"ddp": layouts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Rebuild every DDP's reducer over its restored layout, on every rank.

        A DDP the checkpoint does not name (built after the first capture, or by another
        script) gets the construction layout, as before this entry existed."""
        restored: dict[str, Layout | None] = dict(state_dict.get("ddp", {}))
        self._ddps, self._scanned = [weakref.ref(d) for d in find_ddps()], True
        live = self._live()
        for ddp in live:
            layout = restored.get(signature(ddp))
            if layout is None and not getattr(ddp, "_lazy_init_ran", True):
                _remember(ddp, None)  # never ran a forward: already the construction layout
            else:
                rebuild_reducer(ddp, layout)
        self._last_restored = restored
        self.restored = len(live)

    def adopt(self, ddp: Any) -> None:
        """Track ``ddp``, a DDP built after the state was restored (Lightning wraps the
        module anew for each ``fit`` attempt), as this rank's only one, and give it the
        restored layout: the layout its step had in the failure-free run."""
        self._ddps, self._scanned = [weakref.ref(ddp)], True
        layout = self._last_restored.get(signature(ddp))
        if layout is not None:
            rebuild_reducer(ddp, layout)
        else:
            _remember(ddp, None)

    def take_restored(self) -> int | None:
        """How many DDPs a restore brought to their restored layout since the last call,
        or ``None`` if none ran (then the recovery's module reset rebuilds them)."""
        restored, self.restored = self.restored, None
        return restored


def track(state: Any) -> BucketLayouts:
    """Register the layout entry in ``state`` (a
    :class:`replication.training_state.state.TrainingState`),
    or return the one a runtime built on the same registry already registered."""
    if BucketLayouts.NAME in state:
        return dict(iter(state))[BucketLayouts.NAME]
    entry = BucketLayouts(state)
    state.register(BucketLayouts.NAME, entry)
    state.mark_optional(BucketLayouts.NAME)
    state.exempt_from_replay_check(BucketLayouts.NAME)
    return entry


__all__ = ["BucketLayouts", "Layout", "current_layout", "find_ddps", "rebuild_reducer",
           "settle", "signature", "track"]
