"""A Lightning run's training state as snapshot entries, restored through Lightning.

Lightning already knows how to put a run back together from a checkpoint dictionary:
model, optimizers, schedulers, loop counters, callbacks, precision plugin, datamodule
and stateful data loaders. So a snapshot *is* a Lightning checkpoint dictionary
(``dump_checkpoint``), split into a few entries so that data-parallel dedupe works per
part, plus the RNG streams Lightning does not save. Restoring does not touch live
objects: the entries keep what they receive (:class:`LightningState` ``pending``), and
the strategy hands it back to Lightning as the checkpoint of a re-entered ``fit``.

Hyper-parameters are left out: they are arbitrary Python objects the pickle-free
snapshot codec refuses, and they never change during a run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from replication.training_state.codec import CodecError, encode
from replication.training_state.state import RNGState, TrainingState

#: Top-level checkpoint keys that hold hyper-parameters (module and datamodule).
HPARAM_KEYS = frozenset({
    "hyper_parameters", "hparams_name", "hparams_type",
    "datamodule_hyper_parameters", "datamodule_hparams_name", "datamodule_hparams_type",
})

#: Top-level keys the strategy adds to a snapshot's checkpoint, which plain Lightning does
#: not know: module train/eval modes, the observed loop state (:mod:`.loop_state`,
#: ``checkpointless_observed``), and the marker of per-rank RNG streams.
MODES_KEY = "checkpointless_module_modes"
RUNTIME_KEYS = (MODES_KEY, "checkpointless_observed", "__checkpointless_rng__")

#: Which checkpoint keys go to which snapshot entry; everything else is "trainer".
PARTS = {"model": ("state_dict",), "optimizer": ("optimizer_states", "lr_schedulers")}
ENTRY_NAMES = ("model", "optimizer", "trainer")
#: The entries that are the same on every rank of a DDP run (but the model's buffers).
PARTS_DATA_PARALLEL = ("model", "optimizer")


def split_checkpoint(checkpoint: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Split a Lightning checkpoint into snapshot entries, hyper-parameters dropped."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in ENTRY_NAMES}
    owner = {key: name for name, keys in PARTS.items() for key in keys}
    for key, value in checkpoint.items():
        if key in HPARAM_KEYS:
            continue
        parts[owner.get(key, "trainer")][key] = value
    return parts


def to_plain_lightning(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint as plain Lightning expects it, without the strategy.

    Drops the strategy's own keys (:data:`RUNTIME_KEYS`) and the training loaders' states:
    the strategy wraps each training loader (:mod:`.data`) and saves its position, which
    plain Lightning refuses for a loader that is not stateful ("The CombinedLoader has 0
    stateful loaders, but found 1 states"). Plain Lightning then resumes as it does from
    any mid-epoch checkpoint of a plain ``DataLoader``.
    """
    out = {k: v for k, v in checkpoint.items() if k not in RUNTIME_KEYS}
    loops = out.get("loops")
    if isinstance(loops, dict) and isinstance(loops.get("fit_loop"), dict):
        fit = dict(loops["fit_loop"])
        inner = fit.get("state_dict")
        if isinstance(inner, dict) and "combined_loader" in inner:
            fit["state_dict"] = {k: v for k, v in inner.items() if k != "combined_loader"}
        out["loops"] = {**loops, "fit_loop": fit}
    return out


def check_encodable(checkpoint: dict[str, Any]) -> None:
    """Raise a clear error naming the first checkpoint value snapshots cannot hold."""
    for key, value in checkpoint.items():
        if key in HPARAM_KEYS:
            continue
        try:
            encode(value, lambda t, path: 0)
        except CodecError as exc:
            raise CodecError(
                f"Lightning checkpoint key {key!r} cannot be held in a checkpointless snapshot: "
                f"{exc}. Values added in on_save_checkpoint hooks must be tensors, numbers, "
                "strings, bytes, or dicts/lists/tuples of them"
            ) from None


