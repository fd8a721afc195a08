"""How often to snapshot: the interval that costs least, within an overhead budget.

``replication.every_n_steps: auto`` (and ``persistence.every_n_steps: auto``) hands the
choice to this module. The runtime pays a cost on every snapshot (the loop's stall, and
on a host whose cores also train, the round's CPU time taken from the step); a failure
costs the work done since the newest committed snapshot. Snapshotting more often
lowers the second and raises the first. The module is pure arithmetic over measured
inputs, so it can be tested without a job and reused by the benchmarks' goodput model:

- :func:`choose_interval` turns measured costs (step time, the added seconds per
  snapshot, the round's duration, recovery time, MTBF) into an interval in steps, with
  the reasons as text;
- :class:`IntervalPolicy` is fed one step at a time (its wall time, and whether a
  snapshot was taken after it), learns the step's own time and the snapshot's added
  time, and re-evaluates when they change.

The rule. With the added time per snapshot ``c`` and a step of ``t`` seconds, an
interval of ``n`` steps costs the fraction ``c / (n t)`` of training. The budget
(``replication.max_overhead``, default 0.02) gives the shortest allowed interval,
``n_budget = ceil(c / (budget t))``. With an MTBF ``M`` and a recovery time ``R``,
Daly's first-order optimum ``tau = sqrt(2 c (M + R)) - c`` (Young's ``sqrt(2 c M)``
when ``c`` and ``R`` are small against ``M``) minimises the expected time lost to
snapshots plus rework; it is used when it is longer than ``n_budget``. Without an MTBF
the shortest interval within the budget is taken: least rework for what the user
agreed to pay. A round that lasts longer than the interval makes the next snapshot
wait for it, so the interval is at least the round's length in steps.

The durable tier (``persistence.every_n_steps: auto``, ADR 0027) takes the same rule
with its own inputs, learnt by :class:`SavePolicy`: ``c`` is what a save's helper
process adds to the steps it overlaps (host contention, measured against steps at the
same distance from a snapshot with no save in flight), the budget is
``persistence.max_overhead`` (default 0.01), ``M`` is the time between losses that
memory cannot recover, and the interval is at least as long as the slowest recent save
(the writer skips a save due while the previous one runs) and a multiple of the
snapshot interval (only committed snapshots are persisted).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

DEFAULT_BUDGET = 0.02
"""``replication.max_overhead``'s default: 2 % of step time for snapshots."""

DEFAULT_SAVE_BUDGET = 0.01
"""``persistence.max_overhead``'s default: 1 % of step time for durable saves."""

ASSUMED_MTBF_S = 3 * 3600.0
"""The job's MTBF ``every_n_steps: auto`` assumes while it has seen no failure and
``recovery.mtbf_s`` is unset (ADR 0032): about the rate published for a large job (Meta's
Llama 3 405B on 16,384 GPUs: 419 unexpected interruptions in 54 days, one every 3.1 h).
Assuming failures more often than they come costs little (a snapshot's cost spread over
Daly's interval for it, well under the budget); assuming them rarer would cost a long
replay on each. Once failures are seen, their observed rate replaces it."""

MAX_INTERVAL = 10_000
"""The longest interval chosen: beyond it the in-memory copy is rarely fresh enough to
be worth keeping, and a misestimated cost cannot push snapshots off entirely."""


@dataclass(frozen=True)
class Choice:
    """An interval and why it was chosen."""

    every_n_steps: int
    overhead: float
    """Expected fraction of training time spent on snapshots at this interval."""
    reasons: tuple[str, ...]
    n_budget: int
    n_daly: int | None
    n_round: int

    @property
    def text(self) -> str:
        return f"every {self.every_n_steps} steps: " + "; ".join(self.reasons)

    @property
    def budget_bound(self) -> bool:
        """Whether the budget (the measured cost) set the interval, not Daly's rule."""
        return self.every_n_steps == self.n_budget


