"""What a Lightning user observes that Lightning's checkpoint leaves out.

A Lightning checkpoint restores the model, optimizers, loops and callbacks, but not:

- the **accumulators of ``self.log``** (``_ResultCollection``): epoch aggregates such as
  ``train_loss_epoch`` are means over every batch of the epoch, so a run resumed
  mid-epoch would average only the batches after the resume;
- the **states of torchmetrics** objects (non-persistent buffers by default);
- the **logger connector's** metric dictionaries (``trainer.callback_metrics`` is what
  ``ModelCheckpoint(monitor=...)``, ``EarlyStopping`` and ``ReduceLROnPlateau`` read)
  and its loop-position flags, which decide when those accumulators are reset;
- the **plain attributes of third-party callbacks** that define no ``state_dict`` (a
  batch counter, a loss history): Lightning never sees them. Callbacks that define
  ``state_dict`` are trusted to return their whole state; Lightning's own carry the few
  attributes listed in ``_HIDDEN``.

:func:`capture` turns them into snapshot-codec values (tensors, numbers, strings) at a
step boundary; :func:`restore` puts them back once Lightning has rebuilt its objects for
a resumed ``fit``. :func:`discard_attempt` drops what a failed attempt accumulated
(a validation cut short would otherwise add its batches to the replay's).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from replication.training_state import codec
from replication.training_state.state import clone_tensors

log = logging.getLogger("checkpointless.lightning")

#: The key under which the observed state travels inside the snapshot's checkpoint.
KEY = "checkpointless_observed"
_REDUCTIONS = ("mean", "sum", "max", "min")
_DICTS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")
#: Attributes of Lightning's own callbacks that their ``state_dict`` leaves out but that
#: decide collectives: ``ModelCheckpoint`` runs a cross-rank ``file_exists`` loop when
#: ``_last_checkpoint_saved`` is empty, so a replacement with a fresh value (or a
#: survivor with the failed attempt's) would run collectives the others do not.
_HIDDEN = {"ModelCheckpoint": ("_last_global_step_saved", "_last_checkpoint_saved")}


def _tensor(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _metric_modules(module: Any) -> dict[str, Any]:
    """The torchmetrics objects of ``module`` by qualified name (none without torchmetrics)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics comes with Lightning
        return {}
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def _reduction(meta: Any) -> str:
    for name in _REDUCTIONS:
        if getattr(meta, f"is_{name}_reduction"):
            return name
    raise ValueError(f"unknown reduction {meta.reduce_fx!r}")  # Lightning refuses others


def _capture_results(results: Any) -> list[dict[str, Any]]:
    entries = []
    for key, metric in results.items():
        meta, sync = metric.meta, metric.meta.sync
        if sync.group is not None:
            log.warning("self.log(%r, sync_dist_group=...) is not restored after a recovery "
                        "(a process group cannot be held in a snapshot)", meta.name)
            continue
        entry: dict[str, Any] = {
            "key": key, "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar,
            "logger": meta.logger, "on_step": meta.on_step, "on_epoch": meta.on_epoch,
            "reduce": _reduction(meta), "enable_graph": meta.enable_graph,
            "add_dataloader_idx": meta.add_dataloader_idx,
            "dataloader_idx": meta.dataloader_idx, "metric_attribute": meta.metric_attribute,
            "sync": sync.should, "rank_zero_only": sync.rank_zero_only,
            "is_tensor": metric.is_tensor, "has_reset": metric.has_reset,
            "update_count": int(metric._update_count),
            "forward_cache": _tensor(metric._forward_cache) if metric.is_tensor else None,
        }
        if metric.is_tensor:
            entry["value"] = _tensor(metric.value)
            if meta.is_mean_reduction:
                entry["cumulated_batch_size"] = _tensor(metric.cumulated_batch_size)
        entries.append(entry)
    return entries


def _capture_metrics(module: Any) -> dict[str, Any]:
    states = {}
    for name, metric in _metric_modules(module).items():
        if type(metric).__name__ == "_ResultMetric":
            continue
        state = {attr: (list(map(_tensor, v)) if isinstance(v, list) else _tensor(v))
                 for attr, v in metric.metric_state.items()}
        states[name] = {"state": state, "update_count": int(metric._update_count)}
    return states


def _hidden_attrs(callback: Any) -> tuple[str, ...]:
    for cls in type(callback).__mro__:
        if cls.__name__ in _HIDDEN and cls.__module__.startswith("lightning."):
            return _HIDDEN[cls.__name__]
    return ()


def _is_lightnings(callback: Any) -> bool:
    return type(callback).__module__.startswith(("lightning.", "pytorch_lightning."))


def _keeps_own_state(callback: Any) -> bool:
    """A callback class that defines ``state_dict`` is trusted to return its whole state
    (Lightning restores it); capturing its attributes too could undo what its
    ``load_state_dict`` set up for its next hook."""
    import lightning.pytorch as pl

    return type(callback).state_dict is not pl.Callback.state_dict