class DeferredRNG:
    """RNG streams captured at a known point of Lightning's loop, restored at the same point.

    ``at`` names the point: ``"fetch"`` (just before the next training batch is fetched),
    ``"train_start"`` (the strategy's ``on_train_start``) or ``"end"``. A restored state
    waits in ``pending`` until the resumed loop reaches that point again, so whatever
    Lightning does in between (re-creating the data iterator draws a seed) cannot shift
    the streams against a run without failures.
    """

    def __init__(self) -> None:
        self.at = "fetch"
        self.pending: dict[str, Any] | None = None
        self._rng = RNGState()

    def state_dict(self) -> dict[str, Any]:
        if self.pending is not None:
            return self.pending
        return {"at": self.at, **self._rng.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = dict(state_dict)

    def apply_pending(self, at: str) -> bool:
        """Restore the pending streams if they were captured at ``at``."""
        if self.pending is None or self.pending.get("at") != at:
            return False
        state, self.pending = self.pending, None
        self._rng.load_state_dict(state)
        return True

    def apply_now(self) -> None:
        """Restore the pending streams wherever they were captured (durable resume)."""
        if self.pending is not None:
            state, self.pending = self.pending, None
            self._rng.load_state_dict(state)


class ModelBuffers:
    """The LightningModule's persistent buffers by value, for the marks of a live
    rollback (ADR 0039, second addendum). A snapshot's model part is the same on every
    rank but for these (batch norm statistics move with each rank's own batch), so a
    replacement that takes the model part from another rank takes its own buffers from
    its mark. Loading writes them into the restored model part, which the handover
    loads first."""

    def __init__(self, lstate: LightningState, module: Callable[[], Any]) -> None:
        self._lstate, self._module = lstate, module

    def state_dict(self) -> dict[str, Any]:
        module = self._module()
        if module is None:
            return {}
        persistent = module.state_dict(keep_vars=True)
        return {k: b for k, b in module.named_buffers() if k in persistent}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        model = self._lstate.pending.get("model", {}).get("state_dict")
        if not isinstance(model, dict):
            raise RuntimeError("the model part must be restored before its buffers")
        missing = sorted(set(state_dict) - set(model))
        if missing:
            raise KeyError(f"buffers {missing[:3]} are not in the restored model part")
        model.update(state_dict)


class _Entry:
    """One part of the checkpoint dictionary, as a ``Stateful`` for the registry."""

    def __init__(self, owner: LightningState, name: str) -> None:
        self._owner, self._name = owner, name

    def state_dict(self) -> dict[str, Any]:
        return self._owner.part(self._name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._owner.pending[self._name] = state_dict


class LightningState:
    """The snapshot entries of a Lightning run and their pending restore.

    ``refresh(dump)`` is called right before each snapshot with the function that builds
    the live checkpoint dictionary; between snapshots the entries hold no reference to
    live tensors. After a restore, ``state_dict`` returns what was restored until
    :meth:`take_checkpoint` hands it to Lightning, so a capture taken in between (a
    newcomer seals the state it received) holds exactly the restored state.
    """

    def __init__(self) -> None:
        self.rng = DeferredRNG()
        self.pending: dict[str, dict[str, Any]] = {}
        self._cache: dict[str, dict[str, Any]] | None = None
        self._checked = False
        self.registry = TrainingState(rng=False)
        self.registry.register("rng", self.rng)
        for name in ENTRY_NAMES:
            self.registry.register(name, _Entry(self, name))
        # The loops, callbacks and logged metrics: NeMo logs each step's wall-clock
        # timing, so a replay of this entry differs by design. The model and optimizer
        # entries are still checked.
        self.registry.exempt_from_replay_check("trainer")

    def part(self, name: str) -> dict[str, Any]:
        if name in self.pending:
            return self.pending[name]
        if self._cache is not None:
            return self._cache[name]
        return {}

    def refresh(
        self, dump: Callable[[], dict[str, Any]], at: str, optimizers: Iterable[Any] = ()
    ) -> None:
        """Take the live checkpoint dictionary for the next capture. ``optimizers`` (the
        trainer's) own the weights and optimizer state in it: declared to the registry,
        the snapshot copies their tensors while the next step's closure runs."""
        self.registry.declare_optimizers(optimizers)
        checkpoint = dump()
        if not self._checked:  # a clear message naming the key, once; later: codec errors
            check_encodable(checkpoint)
            self._checked = True
        self._cache = split_checkpoint(checkpoint)
        self.rng.at = at

    def release(self) -> None:
        """Drop the references to live state taken by :meth:`refresh`."""
        self._cache = None

    @property
    def has_pending(self) -> bool:
        return all(name in self.pending for name in ENTRY_NAMES)

    def take_checkpoint(self) -> dict[str, Any]:
        """The restored state as one Lightning checkpoint dictionary (consumes it)."""
        missing = [n for n in ENTRY_NAMES if n not in self.pending]
        if missing:
            raise RuntimeError(f"no restored checkpointless state to resume from (missing "
                               f"{missing}); this is a bug in the Lightning integration")
        checkpoint: dict[str, Any] = {}
        for name in ENTRY_NAMES:
            checkpoint.update(self.pending.pop(name))
        return checkpoint
