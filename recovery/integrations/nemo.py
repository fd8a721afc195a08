"""NeMo support: what an in-process recovery needs beyond the Lightning strategy.

NeMo 3.x (``nemo_toolkit`` 3.0, Lightning 2.4) trains through plain Lightning, so the
strategy is the same :class:`~recovery.integrations.lightning.CheckpointlessStrategy`,
named in NeMo's Hydra config as a ``_target_`` entry (see ``examples/nemo_gpt.yaml``).
One thing differs. NeMo attaches a telemetry callback (OneLogger's ``TimeEventCallback``,
through ``nemo.lightning.callback_group``) to every Trainer; it opens a
``training_loop`` span in ``on_train_start`` and refuses to open a second one while the
first is active. A failed ``fit`` attempt never reaches ``on_train_end``, so the attempt
after a recovery would die in ``on_train_start`` ("Cannot start span training_loop while
1 span(s) with the same name is already active") and every retry with it.

:func:`close_interrupted_spans` ends the spans the failed attempt left open, innermost
first, through OneLogger's public callback functions; the strategy's launcher calls it
(via :func:`before_refit`) whenever NeMo's telemetry is loaded in the process.
:class:`CheckpointlessNeMoCallback` does the same as an explicit Lightning callback for
configurations that prefer to list it under ``trainer.callbacks``.

NeMo 2.x's ``MegatronStrategy`` is not supported: it needs Megatron-Core and GPUs,
neither of which exists here, and NeMo 3.x no longer ships it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from lightning.pytorch.callbacks import Callback

log = logging.getLogger("checkpointless.nemo")

#: OneLogger spans a fit attempt can leave open, innermost first, with the callback
#: function (in ``nv_one_logger.training_telemetry.api.callbacks``) that ends each.
_SPANS = (
    ("validation_single_iteration", "on_validation_single_iteration_end"),
    ("validation_loop", "on_validation_end"),
    ("training_single_iteration", "on_training_single_iteration_end"),
    ("training_loop", "on_train_end"),
)


def telemetry_loaded() -> bool:
    """True when NeMo's OneLogger telemetry is imported in this process."""
    return "nv_one_logger.training_telemetry.api.callbacks" in sys.modules


def close_interrupted_spans() -> list[str]:
    """End the OneLogger spans a failed ``fit`` attempt left open; returns their names.

    A no-op (empty list) when OneLogger is not loaded or not enabled on this rank.
    """
    if not telemetry_loaded():
        return []
    from nv_one_logger.api.one_logger_provider import OneLoggerProvider
    from nv_one_logger.training_telemetry.api import callbacks
    from nv_one_logger.training_telemetry.api.training_telemetry_provider import (
        TrainingTelemetryProvider,
    )

    if not OneLoggerProvider.instance().one_logger_enabled:
        return []
    recorder = TrainingTelemetryProvider.instance().recorder
    closed = []
    for name, end in _SPANS:
        try:
            active = recorder.get_active_spans_by_name(name)
        except Exception as exc:  # telemetry must never stop a recovery
            log.warning("cannot inspect OneLogger span %s: %r", name, exc)
            continue
        if not active:
            continue
        try:
            getattr(callbacks, end)()
        except Exception as exc:
            log.warning("OneLogger's %s raised %r", end, exc)
        for span in recorder.get_active_spans_by_name(name):  # not ended by its callback
            try:
                recorder.stop(span)
            except Exception as exc:
                log.warning("cannot end OneLogger span %s: %r", name, exc)
        closed.append(name)
    if closed:
        log.info("ended telemetry spans of the interrupted fit attempt: %s", closed)
    return closed


def before_refit(trainer: Any) -> None:
    """What NeMo needs before ``fit`` is entered again after a recovery."""
    close_interrupted_spans()
    detach_group_callbacks(trainer)
    warn_if_validation_is_skipped(trainer)


def warn_if_validation_is_skipped(trainer: Any) -> bool:
    """Warn when NeMo's epoch loop will skip the validation due at the resumed step.

    ``exp_manager`` (``disable_validation_on_resume: true``, its default) replaces the
    epoch loop with one that skips validation right after a restore, because NeMo's
    checkpoints are written after validation. Checkpointless snapshots are taken before
    it, so the replay must run it again; skipping it shifts the RNG draws of the
    validation data loader and the run stops being identical to a failure-free one.
    """
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if type(loop).__name__ != "SkipResumeTrainingValidationLoop":
        return False
    global _warned_skip
    if not _warned_skip:
        _warned_skip = True
        log.warning("exp_manager.disable_validation_on_resume is true: NeMo skips the "
                    "validation due at the step this recovery resumes from, so the run will "
                    "not be bit-identical to a failure-free one. Set it to false (see "
                    "examples/nemo_gpt.yaml).")
    return True


_warned_skip = False


def detach_group_callbacks(trainer: Any) -> list[Any]:
    """Take NeMo's lifecycle callbacks off the trainer; returns those removed.

    ``ModelPT.setup("fit")`` attaches them with ``CallbackGroup.update_config``, which
    prepends the group's callbacks to ``trainer.callbacks`` without checking whether
    they are already there. The next ``fit`` attempt runs ``setup`` again, so without
    this every hook of the telemetry callback would run twice per attempt.
    """
    try:
        from nemo.lightning.callback_group import CallbackGroup
    except ImportError:
        return []
    group = {id(cb) for cb in CallbackGroup.get_instance().callbacks}
    kept = [cb for cb in trainer.callbacks if id(cb) not in group]
    removed = [cb for cb in trainer.callbacks if id(cb) in group]
    if removed:
        trainer.callbacks = kept
    return removed


class CheckpointlessNeMoCallback(Callback):
    """Ends NeMo telemetry spans of an interrupted ``fit`` attempt (explicit form).

    The strategy's launcher calls ``on_checkpointless_recovery`` on every callback that
    has it, after tearing the failed attempt down and before entering ``fit`` again.
    """

    def on_checkpointless_recovery(self, trainer: Any, pl_module: Any,
                                   exception: BaseException) -> None:
        close_interrupted_spans()
