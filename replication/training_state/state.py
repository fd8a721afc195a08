"""The registry of everything that makes up a rank's training state.

Users register named objects (model, optimizer, scheduler, grad scaler, data loader,
any ``Stateful``); the registry captures their state dicts *by reference* (no copy:
the snapshot engine copies tensors straight into its preallocated buffer) and
restores them bit-exactly. RNG streams are an ordinary entry (:class:`RNGState`), so
Python, NumPy, torch and CUDA generators roll back with the model.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from replication.errors import CheckpointlessError
from replication.training_state import codec

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


class StateMismatch(CheckpointlessError, ValueError):
    """A registered object refused the state captured for it: this process built it
    differently from the one that captured the state. The same every time, so a
    recovery that meets it stops the job instead of retrying."""

    def __init__(self, name: str, obj: Any, exc: BaseException) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        super().__init__(
            f"the state {name!r} ({type(obj).__qualname__}) cannot take the snapshot's values "
            f"({type(exc).__name__}: {first}): build the same objects in every process "
            "that may take this rank, a replacement included; a model built on the meta "
            "device loses its tied weights in to_empty() (call model.tie_weights() after it)")


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (torch's own protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class RNGState:
    """Python, NumPy, torch CPU and (when initialised) CUDA random generators.

    Lightning and most loops do not save RNG state; without it a rolled-back rank
    would draw different dropout masks or shuffles than the failure-free run.
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if np is not None:
            state["numpy"] = np.random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        random.setstate(state_dict["python"])
        torch.set_rng_state(state_dict["torch"])
        if np is not None and "numpy" in state_dict:
            np.random.set_state(state_dict["numpy"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


class StateRegistrationError(CheckpointlessError, TypeError):
    """An object that cannot be part of the training state (message says why)."""


class DeviceUnavailable(CheckpointlessError, RuntimeError):
    """A restore needs a device this process does not have (message says which)."""


class TrainingState:
    """Named, ordered collection of the objects whose state defines a training run."""

    def __init__(
        self,
        *,
        rng: bool = True,
        map_location: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
    ) -> None:
        """``map_location(tensor, device)`` places a restored tensor that was captured on
        ``device`` (see :meth:`restore`); by default it goes back to that very device.
        ``tensor`` is a host view of the snapshot: return a copy, never the view itself
        (a host result sharing its memory is copied)."""
        self.map_location = map_location
        self._entries: dict[str, Stateful] = {}
        self._restore_guards: list[Callable[[], None]] = []
        self._step_checks: list[Callable[[], None]] = []
        self._declared_optimizers: list[torch.optim.Optimizer] = []
        self.replay_exempt: frozenset[str] = frozenset()  # see exempt_from_replay_check
        self.optional: frozenset[str] = frozenset()  # see mark_optional
        self.measuring = False  # see measure()
        if rng:
            self.register("rng", RNGState())

    def register(self, name: str, obj: Any) -> None:
        """Add ``obj`` under ``name``; names are stable keys across ranks and restarts."""
        if not name or "/" in name:
            raise StateRegistrationError(f"state name {name!r} must be non-empty without '/'")
        if name in self._entries:
            raise StateRegistrationError(f"state name {name!r} is already registered")
        if not isinstance(obj, Stateful):
            raise StateRegistrationError(
                f"state {name!r} ({type(obj).__qualname__}) has no state_dict/load_state_dict: "
                "register an object that has them (modules, optimizers, LR schedulers and "
                f"GradScaler do), or give {type(obj).__qualname__} state_dict() and "
                "load_state_dict()"
            )
        self._entries[name] = obj

    def exempt_from_replay_check(self, *names: str) -> None:
        """Entries whose replay may differ by design, so a survivor does not compare
        them with their first run (:mod:`replication.snapshots.replay_check`): a framework's loop
        state holds wall-clock values (NeMo logs each step's timing as a metric)."""
        self.replay_exempt = self.replay_exempt | frozenset(names)

    def mark_optional(self, *names: str) -> None:
        """Entries a snapshot may lack: :meth:`restore` leaves them as they are instead
        of refusing it. For the runtime's own bookkeeping (the intervals ``every_n_steps:
        auto`` chose), so a job can resume a durable checkpoint written by a job that did
        not keep it."""
        self.optional = self.optional | frozenset(names)

    def add_restore_guard(self, guard: Callable[[], None]) -> None:
        """Call ``guard()`` before every :meth:`restore` writes the live objects.

        A snapshot engine that copies tensors off the training thread registers its
        fence here, so no restore writes a tensor while a snapshot still reads it.
        """
        self._restore_guards.append(guard)

    def add_step_check(self, check: Callable[[], None]) -> None:
        """Call ``check()`` at the end of every step, before its snapshot: an entry whose
        state is only capturable at some boundaries (a DeepSpeed engine between two
        optimizer steps) raises there at the first step that ends elsewhere, instead of at
        whichever later step the snapshot interval happens to fall on."""
        self._step_checks.append(check)

    def check_step(self) -> None:
        """Run the checks :meth:`add_step_check` registered (each raises its own line)."""
        for check in self._step_checks:
            check()

    def declare_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Name optimizers whose tensors the entries reach without registering them.

        A framework's checkpoint dictionary (the Lightning integration's entries)
        holds the weights and optimizer state without the optimizer being an entry of
        its own. Declaring it lets a snapshot engine copy those tensors while the next
        step runs, fenced by the optimizer's ``step()`` (ADR 0013). Each call replaces
        the previous list: a framework may build new optimizers when it resumes.
        """
        self._declared_optimizers = list(optimizers)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The registered torch optimizers, then the declared ones not registered."""
        found = [obj for _, obj in self if isinstance(obj, torch.optim.Optimizer)]
        return found + [o for o in self._declared_optimizers if all(o is not f for f in found)]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[tuple[str, Stateful]]:
        return iter(self._entries.items())

    def capture(self) -> dict[str, Any]:
        """State dicts of every entry, sharing storage with the live tensors."""
        return {name: obj.state_dict() for name, obj in self._entries.items()}

    def measure(self) -> dict[str, Any]:
        """:meth:`capture` to learn the state's size, not to snapshot it: possibly in the
        middle of a step (a recovery sizes the state before restoring it), where an entry
        must not act as at a step boundary (:attr:`measuring` is True meanwhile)."""
        self.measuring = True
        try:
            return self.capture()
        finally:
            self.measuring = False

    def restore(self, states: Mapping[str, Any]) -> None:
        """Load ``states`` into the live objects, bit-exactly.

        Tensors in ``states`` may alias a snapshot buffer that is later overwritten,
        so modules copy them in place into their parameters and every other object
        receives private clones. Snapshots hold every tensor on the host: modules copy
        into their own tensors wherever those live, and optimizers move their state to
        their parameters' devices themselves (``load_state_dict``); any other object (an
        EMA dict, a user tensor) gets each tensor on the device it was captured from
        (:func:`replication.training_state.codec.recorded_device`), or where :attr:`map_location`
        puts it. A recorded device this process lacks is refused before anything is
        loaded.
        """
        missing = [n for n in self._entries if n not in states and n not in self.optional]
        if missing:
            raise KeyError(f"snapshot has no state for registered entries {missing}")
        if self.map_location is None:
            self._check_devices(states)
        for guard in self._restore_guards:
            guard()
        for name, obj in self._entries.items():
            if name not in states:  # an optional entry (see mark_optional)
                continue
            try:
                if isinstance(obj, torch.nn.Module):
                    _restore_module(obj, states[name])
                elif isinstance(obj, torch.optim.Optimizer):
                    restored = _rewrap_optimizer_dtensors(obj, clone_tensors(states[name]))
                    obj.load_state_dict(restored)
                else:
                    obj.load_state_dict(clone_tensors(states[name], self._placed_copy))
            except (ValueError, RuntimeError, KeyError, TypeError) as exc:
                raise StateMismatch(name, obj, exc) from exc

    def _placed_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private copy of ``tensor`` on the device it was captured from."""
        device = codec.recorded_device(tensor)
        if device is None:
            return tensor.clone()
        if self.map_location is None:
            return tensor.to(device, copy=True)
        placed = self.map_location(tensor, device)
        if placed.device.type == "cpu" and (
                placed.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()):
            placed = placed.clone()  # never hand out the snapshot buffer itself
        return placed

    def _check_devices(self, states: Mapping[str, Any]) -> None:
        """Refuse, before anything is loaded, a restore that needs a device this process
        does not have (a checkpoint of a GPU job loaded on a smaller or CPU-only host)."""
        for name, obj in self._entries.items():
            if name not in states or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
                continue
            for device in {d for t in _tensors(states[name])
                           if (d := codec.recorded_device(t)) is not None}:
                if not _has_device(device):
                    raise DeviceUnavailable(
                        f"state entry {name!r} holds tensors captured on {device}, which "
                        "this process does not have; set TrainingState.map_location to "
                        "place them elsewhere"
                    )


def clone_tensors(tree: Any, copy: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:
    """Deep-copy the containers of ``tree`` and clone its tensors (with ``copy``, when
    given, instead of ``Tensor.clone``)."""
    if isinstance(tree, torch.Tensor):
        return tree.clone() if copy is None else copy(tree)
    if isinstance(tree, dict):
        return {k: clone_tensors(v, copy) for k, v in tree.items()}
    if isinstance(tree, list):
        return [clone_tensors(v, copy) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(clone_tensors(v, copy) for v in tree)
    return tree


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``tree``, through the containers :func:`clone_tensors` copies."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        for v in tree:
            yield from _tensors(v)


def _has_device(device: torch.device) -> bool:
    """Whether this process can hold tensors on ``device``."""
    if device.type in ("cpu", "meta"):
        return True
    try:
        module = torch.get_device_module(device)
        return bool(module.is_available()) and (
            device.index is None or device.index < module.device_count())
    except (RuntimeError, AttributeError, AssertionError):
        return False


def _rewrap_optimizer_dtensors(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """Give FSDP2 optimizer state back its DTensor form.

    Snapshots hold each rank's local shard. Optimizer state of a sharded parameter
    (e.g. Adam's moments) must be a DTensor laid out like the parameter, or the next
    step mixes DTensors with plain tensors; scalar state ('step') stays plain.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    state = sd.get("state")
    if not isinstance(state, dict) or not any(_is_dtensor(p) for p in params):
        return sd
    from torch.distributed.tensor import DTensor

    for pid, entry in state.items():
        if not (isinstance(pid, int) and 0 <= pid < len(params)) or not isinstance(entry, dict):
            continue
        p = params[pid]
        if not _is_dtensor(p):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == p.to_local().shape:
                entry[key] = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False,
                    shape=p.shape, stride=p.stride(),
                )
    return sd


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of ``t``: the shard of a DTensor, or ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@torch.no_grad()
def _restore_module(module: torch.nn.Module, state: Mapping[str, Any]) -> None:
    # Snapshots are taken at step boundaries, where no gradient is meaningful. A rank
    # rolled back from the middle of a failed step still holds that step's partial
    # gradients, and ``backward`` would accumulate the replayed step onto them.
    for p in module.parameters():
        p.grad = None
    live = module.state_dict()
    if set(live) != set(state):
        extra, lost = sorted(set(state) - set(live)), sorted(set(live) - set(state))
        raise KeyError(f"module state keys differ: unexpected {extra[:5]}, missing {lost[:5]}")
    if not all(isinstance(v, torch.Tensor) for v in live.values()):
        module.load_state_dict(clone_tensors(dict(state)))
        return
    for key, dst in live.items():
        local_tensor(dst).copy_(state[key])