def _plain_attrs(callback: Any) -> dict[str, Any]:
    """A third-party callback's attributes that the snapshot codec can carry: numbers,
    strings, tensors and containers of them (a counter, a history list, a best score).

    Many callbacks keep such state in plain attributes with no ``state_dict``: after a
    recovery, a survivor's would include the failed attempt's batches and a
    replacement's would start from zero. References to the trainer, the module, open
    files or other objects are left alone (they are rebuilt, not state).
    """
    out: dict[str, Any] = {}
    for name, value in vars(callback).items():
        try:
            codec.encode(value, lambda _t, _p: 0)
        except (codec.CodecError, TypeError, ValueError, RecursionError):
            continue
        out[name] = copy.deepcopy(value)
    return out


def _callback_attrs(callback: Any) -> dict[str, Any]:
    if _is_lightnings(callback) or _keeps_own_state(callback):
        return {attr: getattr(callback, attr) for attr in _hidden_attrs(callback)}
    return _plain_attrs(callback)


def _capture_callbacks(trainer: Any) -> list[dict[str, Any]]:
    return [_callback_attrs(cb) for cb in trainer.callbacks]


def _restore_callbacks(trainer: Any, saved: list[dict[str, Any]]) -> None:
    if len(saved) != len(trainer.callbacks):
        log.warning("the callbacks differ from the snapshot's (%d against %d); their "
                    "hidden state is not restored", len(trainer.callbacks), len(saved))
        return
    for cb, attrs in zip(trainer.callbacks, saved):
        for attr, value in attrs.items():
            setattr(cb, attr, value)


def capture(trainer: Any) -> dict[str, Any]:
    """The observable loop state at a step boundary, as snapshot-codec values."""
    connector = trainer._logger_connector
    return {
        "callbacks": _capture_callbacks(trainer),
        "train_results": _capture_results(trainer.fit_loop.epoch_loop._results),
        "metrics": _capture_metrics(trainer.lightning_module),
        "connector": {
            **{name: {k: _tensor(v) for k, v in getattr(connector, name).items()}
               for name in _DICTS},
            "first_loop_iter": connector._first_loop_iter,
            "current_fx": connector._current_fx,
        },
    }


def _restore_results(trainer: Any, results: Any, entries: list[dict[str, Any]]) -> None:
    from lightning.pytorch.trainer.connectors.logger_connector.result import (
        _Metadata,
        _ResultMetric,
        _Sync,
    )

    module = trainer.lightning_module
    results.clear()
    for e in entries:
        meta = _Metadata(
            fx=e["fx"], name=e["name"], prog_bar=e["prog_bar"], logger=e["logger"],
            on_step=e["on_step"], on_epoch=e["on_epoch"], reduce_fx=e["reduce"],
            enable_graph=e["enable_graph"], add_dataloader_idx=e["add_dataloader_idx"],
            dataloader_idx=e["dataloader_idx"], metric_attribute=e["metric_attribute"])
        meta.sync = _Sync(_should=e["sync"], fn=trainer.strategy.reduce,
                          rank_zero_only=e["rank_zero_only"])
        metric = _ResultMetric(meta, e["is_tensor"])
        device = module.device
        if e["is_tensor"]:
            metric.value = e["value"].to(device)
            if "cumulated_batch_size" in e:
                metric.cumulated_batch_size = e["cumulated_batch_size"].to(device)
            cache = e["forward_cache"]
            metric._forward_cache = cache.to(device) if cache is not None else None
        else:
            metric.value = module.get_submodule(e["metric_attribute"])
            metric._forward_cache = metric.value._forward_cache
        metric._update_count = e["update_count"]
        metric.has_reset = e["has_reset"]
        results[e["key"]] = metric


def _restore_metrics(module: Any, states: dict[str, Any]) -> None:
    live = _metric_modules(module)
    for name, saved in states.items():
        metric = live.get(name)
        if metric is None:
            log.warning("torchmetrics object %r of the snapshot is not in the model; its "
                        "state is not restored", name)
            continue
        for attr, value in saved["state"].items():
            current = getattr(metric, attr)
            if isinstance(value, list):
                device = current[0].device if current else metric.device
                setattr(metric, attr, [v.to(device) for v in value])
            else:
                setattr(metric, attr, value.to(current.device))
        metric._update_count = saved["update_count"]
        metric._computed = None


def restore(trainer: Any, state: dict[str, Any]) -> None:
    """Put the captured observable state back (after Lightning reset it for a new fit).

    Its tensors are cloned first: a restored snapshot's tensors are views into its slot
    (or the handover's buffer); torchmetrics states are updated in place
    (``self.total += n``), which would write into the snapshot, and the slot is reused
    by a later capture."""
    state = clone_tensors(state)
    _restore_callbacks(trainer, state["callbacks"])
    _restore_results(trainer, trainer.fit_loop.epoch_loop._results, state["train_results"])
    _restore_metrics(trainer.lightning_module, state["metrics"])
    connector = trainer._logger_connector
    saved = state["connector"]
    for name in _DICTS:
        setattr(connector, name, dict(saved[name]))
    connector._first_loop_iter = saved["first_loop_iter"]
    connector._current_fx = saved["current_fx"]


def discard_attempt(trainer: Any) -> None:
    """Forget what a failed attempt accumulated: validation and training accumulators,
    torchmetrics states, the connector's position flags. A restore follows."""
    for loop in (trainer.fit_loop.epoch_loop, trainer.fit_loop.epoch_loop.val_loop):
        loop._results.reset()
    for metric in _metric_modules(trainer.lightning_module).values():
        metric.reset()
    connector = trainer._logger_connector
    connector._first_loop_iter = None
    connector._current_fx = None
