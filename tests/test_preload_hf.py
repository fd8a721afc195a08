"""A Hugging Face GPT-2 under DDP (``benchmarks/hf_worker.py``, the model from a config
with random initialisation: nothing is downloaded), a worker SIGKILLed with a warm spare:
bit-identical to a failure-free run, with the zygote having imported ``transformers`` and
the model's classes, and its replacement ready sooner than one that imports them after
its assignment (``--no-preload '*'``), both measured in this test."""

from __future__ import annotations

import transformers  # noqa: F401 - a dev dependency (`make setup`): missing, this fails

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
