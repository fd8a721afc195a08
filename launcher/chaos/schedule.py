"""A seeded random failure schedule for a data-parallel job of ``nnodes x nproc`` ranks.

Failures arrive as a Poisson process of *incidents* with mean gap ``mtbf_s`` seconds of
failure-free training progress; ``step_s`` (the failure-free step time, measured by
the reference run) turns each arrival into the step at which it fires. Positioning
failures by progress (not by wall clock) makes the schedule a pure function of
``(seed, mtbf_s, step_s, steps, topology, mix)``: both systems under comparison meet
the same failures at the same points of training, every run of a seed is the same,
and a schedule that found a bug is its own reproduction (``Schedule.runtime_spec``
is the ``recovery.fault=...`` override, ``Schedule.to_json`` the whole thing).

An incident is one of (weights in :data:`DEFAULT_MIX`):

- ``sigkill``, ``sigstop`` (a hang), ``exception``, ``node`` (the rank's agent and
  every process on that node): one rank, one phase of one step;
- ``simultaneous``: two ranks fail in the same step;
- ``during_recovery``: a rank fails, and a second one fails while the job recovers
  from the first (phase ``recovery`` of the same step, on a survivor); the second
  may take its whole node with it;
- ``storage``: the durable tier's storage fails for ``duration_s`` seconds from that
  step on (training must go on);
- ``total_loss`` (weight 0 unless asked for): a rank and every holder of its replicas
  fail at once, so no in-memory copy of its state survives. In-process recovery is
  impossible by design; the job must fall back to the durable tier or say why not.

Every other incident keeps at least one copy of every rank's state (checked against
the replica placement), and never loses the node that hosts the job's store (node 0,
whose loss ends the job by design, as with torchrun's c10d store).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

from replication.errors import CheckpointlessError
from replication.replica_protocol.placement import place_replicas

KINDS = ("sigkill", "sigstop", "exception", "node")
INCIDENTS = ("sigkill", "sigstop", "exception", "node", "simultaneous", "during_recovery",
             "storage", "total_loss")

DEFAULT_MIX: dict[str, float] = {
    "sigkill": 0.28, "sigstop": 0.12, "exception": 0.14, "node": 0.10, "simultaneous": 0.14,
    "during_recovery": 0.12, "storage": 0.10, "total_loss": 0.0,
}

#: Phases every failing rank can be hit in. ``snapshot`` and ``replication`` are the
#: runtime's own phases (the baseline plays them at the end of the step).
KILL_PHASES = ("step", "forward", "backward", "optimizer", "snapshot", "replication")
#: Exceptions come from the training code, not from the runtime's background round.
EXCEPTION_PHASES = ("step", "forward", "backward", "optimizer")
#: A fault in the recovery phase needs every survivor to be inside step ``s`` when it
#: detects the first failure, which the phases before the gradient all-reduce guarantee.
PRIMARY_FOR_RECOVERY = ("forward", "backward")


class ScheduleError(CheckpointlessError, ValueError):
    """A schedule cannot be built from these parameters (the message names which)."""


@dataclass(frozen=True)
class Topology:
    """The job's shape: node groups of ``nproc`` ranks; group 0 hosts the store."""

    nnodes: int = 2
    nproc: int = 2
    factor: int = 2
    placement: str = "ring"

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc

    def group_of(self, rank: int) -> int:
        return rank // self.nproc

    def ranks_of(self, group: int) -> list[int]:
        return list(range(group * self.nproc, (group + 1) * self.nproc))

    def holders(self) -> list[list[int]]:
        """For each rank, the ranks holding its replicas (the runtime's placement)."""
        groups = [self.group_of(r) for r in range(self.world)]
        return place_replicas(groups, self.factor, self.placement, allow_same_node=True)

    def lost_state(self, dead: set[int]) -> list[int]:
        """Ranks none of whose copies (own + replicas) survive when ``dead`` ranks die."""
        return [r for r, hs in enumerate(self.holders())
                if r in dead and all(h in dead for h in hs)]


