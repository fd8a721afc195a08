"""bench_overhead's arithmetic and keys at a tiny size, and the goodput model."""

from __future__ import annotations

import pytest

from benchmarks import bench_overhead as bo
from benchmarks import goodput_model as gm


def test_whole_intervals_count_each_snapshot_once() -> None:
    times = [1, 2, 3, 4, 5, 6, 7]
    snaps = [False, True, False, False, True, False, False]
    assert bo.whole_intervals(times, snaps) == [3, 4, 5]
    assert bo.whole_intervals(times, [False] * 7) == times


def test_interval_step_is_robust_to_one_stall() -> None:
    snaps = [True, False, False, True, False, False, True, False, False, True]
    times = [0.0, 1.0, 1.3, 1.0, 1.0, 1.3, 1.0, 9.0, 1.3, 0.0]  # a 9 s stall in interval 3
    assert bo.interval_step_s(times, snaps) == pytest.approx(3.3 / 3)
    assert bo.interval_step_s([1.0, 2.0], [False, False]) == pytest.approx(1.5)


def test_overheads_are_against_the_same_plain_phase() -> None:
    plain = {"phases": [{"name": "warmup", "times": [9.0]},
                        {"name": "every1_0.5", "times": [0.1, 0.1]},
                        {"name": "everyN_0.5", "times": [0.1, 0.1]},
                        {"name": "dcp_0.5", "times": [0.3, 0.3]}]}
    runs = {"k2": {"phases": [
        {"name": "every1_0.5", "times": [0.11, 0.13], "snaps": [True, True]},
        {"name": "everyN_0.5", "times": [0.1, 0.11], "snaps": [False, True]},
    ]}}
    o = bo.overheads(plain, runs)
    assert o["k2_every1_0.5"] == pytest.approx(0.2)
    assert o["k2_everyN_0.5"] == pytest.approx(0.05)


def test_phases_cover_the_sweep_and_the_key_rate() -> None:
    ph = bo.phases_for("device", 10**8, (0.05, 0.5, 2.0), 8, {}, True, 8)
    names = [p["name"] for p in ph]
    assert names == ["warmup", "every1_0.05", "everyN_0.05", "every1_0.5", "everyN_0.5",
                     "nosnap_0.5", "dcp_0.5", "default_0.5", "every1_2.0", "everyN_2.0"]
    for p in ph:
        assert p["step_s"] == pytest.approx(10**8 / (p["rate"] * 1e9))
        if p["name"].startswith("everyN"):
            assert p["steps"] % 8 == 0
    cpu = bo.phases_for("cpu", 10**8, (0.5,), 8, {"0.5": 7}, True, 8)
    default = [p for p in cpu if p["name"].startswith("default")]
    # the runtime's own cadence, every step timed (the probe's too), only in its own job
    assert len(default) == 1 and default[0]["every"] < 0 and default[0]["batch"] == 7
    assert default[0]["warm"] == 0 and default[0]["only"] == ["default"]


def test_default_figures_count_the_probe_and_the_steady_state() -> None:
    probe = [1.5 if i % 8 == 7 else 1.0 for i in range(bo.AUTO_WARM)]  # every 8, +0.5 each
    steady = [1.2 if i % 20 == 19 else 1.0 for i in range(200)]  # every 20, +0.2 each
    times = probe + steady
    snaps = [t > 1.0 for t in times]
    job = {"phases": [{"name": f"default_{bo.KEY_RATE}", "times": times, "snaps": snaps,
                       "auto_every": 20}],
           "auto_events": [{"step": 64, "every_n_steps": 20, "tier": "replication",
                            "reasons": ["why"]},
                           {"step": 64, "every_n_steps": 40, "tier": "persistence"}]}
    f = bo.default_figures(job, "cpu", ref=1.0)
    assert f["overhead_plain_default_steady_cpu"] == pytest.approx(0.01)
    assert f["overhead_plain_default_cpu"] == pytest.approx(
        (12 * 0.5 + 10 * 0.2) / len(times))
    assert f["overhead_default_cpu_same_run"] == pytest.approx(0.01)
    assert f["default_interval_steps_cpu"] == 20 and f["default_steps_cpu"] == len(times)
    assert f["default_reasons_cpu"] == ["step 64: every 20 steps: why"]


def test_profile_splits_the_added_time_per_snapshot() -> None:
    phase = {"times": [0.15, 0.15], "snaps": [True, True], "fence_wait_s": 0.002,
             "profile": {"capture_s": 0.004, "loop_wait_s": 0.01, "seal_s": 0.02,
                         "announce_s": 0.002, "receive_verify_s": 0.03,
                         "receive_hash_s": 0.004, "exchange_s": 0.04, "commit_s": 0.006}}
    p = bo.profile_of(phase, plain_step_s=0.1)
    assert p["added_ms"] == pytest.approx(50.0)
    assert p["loop_stall_ms"] == pytest.approx(8.0)  # (4 + 10 + 2) ms over 2 snapshots
    assert p["round_receive_wait_ms"] == pytest.approx(13.0)
    assert p["round_send_rest_ms"] == pytest.approx(4.0)  # 20 - 1 - 15
    assert p["added_minus_loop_stall_ms"] == pytest.approx(42.0)


