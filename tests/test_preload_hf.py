"""A Hugging Face GPT-2 under DDP (``benchmarks/hf_worker.py``, the model from a config
with random initialisation: nothing is downloaded), a worker SIGKILLed with a warm spare:
bit-identical to a failure-free run, with the zygote having imported ``transformers`` and
the model's classes, and its replacement ready sooner than one that imports them after
its assignment (``--no-preload '*'``), both measured in this test; and a node loss taken
over by a spare node whose zygote imported them too."""

from __future__ import annotations

import transformers  # noqa: F401 - a dev dependency (`make setup`): missing, this fails

from benchmarks import bench_replacement_ready as ready
from benchmarks._harness import digests
from benchmarks.bench_preload import KILL_STEP, figures, run

STEPS = 12


def test_a_replacement_finds_transformers_imported_and_resumes_bit_identical(tmp_path):
    run(tmp_path / "ref", STEPS, "")
    ref = digests(tmp_path / "ref")
    fault = f"1:{KILL_STEP}:backward"
    warm_dir = run(tmp_path / "warm", STEPS, fault)
    cold_dir = run(tmp_path / "cold", STEPS, fault, "--no-preload", "*")
    assert digests(tmp_path / "warm") == ref and digests(tmp_path / "cold") == ref
    warm, cold = figures(tmp_path / "warm", warm_dir), figures(tmp_path / "cold", cold_dir)
    assert {"transformers", "transformers:GPT2LMHeadModel"} <= set(warm["preloaded"]), warm
    assert cold["preloaded"] == [], cold
    # Relative to the same job's replacement that imports them itself, in this run.
    assert warm["replacement_ready_s"] < cold["replacement_ready_s"], (warm, cold)


def test_a_lost_node_is_taken_over_by_spares_that_imported_transformers(tmp_path):
    """2 nodes x 2 workers with a warm spare each and a spare node, node 1 SIGKILLed at
    step 8: the spare node takes ranks 2 and 3 (its warm spare and a fork of its
    zygote), bit-identical to the
    failure-free run. The spare node's zygote imported ``transformers`` before the loss,
    so its replacements reach ``Checkpointless(...)`` sooner after the loss is declared
    than that import took on the same node (both measured in this run); the absolute
    targets are ``benchmarks/bench_replacement_ready.py``'s."""
    ref = ready.run("hf", tmp_path / "ref", STEPS)
    loss = ready.run("hf", tmp_path / "loss", STEPS, ready.FAULTS["node_loss"])
    assert loss.finals() == ref.finals() and len(ref.finals()) == 4
    fig = ready.figures(loss, [2, 3])
    assert fig["replacement_ready_s"] is not None and "detect_s" in fig, (fig, loss.output())
    spare_node = [e for e in loss.events("zygote_ready") if e.get("node") == 2]
    assert spare_node, loss.output()
    assert {"transformers", "transformers:GPT2LMHeadModel"} <= set(spare_node[0]["preloaded"])
    starts = [e for e in loss.events("worker_start") if e.get("rank") in (2, 3)
              and e.get("replacement")]
    assert {e["node"] for e in starts} == {2}, starts
    # Its warm spare takes one rank, a fork of its zygote the other: both from the
    # zygote that imported transformers, none a new interpreter.
    assert sorted(e["started"] for e in starts) == ["fork", "spare"], starts
    after_declared = fig["replacement_ready_s"] - fig["detect_s"]
    assert after_declared < spare_node[0]["preload_s"], (fig, spare_node[0])
