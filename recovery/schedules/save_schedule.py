"""When a durable save falls due: at the first snapshot at or after each multiple of
``persistence.every_n_steps``, so a save slips with its snapshot instead of vanishing.

A durable save persists a committed snapshot, so it can only be made at a step that
was snapshotted. The old rule, "steps that are a multiple of the interval", dropped
every save whose step had no snapshot: the Lightning strategy moves the snapshot due at
an epoch's last step to the next step (resuming at an epoch's first batch would run
``on_train_epoch_start`` twice), and a snapshot interval that does not divide the save
interval has snapshots at other steps altogether. With epochs of ten steps and a save
every ten, a forty-step run kept one checkpoint where four were asked for.

The rule here: a committed snapshot of step ``s`` is saved when a multiple of the
interval lies in ``(p, s]``, ``p`` being the snapshot before it. That needs ``p`` for
every snapshot, on every rank alike, a replacement included, and after a rollback. So
:class:`SaveSchedule` is part of the training state (registered as
``_save_schedule``): the capture of ``s`` carries ``(s, p)``, and a rank restored to
``s`` knows ``p`` like the ranks that captured it. That lets a recovery make the save
due at its target step when some rank had not yet handed it to its writer (the kill came
between the commit and the next step's end), so a run with failures keeps the same
checkpoints as one without (:meth:`recovery.durable.tier.DurableTier.after_recovery`).
"""

from __future__ import annotations

#: Snapshots whose predecessor is kept: a commit is decided at most a step after its
#: capture, so a few suffice; bounded so a long run does not grow the map.
KEPT = 8


def crosses(previous: int, step: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(previous, step]``."""
    return every > 0 and step // every > previous // every


class SaveSchedule:
    """The snapshot steps captured lately, each with the one before it (see the module
    docstring). A training-state entry: ``state_dict`` is the capture in progress."""

    def __init__(self) -> None:
        self.step: int | None = None  # the newest snapshot's step
        self._previous: dict[int, int | None] = {}

    def before_capture(self, step: int) -> None:
        """``step`` is about to be snapshotted (its capture includes this entry)."""
        if step == self.step:
            return  # the same step captured again (a restore re-snapshots it)
        self._previous[step] = self.step
        self.step = step
        for old in sorted(self._previous)[:-KEPT]:
            del self._previous[old]

    def previous(self, step: int) -> int | None:
        """The snapshot step before ``step``'s, or None when unknown (``step`` was not
        captured here nor restored, or it was the first snapshot)."""
        return self._previous.get(step)

    def state_dict(self) -> dict[str, int]:
        if self.step is None:
            return {}
        prev = self._previous.get(self.step)
        return {"step": self.step, **({"previous": prev} if prev is not None else {})}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """A restore (a rollback, a replacement's handover, a durable checkpoint): the
        snapshots after the restored one never happened."""
        self._previous.clear()
        self.step = int(sd["step"]) if "step" in sd else None
        if self.step is not None:
            self._previous[self.step] = int(sd["previous"]) if "previous" in sd else None