@dataclass(frozen=True)
class Fault:
    """One injected failure. ``rank`` is -1 for storage outages."""

    incident: int
    step: int
    rank: int
    phase: str
    kind: str  # sigkill | sigstop | exception | node | storage
    role: str = "primary"  # primary | simultaneous | during_recovery | total_loss
    duration_s: float = 0.0  # storage outages only

    @property
    def spec(self) -> str:
        """The ``rank:step:phase:kind`` entry of ``recovery.fault`` (not for storage)."""
        if self.kind == "storage":
            raise ValueError("a storage outage is not a runtime fault spec")
        return f"{self.rank}:{self.step}:{self.phase}:{self.kind}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    mtbf_s: float
    step_s: float
    steps: int
    topology: Topology
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    @property
    def process_faults(self) -> list[Fault]:
        return [f for f in self.faults if f.kind != "storage"]

    @property
    def storage_outages(self) -> list[Fault]:
        return [f for f in self.faults if f.kind == "storage"]

    @property
    def node_losses(self) -> int:
        return sum(f.kind == "node" for f in self.faults)

    @property
    def incidents(self) -> int:
        return len({f.incident for f in self.faults})

    def runtime_spec(self) -> str:
        """The ``recovery.fault`` value that injects every process fault."""
        return ";".join(f.spec for f in self.process_faults)

    def to_json(self) -> dict:
        return {"seed": self.seed, "mtbf_s": self.mtbf_s, "step_s": self.step_s,
                "steps": self.steps, "topology": asdict(self.topology),
                "faults": [asdict(f) for f in self.faults]}


@dataclass(frozen=True)
class _Ctx:
    rng: random.Random
    topo: Topology
    incident: int
    step: int


def generate(
    *,
    seed: int,
    mtbf_s: float,
    step_s: float,
    steps: int,
    topology: Topology = Topology(),
    mix: Mapping[str, float] | None = None,
    warmup_steps: int = 20,
    tail_steps: int = 10,
    min_gap_steps: int = 3,
    node_gap_s: float = 8.0,
    min_failures: int = 0,
    storage_s: tuple[float, float] = (1.5, 4.0),
) -> Schedule:
    """Draw the schedule (see the module docstring).

    Incidents are at least ``min_gap_steps`` apart (an arrival closer than that to the
    previous one is pushed back), node losses at least ``node_gap_s`` seconds of
    progress apart (the next spare node must have started; a node loss drawn closer
    becomes a ``sigkill``). If the Poisson draw yields fewer than ``min_failures``
    faults, further incidents are placed at uniformly random free steps until it does.
    """
    if mtbf_s <= 0 or step_s <= 0:
        raise ScheduleError(f"mtbf_s and step_s must be > 0, got {mtbf_s}, {step_s}")
    first, last = warmup_steps, steps - tail_steps
    if last <= first:
        raise ScheduleError(f"steps={steps} leaves no room after {warmup_steps} warm-up and "
                            f"{tail_steps} tail steps")
    weights = dict(DEFAULT_MIX if mix is None else mix)
    unknown = set(weights) - set(INCIDENTS)
    if unknown:
        raise ScheduleError(f"unknown incident kinds {sorted(unknown)}; known: {INCIDENTS}")
    if topology.nnodes < 2 or topology.factor < 2:
        raise ScheduleError("a chaos schedule needs >= 2 nodes and replication.factor >= 2")
    if sum(weights.values()) <= 0:
        raise ScheduleError("the incident mix has no positive weight")
    rng = random.Random(seed)
    mean_gap = mtbf_s / step_s
    positions: list[int] = []
    t = float(first)
    while True:
        t += rng.expovariate(1.0 / mean_gap)
        step = max(round(t), positions[-1] + min_gap_steps if positions else first)
        if step > last:
            break
        positions.append(step)
    names = sorted(weights)
    faults: list[Fault] = []

    def add(incident: int, step: int) -> None:
        node_ok = all(abs(f.step - step) * step_s >= node_gap_s
                      for f in faults if f.kind == "node")
        kind = rng.choices(names, [weights[n] for n in names])[0]
        if kind == "node" and not node_ok:
            kind = "sigkill"
        faults.extend(_draw(kind, _Ctx(rng, topology, incident, step), node_ok=node_ok,
                            storage_s=storage_s))

    for incident, step in enumerate(positions):
        add(incident, step)
    taken = set(positions)
    while len(faults) < min_failures:
        free = [s for s in range(first, last + 1)
                if all(abs(s - p) >= min_gap_steps for p in taken)]
        if not free:
            raise ScheduleError(f"cannot place {min_failures} failures in steps "
                                f"{first}..{last} at least {min_gap_steps} apart")
        step = rng.choice(free)
        add(len(taken), step)
        taken.add(step)
    faults.sort(key=lambda f: (f.step, f.incident, f.role != "primary"))
    return Schedule(seed, mtbf_s, step_s, steps, topology, tuple(faults))


