"""The strategy's launcher: runs ``fit`` in a recover-and-retry loop, in this process.

Lightning calls ``strategy.launcher.launch(trainer_fn, ...)`` for every trainer entry
point when the strategy has a launcher. For ``fit`` this one joins the job (a replacement
receives its state from a peer here, before Lightning builds anything), then calls
``_fit_impl``. When it raises (a peer died, a collective failed, this rank's own step
failed), Lightning's objects from the failed attempt are torn down, the runtime
recovers (new generation, restore of the newest committed step), and ``_fit_impl`` is
entered again with the restored state as its checkpoint, so Lightning's own resume
path puts model, optimizers, schedulers, loops, callbacks and data position back.
The script sees one ``fit`` call that returns when training is done.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from recovery.common.errors import RecoveryImpossible
from recovery.integrations.lightning import loop_state
from replication.training_state.codec import CodecError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from recovery.integrations.lightning.strategy import CheckpointlessStrategy

log = logging.getLogger("checkpointless.lightning")


def _not_recoverable() -> tuple[type[BaseException], ...]:
    """Errors a retry cannot fix: interrupts, configuration, exits Lightning asks for."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    kinds: list[type[BaseException]] = [RecoveryImpossible, CodecError,
                                        MisconfigurationException, SIGTERMException]
    try:
        from lightning.pytorch.utilities.exceptions import _TunerExitException

        kinds.append(_TunerExitException)
    except ImportError:  # pragma: no cover - older Lightning
        pass
    return tuple(kinds)


class CheckpointlessLauncher(_Launcher):
    """Recover-and-retry around ``Trainer._fit_impl`` (see the module docstring)."""

    def __init__(self, strategy: CheckpointlessStrategy) -> None:
        self._strategy = strategy

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher starts no processes (the agent owns them)."""

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None,
               **kwargs: Any) -> Any:
        strategy = self._strategy
        session = strategy.join_job()
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return function(*args, **kwargs)
        if strategy.finished:
            raise RuntimeError("strategy='checkpointless' supports one fit() per process; "
                               "build a new Trainer (and job) to train again")
        bound = inspect.signature(function).bind(*args, **kwargs)
        resume = strategy.has_restored_state
        if resume and bound.arguments.get("ckpt_path"):
            log.info("resuming from the state the checkpointless runtime restored; "
                     "ckpt_path=%r is not used", bound.arguments["ckpt_path"])
        fatal = _not_recoverable()
        while True:
            if resume:
                bound.arguments["ckpt_path"] = strategy.memory_ckpt_path
                strategy.pin_logger_versions(trainer)
            try:
                with warnings.catch_warnings():
                    if resume:  # the directory is ours: the run being continued wrote it
                        warnings.filterwarnings(
                            "ignore", message=r"Checkpoint directory .* exists and is not empty")
                    result = function(*bound.args, **bound.kwargs)
                session.finish(destroy_group=False)
                strategy.finished = True
                return result
            except fatal:
                raise
            except Exception as exc:
                if not session.settings.recovery.enabled:
                    raise
                self._abandon_attempt(trainer)
                strategy.recover(exc)
                _before_refit(trainer, exc)
                resume = True

    @staticmethod
    def _abandon_attempt(trainer: pl.Trainer) -> None:
        """Release what the failed attempt built, the way Lightning does after an error,
        minus the ``on_exception`` hooks and logger finalisation: training goes on. The
        strategy's teardown sees ``abandoning`` and leaves the model and the optimizer
        state on their device (``CheckpointlessStrategy._release_attempt``)."""
        strategy = trainer.strategy
        trainer.training = True  # the fit loop is the one to tear down, even mid-validation
        strategy.abandoning = True  # type: ignore[attr-defined]
        try:
            trainer._teardown()
            loop_state.discard_attempt(trainer)
        except Exception as exc:  # best effort: the state is restored from a snapshot anyway
            log.warning("teardown after a failure raised %r; continuing with the recovery", exc)
        finally:
            strategy.abandoning = False  # type: ignore[attr-defined]
        trainer.state.status = TrainerStatus.RUNNING
        trainer.training = True
        trainer.should_stop = False


def _before_refit(trainer: pl.Trainer, exc: BaseException) -> None:
    """Let integrations and callbacks close what the failed attempt left open.

    Callbacks may implement ``on_checkpointless_recovery(trainer, pl_module, exception)``
    (an opt-in hook of this strategy; Lightning's ``on_exception`` is not called because
    training goes on). NeMo's telemetry spans are closed automatically when NeMo is
    loaded (:mod:`recovery.integrations.nemo`).
    """
    import sys

    if "nemo" in sys.modules:
        from recovery.integrations import nemo

        nemo.before_refit(trainer)
    for cb in trainer.callbacks:
        hook = getattr(cb, "on_checkpointless_recovery", None)
        if callable(hook):
            hook(trainer, trainer.lightning_module, exc)
