"""The fault-injection syntax, kept free of torch so the recipe validator can use it.

Tests, benchmarks and users name faults as ``rank:step:phase[:kind]`` (several joined
by ``;``) in ``recovery.fault`` or the ``CHECKPOINTLESS_RECOVERY_FAULT`` variable.
Phases: ``step`` (start of the step), ``forward``, ``backward``, ``optimizer``,
``snapshot`` and ``replication`` (the first snapshot at or after its step: which steps
are snapshotted is the interval's choice), ``recovery`` (the first recovery this rank
enters from one step before its step on) and ``setup`` (in that recovery, once the
generation's plan is agreed and before its process groups connect). Kinds: ``sigkill``
(default), ``sigstop`` (a hang), ``exception`` and ``node`` (the rank's whole node:
its agent and every process in the agent's process group).
"""

from __future__ import annotations

from dataclasses import dataclass

from replication.errors import CheckpointlessError

#: Read by a worker started without ``checkpointless run`` (no recipe reaches it); under
#: the launcher the recipe layer reads it like any ``CHECKPOINTLESS_<SECTION>_<KEY>``.
FAULT_ENV = "CHECKPOINTLESS_RECOVERY_FAULT"
PHASES = ("step", "forward", "backward", "optimizer", "snapshot", "replication", "recovery",
          "setup", "save")  # save: after a framework checkpoint's first file, not its last
KINDS = ("sigkill", "sigstop", "exception", "node")


class FaultSpecError(CheckpointlessError, ValueError):
    """A malformed fault specification (the message names the part at fault)."""


@dataclass(frozen=True)
class FaultSpec:
    rank: int
    step: int
    phase: str
    kind: str = "sigkill"

    def __str__(self) -> str:
        return f"{self.rank}:{self.step}:{self.phase}:{self.kind}"


def parse_faults(text: str) -> list[FaultSpec]:
    """Parse ``rank:step:phase[:kind]`` entries separated by ``;``."""
    specs = []
    for item in filter(None, (p.strip() for p in text.split(";"))):
        parts = item.split(":")
        if len(parts) not in (3, 4):
            raise FaultSpecError(f"fault {item!r}: expected rank:step:phase[:kind]")
        try:
            rank, step = int(parts[0]), int(parts[1])
        except ValueError:
            raise FaultSpecError(f"fault {item!r}: rank and step must be integers") from None
        phase = parts[2]
        kind = parts[3] if len(parts) == 4 else "sigkill"
        if phase not in PHASES:
            raise FaultSpecError(f"fault {item!r}: phase {phase!r} not in {', '.join(PHASES)}")
        if kind not in KINDS:
            raise FaultSpecError(f"fault {item!r}: kind {kind!r} not in {', '.join(KINDS)}")
        specs.append(FaultSpec(rank, step, phase, kind))
    return specs


