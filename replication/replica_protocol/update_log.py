"""Update logs: what a sharded rank's optimizers consumed each step, so that a
replacement can rebuild its shard at the live step from an older replica without
running a forward or backward pass again (ADR 0049).

After a failure in step L+1's forward or backward, every survivor's own shards are
still those of the end of step L; what is missing is each lost rank's shard at L, and
its replicas hold it only at the committed step C. An optimizer's step is a function
of its state, its parameters, the gradients it is given and its hyperparameters, and
on the same kind of device it gives the same bits for the same inputs. So each rank
records, at every optimizer step, the gradients it was about to consume (its own
shards of them, after reduce-scatter and clipping: what ``step()`` sees) and the
hyperparameters in force, and ships them in its per-step mark
(:mod:`replication.replica_protocol.marks`) to the ranks that hold its replicas. A
replacement loads the replica of C, then runs its own optimizers L-C times on the
logged inputs (:func:`replay`), then loads the small part of its mark of L.

What this does not see: a parameter changed in place outside its optimizer's step
(an EMA written into a registered module, weights edited by hand). Such a job's
parameters are not all optimized, and :func:`optimized_modules` refuses it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger("checkpointless.replication")

UPDATES = "_updates"  # the mark's entry holding the step's optimizer inputs


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2, TP), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every group's settings but its parameters, by value (a tensor ``lr`` cloned)."""
    return [{k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
             for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def optimized_modules(modules: Sequence[torch.nn.Module],
                      optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """Why the modules' state cannot be rebuilt from their optimizers' logged inputs
    (``None``: it can): every trainable parameter must belong to one of the optimizers,
    and there must be one. Frozen parameters (``requires_grad=False``) stay as the
    replica has them."""
    if not optimizers:
        return "no optimizer is registered"
    optimized = {id(p) for o in optimizers for p in _params(o)}
    for m in modules:
        for name, p in m.named_parameters():
            if p.requires_grad and id(p) not in optimized:
                return f"parameter {name!r} is trainable but in no registered optimizer"
    return None


class UpdateRecorder:
    """Records each step of the given optimizers (a pre-hook on ``step()``): the local
    shards of the gradients it is about to consume, and its hyperparameters. Registered
    as the mark's :data:`UPDATES` entry: ``state_dict`` is the calls since the last
    mark, plus every optimizer's hyperparameters now (a scheduler changes ``lr`` after
    the step, and a replacement must end with the value in force at the mark).

    The gradients are not copied when recorded: the mark taken at the step's end
    copies them once, into its message (``encode_to_buffer``). Until then nothing but
    the optimizer reads them in a job that zeroes its gradients by setting them to
    ``None`` (the default), and their version counters say whether anything wrote
    them in place (:meth:`check`: ``zero_grad(set_to_none=False)`` before the step's
    end, an accumulation into them). If something did, that mark cannot be replayed,
    and from then on the recorder copies each gradient as it records it, into buffers
    kept from step to step."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)
        self.calls: list[dict[str, Any]] = []
        self.begun = 0  # optimizer steps begun, ever: a survivor's live state moved
        self.replaying = False
        self.unreplayable = False  # a call since the last mark cannot be replayed
        self.copying = False  # gradients were written in place after a step: copy them
        self._recorded: list[tuple[torch.Tensor, int]] = []  # uncopied: (gradient, version)
        self._pool: dict[tuple[str, int], list[torch.Tensor | None]] = {}
        self._handles = [opt.register_step_pre_hook(self._hook(name))
                         for name, opt in self.optimizers.items()]

    def _hook(self, name: str) -> Any:
        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.begun += 1
            if not self.replaying:
                self._record(name, opt)
        return pre

    def _record(self, name: str, opt: torch.optim.Optimizer) -> None:
        index = sum(1 for c in self.calls if c["optimizer"] == name)
        kept = self._pool.get((name, index)) if self.copying else None
        grads: list[torch.Tensor | None] = []
        for i, p in enumerate(_params(opt)):
            if p.grad is not None and getattr(p.grad, "placements", None) != \
                    getattr(p, "placements", None):
                self.unreplayable = True  # a partial or differently placed gradient
            g = None if p.grad is None else _local(p.grad).detach()
            buf = kept[i] if kept is not None and i < len(kept) else None
            if g is None:
                grads.append(None)
            elif not self.copying:
                grads.append(g)
                self._recorded.append((g, g._version))
            elif buf is not None and buf.shape == g.shape and buf.dtype == g.dtype \
                    and buf.device == g.device:
                grads.append(buf.copy_(g))
            else:
                grads.append(g.clone(memory_format=torch.contiguous_format))
        if self.copying:
            self._pool[(name, index)] = grads
        self.calls.append({"optimizer": name, "hyper": _hyperparameters(opt), "grads": grads})

    def check(self) -> bool:
        """Whether the gradients recorded since the last mark are still as the
        optimizer saw them (called just before the mark copies them). If not, the mark
        is not replayable and the recorder copies from now on."""
        if any(g._version != v for g, v in self._recorded):
            self.unreplayable = True
            if not self.copying:
                self.copying = True
                log.info("update log: the gradients were written in place after the "
                         "optimizer step and before the step's end; they are copied as "
                         "the optimizer takes them from now on")
        return not self.unreplayable

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls,
                "after": {n: _hyperparameters(o) for n, o in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A mark loaded into the live objects: the updates it logged are already in
        the state it came with (a survivor's own mark), or are replayed separately
        (:func:`replay`); only the hyperparameters in force at the mark are set."""
        set_hyperparameters(self.optimizers, state_dict["after"])

    def taken(self) -> None:
        """The calls so far went into a mark: the next mark starts empty."""
        self.calls = []
        self._recorded = []
        self.unreplayable = False

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def nbytes(self) -> int:
        """The gradient bytes one mark's calls hold now."""
        return sum(g.numel() * g.element_size() for c in self.calls for g in c["grads"]
                   if g is not None)


class LoggedUpdates:
    """A mark's :data:`UPDATES` entry as loaded from a peer's mark: kept, not applied
    (a survivor loading its own mark, or a replacement before :func:`replay`)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.loaded or {"calls": [], "after": {}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def set_hyperparameters(optimizers: Mapping[str, torch.optim.Optimizer],
                        hyper: Mapping[str, list[dict[str, Any]]]) -> None:
    """Set each optimizer's groups to ``hyper`` (what :func:`_hyperparameters` took)."""
    for name, groups in hyper.items():
        opt = optimizers[name]
        if len(groups) != len(opt.param_groups):
            raise ValueError(f"optimizer {name!r} has {len(opt.param_groups)} parameter "
                             f"groups; the log has {len(groups)}")
        for group, h in zip(opt.param_groups, groups):
            for k, v in h.items():
                group[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)


def _as_grad(p: torch.Tensor, logged: torch.Tensor) -> torch.Tensor:
    """A gradient for ``p`` holding ``logged`` (its local shard): a DTensor like ``p``
    when ``p`` is one (no communication: ``zeros_like`` is local)."""
    grad = torch.zeros_like(p)
    local = _local(grad)
    if local.shape != logged.shape:
        raise ValueError(f"a logged gradient of shape {tuple(logged.shape)} for a parameter "
                         f"whose local shard is {tuple(local.shape)}")
    local.copy_(logged)
    return grad


def replay(optimizers: Mapping[str, torch.optim.Optimizer],
           logs: Iterable[Mapping[str, Any]], recorder: UpdateRecorder | None = None) -> int:
    """Run ``optimizers`` on the logged inputs, oldest first (each of ``logs`` is one
    mark's :data:`UPDATES` entry); returns the optimizer steps run. The gradients are
    dropped afterwards, and the hyperparameters are the newest mark's. ``recorder``:
    this rank's own, kept from recording the replayed steps."""
    ran = 0
    last: Mapping[str, Any] | None = None
    if recorder is not None:
        recorder.replaying = True
    try:
        with torch.no_grad():
            for log in logs:
                for call in log["calls"]:
                    opt = optimizers[call["optimizer"]]
                    params = _params(opt)
                    if len(params) != len(call["grads"]):
                        raise ValueError(f"optimizer {call['optimizer']!r} has {len(params)} "
                                         f"parameters; the log has {len(call['grads'])}")
                    for p, g in zip(params, call["grads"]):
                        p.grad = None if g is None else _as_grad(p, g)
                    set_hyperparameters(optimizers, {call["optimizer"]: call["hyper"]})
                    opt.step()
                    ran += 1
                last = log
    finally:
        if recorder is not None:
            recorder.replaying = False
            recorder.taken()
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    if last is not None:
        set_hyperparameters(optimizers, last["after"])
    return ran
