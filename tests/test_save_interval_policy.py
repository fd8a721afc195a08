"""``persistence.every_n_steps: auto`` without a job: the durable save interval's policy
(recovery/schedules/interval_policy.py, ``SavePolicy`` and ``choose_interval(kind="save")``), the
runtime's adapter driving both tiers (recovery/schedules/auto_interval.py), the recipe, and the
optional ``_auto_interval`` entry that lets a job resume a checkpoint written without it.
The real job is in tests/test_persist_auto.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from recovery.schedules import auto_interval
from recovery.schedules.interval_policy import MAX_INTERVAL, SavePolicy, choose_interval
from replication.durable.saver import SaveResult
from replication.durable.ticket import PersistTicket

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist saves


# -- choose_interval for a durable save -------------------------------------------------
def test_a_save_is_worded_as_a_save_and_lasts_at_least_its_own_length() -> None:
    c = choose_interval(step_s=0.1, snapshot_cost_s=0.02, budget=0.01, round_s=0.45,
                        kind="save")
    assert c.every_n_steps == 20 and c.n_budget == 20 and c.n_round == 5  # 20 ms / 1 %
    assert c.text.startswith("every 20 steps: a durable save adds 20.0 ms")
    slow = choose_interval(step_s=0.1, snapshot_cost_s=0.0, round_s=2.05, kind="save")
    assert slow.every_n_steps == 21  # the writer would skip a save due while one runs
    assert "slowest recent save lasted 2050.0 ms (21 steps)" in slow.text
    assert "skip saves" in slow.text
    noted = choose_interval(step_s=0.1, snapshot_cost_s=0.02, budget=0.01, mtbf_s=86400,
                            kind="save", mtbf_note=" (a note)")
    assert noted.every_n_steps == round((math.sqrt(2 * 0.02 * 86400) - 0.02) / 0.1)
    assert "MTBF of 86400 s (a note), Daly's optimum" in noted.text
    with pytest.raises(ValueError):
        choose_interval(step_s=0.1, snapshot_cost_s=0.0, kind="checkpoint")


# -- SavePolicy, fed a synthetic run -------------------------------------------------
def drive(policy: SavePolicy, steps: int, *, snap_every: int, save_every: int,
          save_steps: int, plain: float = 0.1, snap: tuple[float, float] = (0.02, 0.01),
          save_add: float = 0.005, start: int = 1) -> list[int]:
    """A run where a snapshot adds ``snap[0]`` to its own step and ``snap[1]`` to the
    next (its round's background work), and a save, submitted at a snapshot step that
    is a multiple of ``save_every`` and lasting ``save_steps`` steps, adds ``save_add``
    to each step it overlaps. Returns the steps saved (their snapshot's step)."""
    saving, left, prev_snap, saved = None, 0, False, []
    for i in range(start, start + steps):
        snapped = i % snap_every == 0
        t = plain + (snap[0] if snapped else 0.0) + (snap[1] if prev_snap else 0.0)
        t += save_add if saving is not None else 0.0
        policy.observe(t, snapped, saving)
        prev_snap = snapped
        if saving is not None:
            left -= 1
            if left == 0:
                policy.save_done(saving, save_steps * plain)
                saving = None
        if snapped and i % save_every == 0 and saving is None:
            saving, left = i - snap_every, save_steps  # the committed snapshot before
            saved.append(saving)
    return saved


def test_a_save_is_charged_only_what_it_adds_not_the_rounds_work() -> None:
    p = SavePolicy(budget=0.01)
    drive(p, 128, snap_every=4, save_every=16, save_steps=3)
    assert p.plain_step_s == pytest.approx(0.1)
    # three overlapped steps at +5 ms; the round's 10 ms on the step after a snapshot
    # falls in every save's first step and is not charged to the save
    assert p.save_cost_s == pytest.approx(0.015)
    assert p.save_s == pytest.approx(0.3)
    choice = p.propose()
    assert choice is not None and choice.every_n_steps == 15  # 15 ms / (1 % of 100 ms)
    assert choice.text.startswith("every 15 steps: a durable save adds 15.0 ms")


def test_with_a_snapshot_every_step_every_step_is_its_own_baseline() -> None:
    p = SavePolicy(budget=0.01)
    drive(p, 96, snap_every=1, save_every=8, save_steps=2, snap=(0.02, 0.0))
    assert p.plain_step_s == pytest.approx(0.12) and p.save_cost_s == pytest.approx(0.01)


def test_samples_and_their_absence() -> None:
    p = SavePolicy()
    assert p.propose() is None  # nothing measured
    p.observe(0.1, True, None)
    p.observe(0.1, False, None)
    p.save_done(7, 0.05)  # ended within the step that submitted it: it took nothing
    assert p.save_cost_s == 0.0 and p.save_s == 0.05
    p.observe(0.2, False, 9)
    p.save_done(9, None)  # skipped or failed: no sample of either
    assert list(p._costs) == [0.0] and list(p._lengths) == [0.05]
    assert p._excess == {}
    for s in (10, 11, 12, 13, 14, 15):  # saves never reported done do not pile up
        p.observe(0.1, False, s)
    assert len(p._excess) <= 4


def test_adopt_rounds_up_to_the_snapshot_interval_and_keeps_it_a_multiple() -> None:
    p = SavePolicy(hysteresis=0.25)
    drive(p, 64, snap_every=4, save_every=16, save_steps=3)
    local = p.propose()
    assert local is not None and local.every_n_steps == 15
    first = p.adopt(15, local, multiple_of=4)
    assert first is not None and first.every_n_steps == 16
    assert "rounded up to 16 steps, a multiple of the snapshot interval (4 steps)" in first.text
    assert p.adopt(15, local, multiple_of=4) is None  # unchanged
    assert p.adopt(13, local, multiple_of=1) is None  # within the hysteresis: kept
    longer = p.adopt(30, local, multiple_of=4)  # another rank pays more: always taken
    assert longer is not None and longer.every_n_steps == 32 and "another rank" in longer.text
    # nobody proposed (0), but the snapshot interval changed under it: re-rounded
    assert p.adopt(0, None, multiple_of=8) is None  # 32 is a multiple of 8 already
    moved = p.adopt(0, None, multiple_of=12)
    assert moved is not None and moved.every_n_steps == 36
    assert "snapshot interval is now 12 steps" in moved.text
    capped = SavePolicy(max_interval=100)
    capped.adopt(5000, None, multiple_of=12)
    assert capped.every_n_steps == 96  # the cap, still a multiple of the snapshot interval


# -- the adapter, both tiers, with a stand-in durable tier (no job) ----------------
class Log:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: str, **fields: object) -> None:
        self.events.append({"event": event, **fields})


class Durable:
    """What the adapter reads of :class:`recovery.durable.tier.DurableTier`: the writer's
    step in flight, the last ticket handed over, the last restore's time."""

    def __init__(self) -> None:
        self.writer = SimpleNamespace(busy_step=None)
        self.ticket: PersistTicket | None = None
        self.restore_s = 0.0

    def submit(self, step: int) -> PersistTicket:
        self.ticket = PersistTicket(step)
        self.writer.busy_step = step
        return self.ticket

    def finish(self, status: str = "ok") -> None:
        t = self.ticket
        assert t is not None
        t._finish(SaveResult(t.step, 0, status))
        self.writer.busy_step = None


def test_adapter_agrees_both_tiers_and_keeps_saves_on_committed_snapshots(monkeypatch):
    from recovery.recipe import CheckpointlessConfig
    from replication.training_state.state import TrainingState

    settings = CheckpointlessConfig()
    settings.replication.every_n_steps = 1  # a fixed snapshot interval (the default: auto)
    settings.persistence.every_n_steps = "auto"
    settings.persistence.path = "/nowhere"  # never written: the durable tier is a stand-in
    settings.persistence.max_overhead = 0.01
    settings.recovery.mtbf_s = 50.0
    others = [0, 0]  # what the other rank proposes (0: nothing measured)
    agreed: list[list[int]] = []

    def agree(t) -> None:  # all-reduce MAX with one other rank
        agreed.append(t.tolist())
        for i, v in enumerate(others):
            t[i] = max(int(t[i]), v)

    log, state = Log(), TrainingState()
    ai = auto_interval.AutoInterval.from_settings(settings, 0, log, state, agree)
    assert ai is not None and ai.policy is None  # replication stays at its fixed 1
    assert "_auto_interval" in state.optional and "_auto_interval" in state.replay_exempt
    assert settings.persistence.every_n_steps == 16  # the probe, a multiple of 1
    assert ai.saves is not None and ai.saves.mtbf_s == 50.0
    assert "recovery.mtbf_s" in ai.saves.mtbf_note  # the lower bound, as none was given
    clock = [0.0]
    monkeypatch.setattr(auto_interval.time, "perf_counter", lambda: clock[0])
    durable = Durable()
    for step in range(1, auto_interval.AGREE_EVERY + 1):
        busy = durable.writer.busy_step is not None
        clock[0] += 0.1 + (0.01 if busy else 0.0)  # a save adds 10 ms to a step it overlaps
        if busy and step % 16 == 2:
            durable.finish()  # a save lasts two steps
        if step % 16 == 0:
            durable.submit(step - 1)  # the committed snapshot's step
        ai.after_step(step, True, None, durable)
    # 20 ms a save (two steps of +10 ms) / 1 % of 100 ms; no update log: no cap
    assert agreed[-1] == [0, 20, 0, -MAX_INTERVAL]
    assert settings.persistence.every_n_steps == 20
    ev = log.events[-1]
    assert ev["event"] == "auto_interval" and ev["tier"] == "persistence"
    assert ev["every_n_steps"] == 20 and ev["save_s"] >= 0 and ev["skipped"] == 0
    assert any("the budget wins" in r for r in ev["reasons"])  # Daly: 14 steps, shorter
    assert ai.state_dict().keys() == {"persist_every_n_steps", "elapsed_s"}
    assert ai.state_dict()["persist_every_n_steps"] == 20
    ai.load_state_dict({})  # a checkpoint of a job whose persistence was fixed: kept
    assert settings.persistence.every_n_steps == 20
    ai.load_state_dict({"persist_every_n_steps": 16})  # a rollback before the choice
    assert settings.persistence.every_n_steps == 16
    others[1] = 40  # the other rank pays more
    ai.after_step(2 * auto_interval.AGREE_EVERY, True, None, durable)
    assert settings.persistence.every_n_steps == 40
    assert "another rank" in " ".join(log.events[-1]["reasons"])
    durable.submit(200)
    durable.ticket._finish(SaveResult(200, 0, "skipped"))
    ai.after_step(2 * auto_interval.AGREE_EVERY + 1, False, None, durable)
    assert ai.saves.skipped == 1


def test_adapter_rounds_the_save_interval_when_the_snapshot_interval_moves(monkeypatch):
    from recovery.recipe import CheckpointlessConfig
    from replication.training_state.state import TrainingState

    settings = CheckpointlessConfig()
    settings.replication.every_n_steps = "auto"
    settings.persistence.every_n_steps = "auto"
    settings.persistence.path = "/nowhere"
    others = [12, 0]  # the other rank wants snapshots every 12 steps; no save measured

    def agree(t) -> None:
        for i, v in enumerate(others):
            t[i] = max(int(t[i]), v)

    log = Log()
    ai = auto_interval.AutoInterval.from_settings(settings, 1, log, TrainingState(), agree)
    assert ai is not None and ai.policy is not None and ai.saves is not None
    assert (settings.replication.every_n_steps, settings.persistence.every_n_steps) == (8, 16)
    ai.after_step(auto_interval.AGREE_EVERY, True, None, Durable())
    assert settings.replication.every_n_steps == 12
    assert settings.persistence.every_n_steps == 24  # 16 is not a multiple of 12
    assert [e["tier"] for e in log.events] == ["replication", "persistence"]
    assert "snapshot interval is now 12 steps" in " ".join(log.events[-1]["reasons"])
    assert {k: v for k, v in ai.state_dict().items() if k != "elapsed_s"} == {
        "every_n_steps": 12, "persist_every_n_steps": 24}
    ai.load_state_dict({"every_n_steps": 8})  # a checkpoint of a job with one auto tier
    assert (settings.replication.every_n_steps, settings.persistence.every_n_steps) == (8, 24)
    ai.load_state_dict({"every_n_steps": 10})  # saves stay on committed snapshots
    assert (settings.replication.every_n_steps, settings.persistence.every_n_steps) == (10, 30)


def test_without_a_path_persistence_auto_resolves_to_off() -> None:
    from recovery.recipe import CheckpointlessConfig

    settings = CheckpointlessConfig()
    settings.persistence.every_n_steps = "auto"  # a script's own settings, not the recipe
    ai = auto_interval.AutoInterval(settings, 0, Log(), lambda t: None)
    assert ai.saves is None and settings.persistence.every_n_steps == 0


def test_the_mtbf_the_durable_tier_is_chosen_for() -> None:
    from recovery.recipe import CheckpointlessConfig

    s = CheckpointlessConfig()
    assert auto_interval.durable_mtbf(s) == (None, "")
    s.recovery.mtbf_s = 3600.0
    assert auto_interval.durable_mtbf(s)[0] == 3600.0  # any failure: a lower bound
    s.persistence.mtbf_s = 86400.0
    assert auto_interval.durable_mtbf(s)[0] == 86400.0  # its own, when given


# -- the optional entry: a job with auto resumes a checkpoint written without it -------
def test_an_optional_entry_missing_from_a_snapshot_is_left_alone(tmp_path) -> None:
    from replication.durable import load
    from replication.snapshots.snapshot import SnapshotEngine
    from tests.test_durable_support import config, make_state, make_writer, persist

    state, _objs = make_state()
    engine = SnapshotEngine(state)
    with make_writer(config(str(tmp_path)), 0, 1) as writer:
        assert persist(writer, engine, 4).status == "ok"
    fresh, objs = make_state(seed=5)

    class Kept:
        loaded = False

        def state_dict(self) -> dict:
            return {"every_n_steps": 3}

        def load_state_dict(self, sd: dict) -> None:
            self.loaded = True

    kept = Kept()
    fresh.register("_auto_interval", kept)
    with pytest.raises(Exception, match="_auto_interval"):
        load(str(tmp_path), fresh)  # not optional: refused, as before
    fresh.mark_optional("_auto_interval")
    assert load(str(tmp_path), fresh).step == 4 and not kept.loaded
    for a, b in zip(objs["model"].parameters(), _objs["model"].parameters()):
        assert torch.equal(a, b)
    with pytest.raises(KeyError):  # a registered entry that is not optional still counts
        fresh.restore({"rng": fresh.capture()["rng"]})


# -- the recipe ------------------------------------------------------------------------
def test_recipe_accepts_auto_budget_and_mtbf_and_refuses_bad_values(tmp_path) -> None:
    from recovery.recipe import ConfigError, load_config
    from recovery.recipe.serialize import config_from_json, config_to_json

    recipe = tmp_path / "r.yaml"
    recipe.write_text("checkpointless: {persistence: {path: /tmp/x, every_n_steps: auto, "
                      "max_overhead: 0.005, mtbf_s: 86400}}")
    cfg = load_config(str(recipe), env={})
    assert cfg.persistence.every_n_steps == "auto"
    assert cfg.persistence.max_overhead == 0.005 and cfg.persistence.mtbf_s == 86400
    assert config_from_json(config_to_json(cfg)) == cfg  # what the worker reads back
    env = {"CHECKPOINTLESS_PERSISTENCE_EVERY_N_STEPS": "Auto",
           "CHECKPOINTLESS_PERSISTENCE_PATH": "/tmp/x"}
    assert load_config(None, [], env=env).persistence.every_n_steps == "auto"
    default = load_config(env={}).persistence
    assert (default.every_n_steps, default.max_overhead, default.mtbf_s) == (0, 0.01, None)
    assert load_config(None, ["persistence.path=/x", "persistence.every_n_steps=7"],
                       env={}).persistence.every_n_steps == 7  # a number works as before
    for bad, says in (
        ("persistence.every_n_steps=often", "expected an integer >= 0, or 'auto'"),
        ("persistence.every_n_steps=-1", "expected an integer >= 0, or 'auto'"),
        ("persistence.max_overhead=0", "in [0.0001, 1.0]"),
        ("persistence.max_overhead=2", "in [0.0001, 1.0]"),
        ("persistence.mtbf_s=0", ">= 1.0"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["persistence.path=/tmp/x", bad], env={})
        text = str(err.value)
        assert "checkpointless." + bad.split("=")[0] in text and says in text, text
    with pytest.raises(ConfigError) as err:  # auto asks for durable checkpoints: a path
        load_config(None, ["persistence.every_n_steps=auto"], env={})
    assert "got 'auto', which asks for durable checkpoints" in str(err.value)
    assert "persistence.path is empty" in str(err.value)


def test_the_agreement_tensor_is_one_collective_of_two_proposals() -> None:
    """Both tiers' proposals travel in one all-reduce (MAX): replication first, then
    whether a snapshot proposal is its budget's (how far the interval may shorten),
    then the update-log steps the rank can hold, negated (MAX of them: the least;
    MAX_INTERVAL where it holds none, ADR 0049)."""
    from recovery.recipe import CheckpointlessConfig
    from replication.training_state.state import TrainingState

    settings = CheckpointlessConfig()
    settings.replication.every_n_steps = "auto"
    seen: list[torch.Tensor] = []
    ai = auto_interval.AutoInterval.from_settings(settings, 0, Log(), TrainingState(),
                                                  seen.append)
    assert ai is not None
    ai.after_step(auto_interval.AGREE_EVERY, True, None, None)
    assert len(seen) == 1 and seen[0].dtype == torch.int64
    assert seen[0].tolist() == [0, 0, 0, -MAX_INTERVAL]