def daly_interval_s(cost_s: float, mtbf_s: float, recovery_s: float = 0.0) -> float:
    """Daly's first-order optimum interval (seconds of work between snapshots).

    ``sqrt(2 c (M + R)) - c`` for ``c < 2 M``; ``M`` itself beyond (the snapshot costs
    as much as a failure: snapshot as rarely as sensible). Young's formula is the
    ``R = 0``, small-``c`` limit."""
    c, m = max(cost_s, 0.0), max(mtbf_s, 1e-9)
    if c >= 2 * m:
        return m
    return max(math.sqrt(2 * c * (m + max(recovery_s, 0.0))) - c, 0.0)


def choose_interval(
    *,
    step_s: float,
    snapshot_cost_s: float,
    budget: float = DEFAULT_BUDGET,
    round_s: float = 0.0,
    recovery_s: float = 0.0,
    mtbf_s: float | None = None,
    max_interval: int = MAX_INTERVAL,
    kind: str = "snapshot",
    mtbf_note: str = "",
) -> Choice:
    """The interval in steps for the measured costs (see the module docstring).

    ``step_s``: a step's time without snapshots; ``snapshot_cost_s``: the training time
    one snapshot adds (stall plus what its round takes from the step; negative
    measurements count as 0); ``round_s``: how long a round runs in the background;
    ``recovery_s``: the time a recovery takes (detect, restore, rejoin); ``mtbf_s``:
    mean time between failures of the job, or None when unknown. ``kind="save"``
    words the reasons for a durable save (``snapshot_cost_s``: what one save adds,
    ``round_s``: how long one lasts); ``mtbf_note`` says where the MTBF came from."""
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s}")
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if kind not in _WORDS:
        raise ValueError(f"kind must be one of {sorted(_WORDS)}, got {kind!r}")
    what, lasts, waits = _WORDS[kind]
    c = max(snapshot_cost_s, 0.0)
    reasons: list[str] = []
    n_budget = max(1, math.ceil(c / (budget * step_s) - 1e-9))
    reasons.append(f"{what} adds {c * 1e3:.1f} ms to a {step_s * 1e3:.1f} ms step, so "
                   f"{n_budget} step(s) keep it within the {budget:.1%} budget")
    n_round = max(1, math.ceil(round_s / step_s - 1e-9)) if round_s > 0 else 1
    n = max(n_budget, n_round)
    if n_round > n_budget:
        reasons.append(f"{lasts} {round_s * 1e3:.1f} ms ({n_round} steps); a shorter "
                       f"interval would {waits}")
    n_daly: int | None = None
    if mtbf_s is not None and mtbf_s > 0:
        tau = daly_interval_s(c, mtbf_s, recovery_s)
        n_daly = max(1, round(tau / step_s))
        rework = n * step_s / 2 / mtbf_s  # the fraction lost to replays at interval n
        if n_daly > n:
            rec = f" and recovery of {recovery_s:.1f} s" if recovery_s > 0 else ""
            reasons.append(f"with an MTBF of {mtbf_s:.0f} s{mtbf_note}{rec}, Daly's optimum "
                           f"is {tau:.1f} s of work ({n_daly} steps), which loses less time "
                           "in all than the budget's shortest interval")
            n = n_daly
        elif kind == "snapshot" and rework > budget and max(n_daly, n_round) < n:
            # Failures so frequent that the budget's interval loses more to replayed
            # work than the budget itself: its premise (little is lost) fails, and
            # snapshotting as seldom as it says would let failures outrun the commits.
            n_opt = max(n_daly, n_round)
            reasons.append(f"failures come so often (an MTBF of {mtbf_s:.0f} s{mtbf_note}) "
                           f"that replays would lose {rework:.0%} of the time at that "
                           f"interval, more than the budget: Daly's optimum, {n_opt} "
                           f"steps, whose {what[2:]}s add {c / (n_opt * step_s):.1%}")
            n = n_opt
        else:
            reasons.append(f"Daly's optimum for an MTBF of {mtbf_s:.0f} s{mtbf_note} "
                           f"({n_daly} steps) would exceed the budget; the budget wins")
    else:
        reasons.append("no MTBF given: the shortest interval within the budget (least rework)")
    if n > max_interval:
        reasons.append(f"capped at {max_interval} steps")
        n = max_interval
    return Choice(n, c / (n * step_s), tuple(reasons), n_budget, n_daly, n_round)