def measured(**kw: float) -> gm.Measured:
    base = {"step_s": 0.1, "cl_snapshot_cost_s": 0.005, "cl_round_s": 0.05,
            "cl_recovery_s": 1.0, "dcp_save_cost_s": 0.05, "dcp_restart_s": 60.0}
    return gm.Measured(**{**base, **kw})


def test_goodput_formula() -> None:
    assert gm.goodput(0.0, 0.0, 100.0) == 1.0
    assert gm.goodput(0.25, 50.0, 100.0) == pytest.approx(0.4)
    assert gm.goodput(0.0, 200.0, 100.0) == 0.0


def test_cheaper_snapshots_and_recovery_win_everywhere() -> None:
    m = measured()
    assert gm.crossover_mtbf_s(m) is None
    assert gm.ratio_at(m, 3 * 3600) > 1.0
    rows = gm.curve(m, 10)
    assert rows[0]["mtbf_s"] == pytest.approx(60) and rows[-1]["mtbf_s"] == pytest.approx(86400)
    assert all(r["checkpointless"] >= r["dcp"] for r in rows)
    # goodput rises with MTBF for both
    assert rows[-1]["dcp"] > rows[0]["dcp"]


def test_dearer_snapshots_lose_at_long_mtbf() -> None:
    # each snapshot costs 20x DCP's save, but a restart takes 5 minutes: DCP wins at
    # long MTBF (its lower per-save cost), checkpointless at short (faster recovery)
    m = measured(cl_snapshot_cost_s=1.0, dcp_save_cost_s=0.05, dcp_restart_s=300.0,
                 cl_recovery_s=1.0)
    cross = gm.crossover_mtbf_s(m)
    assert cross is not None and 60 < cross < 86400
    assert gm.ratio_at(m, 86400) < 1.0
    assert gm.ratio_at(m, 600) > 1.0
    assert gm.dcp(m, cross * 1.5)[0] > gm.checkpointless(m, cross * 1.5)[0]


def test_the_runtimes_mtbf_estimate_sets_the_interval() -> None:
    m = measured()
    budget_only = gm.Measured(**{**m.__dict__, "cl_mtbf_factor": None})
    # without an MTBF the budget's interval whatever the failure rate; with the true
    # one, Daly's optimum (longer at long MTBF) and a better goodput there
    assert gm.checkpointless(budget_only, 86400)[1] == gm.checkpointless(budget_only, 60)[1]
    assert gm.checkpointless(m, 86400)[1] > gm.checkpointless(budget_only, 86400)[1]
    assert gm.checkpointless(m, 86400)[0] > gm.checkpointless(budget_only, 86400)[0]
    # an estimate off by 2x either way costs little (Daly's curve is flat)
    for f in (0.5, 2.0):
        off = gm.Measured(**{**m.__dict__, "cl_mtbf_factor": f})
        assert gm.checkpointless(off, 10800)[0] == pytest.approx(
            gm.checkpointless(m, 10800)[0], abs=2e-3)


def test_the_models_snapshot_cost_is_never_below_what_was_measured_directly() -> None:
    r = {"profile_k2_every1_device": {"loop_capture_ms": 1.0},
         "profile_k2_every1_cpu": {"loop_capture_ms": 1.0},
         "k2_snapshot_cost_s_device": -0.004, "k2_snapshot_cost_s_cpu": -0.2,
         "cputime_overhead_k2_everyN_cpu": 0.05, "plain_step_s_cpu_0.5": 0.1}
    assert bo.snapshot_cost_for_model(r, "device", 8) == pytest.approx(0.001)
    assert bo.snapshot_cost_for_model(r, "cpu", 8) == pytest.approx(0.04)
    r["k2_snapshot_cost_s_device"] = 0.003
    assert bo.snapshot_cost_for_model(r, "device", 8) == pytest.approx(0.003)


def test_the_plain_job_after_the_default_one_reruns_the_reference_rate_only() -> None:
    names = [p["name"] for p in bo.phases_for("cpu", 12 * 2**20, bo.RATES, 8,
                                             {str(r): 4 for r in bo.RATES}, False, 8)]
    after = [n for n in names if bo.runs_phase(bo.PLAIN_AFTER, n)]
    assert after == ["warmup", f"every1_{bo.KEY_RATE}", f"everyN_{bo.KEY_RATE}",
                     f"nosnap_{bo.KEY_RATE}"]
    assert [n for n in names if bo.runs_phase("default", n)] == [
        "warmup", f"default_{bo.KEY_RATE}"]
    assert [n for n in names if bo.runs_phase("k2", n)] == names
