"""``examples/train_gpt.py`` with one weight changed in place while a snapshot copies it.

The overlapped capture (ADR 0013) assumes only ``optimizer.step()`` changes weights
between a snapshot and the next update. This script breaks that once, on purpose:
``--tear RANK:STEP`` makes that rank's round for ``STEP`` wait before copying (a slow
copier, as under load), then multiplies a weight by 1.0 in place, which torch counts as
a change. The snapshot of ``STEP`` is then torn as far as the engine can tell: it must
never be committed, the job must recover to the step before and finish, and the final
state must equal a run without the change (multiplying by 1.0 changes no value).

The runtime is subclassed here only to reach the step boundaries of ``cl.run``; the
training loop itself is ``examples/train_gpt.py``'s, unchanged.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

import examples.train_gpt as base
import recovery


def _parse_tear(argv: list[str]) -> tuple[int, int]:
    """Take ``--tear RANK:STEP`` out of ``argv`` (the rest goes to train_gpt)."""
    i = argv.index("--tear")
    rank, step = (int(v) for v in argv[i + 1].split(":"))
    del argv[i:i + 2]
    return rank, step


TEAR_RANK, TEAR_STEP = _parse_tear(sys.argv)
#: How long the round for TEAR_STEP waits before it starts copying.
COPY_DELAY_S = 1.0


class TearingCheckpointless(recovery.Checkpointless):
    """Tears its own snapshot of ``TEAR_STEP`` once, on ``TEAR_RANK``."""

    def __init__(self, *args, model: torch.nn.Module, **kwargs) -> None:
        super().__init__(*args, model=model, **kwargs)
        self._model = model
        self._torn = int(os.environ.get("RANK", 0)) != TEAR_RANK

    def _before_step(self, step: int) -> None:
        super()._before_step(step)
        if not self._torn and step == TEAR_STEP:
            engine = self.replicator.engine
            seal = engine.seal

            def slow_seal(slot, **kwargs):
                if slot.step == TEAR_STEP and threading.current_thread() is not main:
                    time.sleep(COPY_DELAY_S)
                return seal(slot, **kwargs)

            main = threading.current_thread()
            engine.seal = slow_seal

    def _after_step(self, step: int, snapshot: bool | None = None) -> None:
        super()._after_step(step, snapshot)
        if not self._torn and step == TEAR_STEP:
            self._torn = True
            weight = next(self._model.parameters())
            with torch.no_grad():
                weight.mul_(1.0)  # same values, a new version: "changed"
            print(f"[rank {self.rank}] changed {tuple(weight.shape)} in place after the "
                  f"snapshot of step {step}", flush=True)


if __name__ == "__main__":
    base.Checkpointless = TearingCheckpointless
    base.main()