def _draw(kind: str, c: _Ctx, *, node_ok: bool, storage_s: tuple[float, float]) -> list[Fault]:
    rng, topo = c.rng, c.topo
    remote = [r for r in range(topo.world) if topo.group_of(r) != 0]  # not the store's node

    def one(rank: int, kind: str, role: str = "primary", phase: str | None = None) -> Fault:
        phases = EXCEPTION_PHASES if kind == "exception" else KILL_PHASES
        return Fault(c.incident, c.step, rank, phase or rng.choice(phases), kind, role)

    if kind in ("sigkill", "sigstop", "exception"):
        return [one(rng.randrange(topo.world), kind)]
    if kind == "node":
        return [one(rng.choice(remote), "node")]
    if kind == "storage":
        lo, hi = storage_s
        return [Fault(c.incident, c.step, -1, "step", "storage", "primary",
                      round(rng.uniform(lo, hi), 2))]
    if kind == "simultaneous":
        pairs = [(a, b) for a in range(topo.world) for b in range(a + 1, topo.world)
                 if not topo.lost_state({a, b})]
        a, b = rng.choice(pairs)
        kinds = ("sigkill", "sigkill", "exception", "sigstop")
        return [one(a, rng.choice(kinds)), one(b, rng.choice(kinds), "simultaneous")]
    if kind == "during_recovery":
        first = rng.randrange(topo.world)
        first_kind = rng.choice(("sigkill", "sigkill", "exception"))
        dead_first = {first} if first_kind != "exception" else set()
        options = []
        for b in range(topo.world):
            if b == first:
                continue
            options.append((b, "sigkill", dead_first | {b}))
            if node_ok and topo.group_of(b) != 0:
                options.append((b, "node", dead_first | set(topo.ranks_of(topo.group_of(b)))))
        options = [o for o in options if not topo.lost_state(o[2])]
        b, second_kind, _ = rng.choice(options)
        return [one(first, first_kind, phase=rng.choice(PRIMARY_FOR_RECOVERY)),
                one(b, second_kind, "during_recovery", phase="recovery")]
    if kind == "total_loss":
        rank = rng.randrange(topo.world)
        holders = topo.holders()[rank]
        return [one(r, "sigkill", "total_loss", phase=rng.choice(PRIMARY_FOR_RECOVERY))
                for r in [rank, *holders]]
    raise ScheduleError(f"unknown incident kind {kind!r}")


def parse_mix(text: str) -> dict[str, float]:
    """``kind=weight,kind=weight`` over :data:`DEFAULT_MIX` (unnamed kinds keep theirs)."""
    mix = dict(DEFAULT_MIX)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in INCIDENTS:
            raise ScheduleError(f"--mix entry {part!r}: expected KIND=WEIGHT with KIND in "
                                f"{', '.join(INCIDENTS)}")
        try:
            mix[name] = float(value)
        except ValueError:
            raise ScheduleError(f"--mix entry {part!r}: weight must be a number") from None
        if mix[name] < 0:
            raise ScheduleError(f"--mix entry {part!r}: weight must be >= 0")
    return mix


def describe(faults: Sequence[Fault]) -> str:
    """One line per incident, for logs and reports."""
    by: dict[int, list[Fault]] = {}
    for f in faults:
        by.setdefault(f.incident, []).append(f)
    lines = []
    for fs in sorted(by.values(), key=lambda fs: fs[0].step):
        parts = [_words(f) for f in fs]
        lines.append(f"step {fs[0].step}: " + " + ".join(parts))
    return "\n".join(lines)


def _words(f: Fault) -> str:
    if f.kind == "storage":
        return f"storage outage {f.duration_s}s"
    role = "" if f.role == "primary" else f", {f.role}"
    return f"{f.kind} rank {f.rank} ({f.phase}{role})"


def from_json(data: Mapping) -> Schedule:
    """The inverse of :meth:`Schedule.to_json` (replays a recorded schedule)."""
    topo = Topology(**data["topology"])
    faults = tuple(Fault(**f) for f in data["faults"])
    return Schedule(int(data["seed"]), float(data["mtbf_s"]), float(data["step_s"]),
                    int(data["steps"]), topo, faults)


def dumps(schedule: Schedule) -> str:
    return json.dumps(schedule.to_json(), indent=1)