_WORDS = {
    "snapshot": ("a snapshot", "a round lasts",
                 "make the next snapshot wait for it"),
    "save": ("a durable save", "the slowest recent save lasted",
             "make the writer skip saves (a checkpoint is complete only when every rank "
             "wrote its step)"),
}
"""How the reasons name the cost, the background work's length, and what a shorter
interval would do, per kind."""


@dataclass
class IntervalPolicy:
    """Chooses ``every_n_steps`` from the run's own measurements, and re-chooses.

    Every rank must snapshot the same steps (a round is a collective), so a choice is
    made in three moves at steps every rank agrees on:

    1. :meth:`observe` after every step, with the step's wall time (from the end of the
       previous step to the end of this one, everything the runtime did included) and
       whether a snapshot was taken at the end of it;
    2. where :meth:`due` says so, :meth:`propose` this rank's choice, from its own
       measurements;
    3. the caller agrees on one interval (the runtime takes the largest over ranks:
       the rank that pays most decides, so no rank exceeds the budget) and calls
       :meth:`adopt` with it.

    The policy starts at interval ``probe_every`` and proposes after ``probe_steps``
    steps. Every interval is one sample: its steps' total minus ``n`` plain steps is
    one snapshot's added time. Plain step time is learned from the steps at least
    ``settle_steps`` after a snapshot (a round's work may land in the steps just after
    it), so the probe's interval must be longer than that. Estimates are the median of
    the last ``window`` samples. A longer interval is always taken (the cost rose: the
    budget demands it); a shorter one only when it is more than ``hysteresis``
    (relative) shorter, so noise does not make it flap, and, when the budget sets it, to
    at most half the interval in force (the cost is measured at that interval, and need
    not scale with it); choices are re-made at the first snapshot ``reeval_steps`` or
    more after the last one.
    """

    budget: float = DEFAULT_BUDGET
    mtbf_s: float | None = None
    mtbf_note: str = ""
    """Where ``mtbf_s`` came from, for the reasons (the caller may update both)."""
    recovery_s: float = 0.0
    probe_every: int = 8
    probe_steps: int = 48
    settle_steps: int = 3
    window: int = 16
    hysteresis: float = 0.25
    reeval_steps: int = 200
    max_interval: int = MAX_INTERVAL
    current: Choice | None = None
    _plain: deque = field(default_factory=lambda: deque(maxlen=64))
    _costs: deque = field(default_factory=lambda: deque(maxlen=64))
    _rounds: deque = field(default_factory=lambda: deque(maxlen=64))
    _steps: int = 0
    _since_snapshot: int = 10**9
    _interval_sum: float = 0.0
    _interval_len: int = 0
    _last_snapshot: int = 0
    _last_eval: int = 0
    _disturbed: bool = False

    @property
    def every_n_steps(self) -> int:
        """The interval now in force (``probe_every`` while probing)."""
        return self.current.every_n_steps if self.current is not None else self.probe_every

    def wants_snapshot(self) -> bool:
        """Whether the step about to be observed should be snapshotted: ``n`` steps
        after the last one (every rank observes the same steps, so every rank answers
        the same)."""
        return self._steps + 1 - self._last_snapshot >= self.every_n_steps

    def observe(self, step_s: float, snapshotted: bool, round_s: float | None = None) -> None:
        """Record one step (see the class docstring)."""
        self._steps += 1
        if round_s is not None and round_s > 0:
            self._rounds.append(round_s)
        if self._since_snapshot >= self.settle_steps and not snapshotted and not self._disturbed:
            self._plain.append(step_s)
        # one sample of a snapshot's added time per completed interval
        self._interval_sum += step_s
        self._interval_len += 1
        if snapshotted:
            base = self.plain_step_s
            if base is not None and self._since_snapshot < 10**9:
                self._costs.append(self._interval_sum - self._interval_len * base)
            self._interval_sum, self._interval_len = 0.0, 0
            self._since_snapshot = 0
            self._last_snapshot = self._steps
            self._disturbed = False
        else:
            self._since_snapshot += 1

    def interrupted(self) -> None:
        """A recovery rolled the job back. The interval in progress spans the failure,
        and the steps after it run slow (a newcomer's first steps, a spare starting on
        the same cores): taken as samples they read as a snapshot costing many steps
        (450 ms for a 27 ms snapshot in a chaos soak), which pushed the interval past
        the time between failures. So no cost sample from the interrupted interval, and
        no plain-step sample until the next snapshot."""
        self._interval_sum, self._interval_len = 0.0, 0
        self._since_snapshot = 10**9  # the next snapshot starts an interval, unsampled
        self._disturbed = True

    def due(self) -> bool:
        """Whether to propose and agree now: at the end of the probe, then at the first
        snapshot ``reeval_steps`` after the last choice (the same step on every rank, as
        long as every rank observes every step)."""
        wait = self.probe_steps if self.current is None else self.reeval_steps
        return self._since_snapshot == 0 and self._steps - self._last_eval >= wait

    @property
    def probed(self) -> bool:
        """Whether the probe's steps are done (a proposal can be made)."""
        return self._steps >= self.probe_steps

    @property
    def plain_step_s(self) -> float | None:
        return _median(list(self._plain)[-self.window:]) if self._plain else None

    @property
    def snapshot_cost_s(self) -> float | None:
        return _median(list(self._costs)[-self.window:]) if self._costs else None

    def propose(self) -> Choice | None:
        """This rank's choice from its measurements so far (None: nothing measured)."""
        base, cost = self.plain_step_s, self.snapshot_cost_s
        if base is None or cost is None:
            return None
        rnd = _median(list(self._rounds)[-self.window:]) if self._rounds else 0.0
        return choose_interval(step_s=base, snapshot_cost_s=cost, budget=self.budget,
                               round_s=rnd, recovery_s=self.recovery_s, mtbf_s=self.mtbf_s,
                               max_interval=self.max_interval, mtbf_note=self.mtbf_note)

    def adopt(self, every_n_steps: int, local: Choice | None = None, *,
              budget_bound: bool | None = None, capped: bool = False) -> Choice | None:
        """Put the agreed interval in force; returns the new choice when it changed.

        ``local`` is this rank's proposal, whose reasons are kept (with a note when the
        agreed interval is another rank's). ``budget_bound``: agreed with the interval,
        whether any rank's proposal was its budget's (then a shortening at most halves
        the interval); every rank must pass the same, so the same interval is in force
        everywhere. None: ``local``'s own (a single process). ``capped``: ``every_n_steps``
        is a hard bound (the update logs memory holds, ADR 0049), in force however close."""
        self._last_eval = self._steps
        n = max(1, int(every_n_steps))
        old = self.current
        if old is not None and (n == old.every_n_steps or (
                n < old.every_n_steps and n >= old.every_n_steps * (1 - self.hysteresis)
                and not capped)):
            return None  # longer: always taken (the budget); shorter: only if clearly
        reasons = local.reasons if local is not None else ()
        if local is not None and local.every_n_steps != n and not capped:
            reasons = (*reasons, f"another rank measured a higher cost: every {n} steps "
                       "(the largest proposal) was agreed")
        was = old.every_n_steps if old is not None else self.probe_every
        if budget_bound is None:
            budget_bound = local is not None and local.budget_bound
        if budget_bound and not capped and n < (half := -(-was // 2)):
            # The budget's interval comes from the cost measured at ``was``. A round whose
            # work fits in the idle time of a long interval may not fit at a much shorter
            # one (a 200 MB round every 8 steps cost nothing measurable on 2 cores; every
            # step, 19 % of the step), so each such shortening is measured before the
            # next. Failures that outrun the snapshots (Daly's rule) shorten at once.
            reasons = (*reasons, f"at most halved per re-evaluation (the cost was measured "
                       f"at {was} steps): every {half} steps, shorter once measured there")
            n = half
        base = self.plain_step_s or 0.0
        cost = max(self.snapshot_cost_s or 0.0, 0.0)  # noise can make it negative
        self.current = Choice(n, cost / (n * base) if base > 0 else 0.0, tuple(reasons),
                              local.n_budget if local else n, local.n_daly if local else None,
                              local.n_round if local else 1)
        return self.current


@dataclass
class SavePolicy:
    """Chooses ``persistence.every_n_steps`` from the run's own measurements.

    A durable save runs in a helper process: the loop never waits for it, but on a host
    whose cores also train, the helper's serialising and writing take CPU time and
    memory bandwidth from the steps it overlaps. Fed one step at a time:

    1. :meth:`observe` after every step, with its wall time, whether a snapshot was
       taken at its end, and the step of the save that was in flight when it began
       (None: none);
    2. :meth:`save_done` when a save ends, with how long the writer was busy with it
       (None: it did not complete, so it is no sample);
    3. :meth:`propose` this rank's interval (not yet a multiple of the snapshot
       interval); the caller agrees on the largest over ranks (a durable checkpoint is
       complete only when every rank wrote its step, so every rank must persist the same
       steps) and :meth:`adopt` puts it in force, rounded up to a multiple of the
       snapshot interval then in force (saves are only ever of committed snapshots).

    A save's added time is the sum, over the steps it overlaps, of each step's time
    minus the median time of steps at the same distance from the last snapshot (0: the
    snapshot step itself, then 1, 2, up to ``settle_steps`` for all later ones) that ran
    with no save in flight. A save starts right after a snapshot, so it overlaps the
    steps a round's background work lands in: comparing them with plain steps would
    charge the round to the save. Estimates are the median of the last ``window``
    samples; a save's length is the longest of the last ``durations`` (a save due while
    the previous one runs is skipped, so this errs long).
    """

    budget: float = DEFAULT_SAVE_BUDGET
    mtbf_s: float | None = None
    mtbf_note: str = ""
    recovery_s: float = 0.0
    probe_every: int = 16
    settle_steps: int = 3
    window: int = 16
    durations: int = 4
    hysteresis: float = 0.25
    max_interval: int = MAX_INTERVAL
    current: Choice | None = None
    skipped: int = 0
    """Saves this rank's writer skipped (still busy with the previous one)."""
    _base: dict = field(default_factory=dict)  # phase -> step times with no save in flight
    _costs: deque = field(default_factory=lambda: deque(maxlen=64))
    _lengths: deque = field(default_factory=lambda: deque(maxlen=64))
    _excess: dict = field(default_factory=dict)  # save's step -> [added s, every step known]
    _since_snapshot: int = 10**9

    def observe(self, step_s: float, snapshotted: bool, saving: int | None) -> None:
        """Record one step (see the class docstring)."""
        phase = 0 if snapshotted else min(self._since_snapshot + 1, self.settle_steps)
        self._since_snapshot = 0 if snapshotted else self._since_snapshot + 1
        if saving is None:
            self._base.setdefault(phase, deque(maxlen=64)).append(step_s)
            return
        base = self._baseline(phase)
        acc = self._excess.setdefault(saving, [0.0, True])
        if base is None:
            acc[1] = False  # nothing to compare this step with: the save is no sample
        else:
            acc[0] += step_s - base
        while len(self._excess) > 4:  # saves never reported done (a recovery dropped them)
            del self._excess[min(self._excess)]

    def save_done(self, step: int, duration_s: float | None) -> None:
        """The save of ``step`` ended after ``duration_s`` (None: skipped or failed)."""
        acc = self._excess.pop(step, None)
        if duration_s is None:
            return
        self._lengths.append(duration_s)
        if acc is None:  # no step began while it ran: it ended within its submitting step
            self._costs.append(0.0)
        elif acc[1]:
            self._costs.append(acc[0])

    def _baseline(self, phase: int) -> float | None:
        """The median step time with no save in flight at ``phase`` (else at the nearest
        phase measured: with a snapshot every step, every step is phase 0)."""
        measured = sorted(self._base, key=lambda p: (abs(p - phase), p))
        if not measured:
            return None
        return _median(list(self._base[measured[0]])[-self.window:])

    @property
    def plain_step_s(self) -> float | None:
        return self._baseline(self.settle_steps)

    @property
    def save_cost_s(self) -> float | None:
        return _median(list(self._costs)[-self.window:]) if self._costs else None

    @property
    def save_s(self) -> float | None:
        """How long a save lasts: the longest of the last ``durations``."""
        return max(list(self._lengths)[-self.durations:]) if self._lengths else None

    @property
    def every_n_steps(self) -> int | None:
        return self.current.every_n_steps if self.current is not None else None

    def propose(self) -> Choice | None:
        """This rank's choice from its measurements so far (None: no save measured)."""
        base, cost, length = self.plain_step_s, self.save_cost_s, self.save_s
        if base is None or base <= 0 or cost is None or length is None:
            return None
        return choose_interval(step_s=base, snapshot_cost_s=cost, budget=self.budget,
                               round_s=length, recovery_s=self.recovery_s,
                               mtbf_s=self.mtbf_s, max_interval=self.max_interval,
                               kind="save", mtbf_note=self.mtbf_note)

    def adopt(self, every_n_steps: int, local: Choice | None = None,
              multiple_of: int = 1) -> Choice | None:
        """Put the agreed interval in force, rounded up to a multiple of the snapshot
        interval ``multiple_of``; returns the new choice when it changed.

        ``every_n_steps <= 0`` (nobody measured a save yet) only re-rounds the interval
        in force when the snapshot interval changed under it. A longer interval is
        always taken; a shorter one only when more than ``hysteresis`` shorter."""
        m = max(1, int(multiple_of))
        old = self.current
        n = int(every_n_steps)
        fits = old is not None and old.every_n_steps % m == 0
        if n <= 0:
            if old is None or fits:
                return None
            n, local = old.every_n_steps, None
        target = min(-(-n // m) * m, max(m, self.max_interval // m * m))
        if old is not None and fits and (target == old.every_n_steps or (
                target < old.every_n_steps
                and target >= old.every_n_steps * (1 - self.hysteresis))):
            return None
        reasons = list(local.reasons) if local is not None else []
        if local is not None and local.every_n_steps != n:
            reasons.append(f"another rank measured a higher cost: every {n} steps (the "
                           "largest proposal) was agreed")
        if local is None and old is not None:
            reasons.append(f"the snapshot interval is now {m} steps, and only committed "
                           f"snapshots are persisted: every {old.every_n_steps} steps "
                           f"becomes every {target}")
        elif target != n:
            reasons.append(f"rounded up to {target} steps, a multiple of the snapshot "
                           f"interval ({m} steps): only committed snapshots are persisted")
        base, cost = self.plain_step_s or 0.0, max(self.save_cost_s or 0.0, 0.0)
        self.current = Choice(target, cost / (target * base) if base > 0 else 0.0,
                              tuple(reasons), local.n_budget if local else target,
                              local.n_daly if local else None,
                              local.n_round if local else 1)
        return self.current


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
