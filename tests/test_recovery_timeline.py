"""The phases of a recovery follow each other from the fault and add up
(``recovery/generation/recovery_timeline.py``); the wait for a silence verdict is detection."""

from __future__ import annotations

import math

from recovery.generation.recovery_timeline import PHASES, fault_at, phases


def _total(t: dict[str, float]) -> float:
    return sum(t[p] for p in PHASES)


def test_a_killed_worker():
    t = phases([{"kind": "worker_exit", "ts": 100.0}], noticed=100.05, aborted=100.06,
               planned=100.2, grouped=100.25, recovered=100.5)
    assert math.isclose(t["detect_s"], 0.05) and math.isclose(t["abort_s"], 0.01)
    assert math.isclose(t["rendezvous_s"], 0.19) and math.isclose(t["transfer_s"], 0.25)
    assert math.isclose(t["rendezvous_join_s"], 0.14)
    assert math.isclose(_total(t), 0.5)


def test_the_wait_for_a_node_loss_verdict_is_detection():
    """Survivors see a peer's collective fail at once, then wait in the rendezvous for
    ranks that never join until an agent declares their node lost after 10.4 s of
    silence: detection from the silence to the verdict, rendezvous from the verdict."""
    causes = [{"kind": "peer_failure", "ts": 100.05},
              {"kind": "node_lost", "ts": 110.45, "silent_s": 10.4}]
    assert math.isclose(fault_at(causes, 0.0), 100.05)
    t = phases(causes, noticed=100.06, aborted=100.07, planned=110.6, grouped=110.65,
               recovered=111.0)
    assert math.isclose(t["detect_s"], 10.4)
    assert t["abort_s"] == 0.0  # over long before detection ended
    assert math.isclose(t["rendezvous_s"], 0.2)
    assert math.isclose(t["transfer_s"], 0.35)
    assert math.isclose(_total(t), 111.0 - 100.05)


def test_a_verdict_after_the_groups_were_up_is_not_this_recoverys():
    causes = [{"kind": "worker_exit", "ts": 100.0},
              {"kind": "worker_hung", "ts": 200.0, "silent_s": 5.0}]
    t = phases(causes, noticed=100.1, aborted=100.2, planned=100.3, grouped=100.4,
               recovered=100.6)
    assert math.isclose(t["detect_s"], 0.1) and math.isclose(_total(t), 0.6)


def test_a_cause_without_a_timestamp_starts_at_the_notice():
    t = phases([{}], noticed=5.0, aborted=5.1, planned=5.2, grouped=5.3, recovered=5.4)
    assert t["detect_s"] == 0.0 and math.isclose(_total(t), 0.4)
