"""Run every benchmark and rewrite BENCHMARKS.md with the figures just measured.

    python -m benchmarks.run_all [--quick]     (``make bench`` runs the full modes)

Each benchmark prints one JSON object as its last stdout line; this collects them,
keeps the raw JSON in ``benchmarks/results/latest.json`` and renders the table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time

from benchmarks._harness import REPO, progress

BENCHES = {
    "bench_snapshot": {
        "title": "Snapshot and replication cost",
        "accept": {
            "stall_over_memcpy": ("<=", 1.25),
            "torch_save_over_stall": (">=", 10),
            "replication_over_raw_send": ("<=", 1.3),
            "overhead_over_copy_cost": ("<=", 1.3),
        },
        "note": "Default: overlapped copies (`replication.overlap_copy=true`, ADR 0013; "
                "the weights and Adam's moments are copied by the round thread, at nice "
                "19, during the next forward and backward pass) with the inline hash and "
                "the streaming copy (ADR 0001, 0012). `stall_s` is measured in the "
                "training loop: time in `snapshot()` plus the optimizer step's wait at "
                "the fence. `stall_isolated_*` is the old measure, with nothing to "
                "overlap. Noise-dominated on this 2-core host, and `memcpy_s` varies "
                "between runs (about 12, 20 or 39 ms), which moves every ratio. "
                "An earlier full run (2026-11-22), before a fence could take "
                "the copy over from the niced thread, gave 0.26 / 77 / 1.02 / 0.95 for "
                "the four targets. Quick runs: `overhead_over_copy_cost` 0.51, 1.40, "
                "-0.03, 0.73 before the take-over and 1.21, 0.33 after (`inline` in the "
                "same runs: 0.41, 1.31, -0.17, 1.45, 1.90, 0.33); `stall_over_memcpy` "
                "0.15-0.28 before and 0.46-0.82 after; `torch_save_over_stall` 38-145. "
                "Later quick runs: `overhead_over_copy_cost` 0.86 and 1.40 (`memcpy_s` "
                "15 and 12 ms). The four targets measure the snapshot (capture and commit, "
                "k=1); `replication_s` is a k=2 round's network part (transfer, checks on "
                "receipt, commit) against a raw gloo send of the same bytes. Replicating "
                "every step with k=2 costs far more here: "
                "`train_step_overhead_replicated` is 0.78 of a step, because the 384 MiB "
                "gloo exchange takes CPU time that training needs "
                "on 2 cores; `replication.every_n_steps` trades that against lost work.",
    },
    "bench_preload": {
        "title": "A replacement ready when the script imports transformers",
        "accept": {"resume_s": ("<=", 1.0), "bit_identical": ("==", True)},
        "note": "A 2-layer Hugging Face GPT-2 under DDP (1 node x 2 workers, one warm "
                "spare), rank 1 SIGKILLed in step 8's backward. `resume_s` and "
                "`replacement_ready_s` (from the kill to the replacement's "
                "`Checkpointless(...)`): medians with the zygote importing the script's "
                "modules first (ADR 0046); `no_preload` is the same job with "
                "`--no-preload '*'`, where the spare imports `transformers` after its "
                "assignment, side by side in the same run. Not captured: a shared "
                "filesystem (imports here come from the page cache; a cluster's take "
                "10-60 s), a node loss (bench_replacement_ready), GPUs.",
    },
    "bench_replacement_ready": {
        "title": "Replacements for a lost worker or node: a Hugging Face GPT-2 and "
                 "Lightning's BoringModel",
        "accept": {"hf_worker_kill_resume_s": ("<=", 1.0),
                   "hf_node_loss_resume_s": ("<=", 5.0),
                   "boring_worker_kill_resume_s": ("<=", 1.0),
                   "boring_node_loss_resume_s": ("<=", 5.0),
                   "meets_targets": ("==", True)},
        "note": "2 nodes x 2 workers, a warm spare per node and a spare node, default "
                "settings; rank 1 SIGKILLed in step 8's backward (`worker_kill`), or rank "
                "2's whole node (`node_loss`: agent, workers, spares; the spare node "
                "takes ranks 2 and 3). `resume_s`: from the kill to the last "
                "replacement's `resumed` event; `replacement_ready_s`: to its "
                "`Checkpointless(...)`; `detect_s`: to the first `node_lost`. Each run "
                "is compared with a failure-free one in the same invocation "
                "(`bit_identical`). Not captured: a shared filesystem (imports come "
                "from the page cache), GPUs, real network latency.",
    },
    "bench_recovery_model_parallel": {
        "title": "In-process recovery of a tensor-parallel job vs torchrun full restart",
        "accept": {"recovery_over_restart_tp": ("<=", 0.20), "bit_identical": ("==", True)},
        "note": "bench_recovery's measurement on its MLP split by `parallelize_module` "
                "over the two ranks (column- then row-wise per pair of linear layers), "
                "against torchrun + DCP of the same job, in one run; targets 0.15 "
                "(quick) and 0.20 (full). Not captured: pipeline and 2-D layouts, a "
                "replacement on another host's network, GPUs. 2026-12-02, this host idle: "
                "full 0.135 (the run below: recovery 1.02 s, restart 7.59 s; the kill "
                "lands after the probe's snapshot at step 32 and 2 completed steps are "
                "replayed, since only data-parallel jobs roll back live), quick 0.075 "
                "(29 s of wall time); both bit-identical, the torchrun baseline too.",
    },
    "bench_recovery_deepspeed": {
        "title": "In-process recovery of a DeepSpeed ZeRO-2 job vs a restart from "
                 "DeepSpeed's own checkpoint",
        "accept": {"recovery_over_restart_deepspeed": ("<=", 0.15),
                   "bit_identical": ("==", True)},
        "note": "benchmarks/deepspeed_worker.py (bench_recovery's MLP as a ZeRO-2 "
                "engine, a client Adam, 2 ranks on 2 nodes) with rank 1 SIGKILLed in "
                "step K's backward and a warm spare, against the same job under torchrun "
                "with `engine.save_checkpoint` every N steps, killed whole and restarted "
                "at once from `engine.load_checkpoint`, in one run; target 0.15 (quick). "
                "2026-12-04, this host idle, after the zygote preloads what "
                "`deepspeed.initialize` and the first torch optimizer import lazily "
                "(`torch._dynamo`, DeepSpeed's Muon module: 1.7 s the warm spare paid after "
                "the failure; its `detect_s` went from 0.93-1.01 s to 0.07 s): quick "
                "0.108-0.118 in five runs (0.48-0.56 s against 4.3-4.8 s), after two first "
                "runs at 0.31 and 0.19; full 0.263 (the run below: recovery 1.61 s, restart "
                "6.12 s). Before it: full 0.373, quick 0.285 and 0.286. What is left is "
                "mostly the replay: DeepSpeed jobs replay from the last snapshot (2-3 "
                "completed steps here, no live rollback); the recovery itself took 0.19 s "
                "of a 0.83 s quick run. All bit-identical, "
                "the restart baseline too. Not captured: a restart's wait for the "
                "scheduler and a read from shared storage (the baseline here is the "
                "fastest a restart can be), GPUs.",
    },
    "bench_deepspeed_save": {
        "title": "How long `engine.save_checkpoint` stops a DeepSpeed loop: the runtime's "
                 "writer vs DeepSpeed's own",
        "accept": {"save_blocked_ratio": ("<=", 0.5)},
        "note": "One process, ZeRO-2 over gloo, an MLP with a client AdamW; the same loop "
                "saves with DeepSpeed's `TorchCheckpointEngine` and with the runtime's "
                "(serialized into memory, written and fsynced by a thread, committed "
                "atomically), alternating, in one run; the target is the claim the guide "
                "makes (the loop waits for the serialization, not for storage). "
                "2026-12-04, this host idle: full 0.24 (a 302 MB save: 0.36 s against "
                "1.48 s; the 40-step loop with 2 saves 14.8 s against 16.4 s, 13.4 s "
                "without saves), quick 0.27 (76 MB: 0.10 s against 0.38 s). "
                "Back-pressure: with a 302 MB save every 1.7 s (`--every 5`, full) the "
                "writer could not keep up with fsynced writes and the loop waited 1.8-1.9 s "
                "per save, longer than DeepSpeed's own (whose `torch.save` returns once the "
                "bytes are in the page cache, not on disk). Not captured: a shared file "
                "system's latency, several ranks on one disk, GPUs (a device-to-host copy "
                "comes first).",
    },
    "bench_recovery": {
        "title": "In-process recovery vs torchrun full restart",
        "accept": {"recovery_over_restart": ("<=", 0.10), "steps_lost": ("==", 0),
                   "bit_identical": ("==", True),
                   "recovery_over_restart_ddp": ("<=", 0.10),
                   "recovery_over_restart_fsdp2": ("<=", 0.10),
                   "steps_replayed_fsdp2": ("==", 0),
                   "step_time_after_recovery_over_before": ("<=", 1.05)},
        "note": "Three ways of averaging gradients, each against torchrun + DCP with the "
                "same model and the same way: `cl.all_reduce_gradients` (the "
                "top-level figures), the user's `DistributedDataParallel` (`ddp`) and "
                "`fully_shard` (`fsdp2`). `bit_identical` covers all three. "
                "`ddp_step_over_manual_allreduce_step` compares failure-free median step "
                "times (DDP overlaps its all-reduce with the backward; on 2 cores that "
                "overlap competes with compute). `step_time_after_recovery_over_before`: "
                "a DDP job, the survivor's median step time in the 50 steps after a "
                "worker SIGKILL over the 50 before; it was about 4 while abandoned gloo "
                "threads spun (ADR 0002, replaced by 0015). The windows include a warm "
                "spare starting on the same 2 cores on both sides. Steps are short, so the "
                "figure is noisy: quick runs gave 1.09, 1.09 and 0.97. "
                "A recovery now also reseeds the replacement's replicas (ADR "
                "0018): the newcomer receives its source's state too, twice the bytes on "
                "2 ranks. Quick run after it: 0.130 / 0.131 (DDP) / 0.148 (FSDP2) of a "
                "restart (0.10 / 0.14 / 0.14 before), step time after 1.05x; the "
                "survivor's transfer phase went from about 0.14 s to 0.19 s. ADR 0028 "
                "(2026-11-25): the provider sends its replica where it lies, and a reseed "
                "skips what the holder's own snapshot has (pure DP: half the bytes). Full "
                "mode went from 0.30 / 0.29 / 0.28 to 0.21 / 0.22 / 0.23, "
                "quick mode to 0.09 / 0.12 / 0.14. Full mode misses 0.15 on replay: a kill "
                "in step K's backward replays K-1 and K (K-1's round ends about 0.1 s into "
                "K, its copy niced, ADR 0013), 0.42 s of DDP's 0.98 s recovery and 0.78 s "
                "of FSDP2's 1.20 s. On 2026-11-27 (the run below, same recovery "
                "code): 0.19 / 0.20 / 0.23, step time after 1.12x (1.06x in the full run before). "
                "Whether K-1 is replayed is a race between the kill and K-1's round: in "
                "three stand-alone DDP kill runs that day (no baseline in them), 0.73 s "
                "from the kill to step K done where K-1 had committed, 1.12 s and 1.71 s "
                "where it had not. A quick run the same day: 0.09 / 0.09 / 0.14, step time "
                "after 1.05x, bit-identical. At the default interval (`auto`, ADR 0032; "
                "2026-11-27): the kill at step 35 lands in the probe "
                "(every 8 steps), the target is 32 and 2 completed steps are replayed "
                "(`steps_replayed`): 0.23 / 0.23 / 0.24 (1.33 s against a 5.9 s "
                "restart). After the probe a failure replays up to the interval chosen "
                "(hundreds of steps at this job's CPU-bound costs for an assumed 3 h "
                "MTBF, tens of seconds of work); this bench does not measure that case "
                "(the goodput model counts half an interval per failure). "
                "`replication.every_n_steps=1` keeps the former behaviour. 2026-11-28, "
                "after the side channel's waits moved to waiter threads that an abort "
                "releases (ADR 0037), two full runs in a row: 0.234 / 0.229 / 0.251 "
                "(step time after 1.19x) and 0.234 / 0.219 / 0.266 (0.97x; the run "
                "below): the same recovery as before within the noise. 2026-11-28, with "
                "live rollback (ADR 0039, on by default): the data-parallel kills go on "
                "from step 34 and replay nothing (`steps_replayed` 0, was 2): 0.179 / "
                "0.159 / 0.259 (the run below; FSDP2 has no live rollback and still "
                "replays 2 steps), step time after 1.03x. The replay is gone but the "
                "live handover costs more than the snapshot one: the survivor's "
                "transfer part went from about 0.29 s to 0.64 s (encode the live model "
                "and optimizer 0.18 s, send 0.15 s, the newcomer's restore 0.11 s, then "
                "the live step snapshotted and committed inside the recovery 0.16 s). At "
                "this kill (2 steps after the probe's snapshot) that nearly cancels out; "
                "the gain grows with the steps since the last snapshot (after the probe, "
                "half an interval of tens to hundreds of steps), which this bench does "
                "not measure. An earlier run the same day, on a host loaded by other "
                "tests, gave 0.378 / 0.113 / 0.425 (restart times 7.3-13.5 s): noise. "
                "Later on 2026-11-28 the live handover sends from the live step's slot "
                "(ADR 0039 addendum): a survivor captures L before the handover, the "
                "provider sends from that slot, the commit replicates it, and the "
                "newcomer receives into a slot its own capture of L then reuses. Fresh "
                "200 MB buffers had cost more than the copies (page faults). The "
                "transfer part went from 0.64 s to 0.41-0.43 s (survivor: capture "
                "0.06 s, send 0.19 s, wait for the newcomer's restore 0.09 s, commit "
                "0.06 s; newcomer: receive 0.26 s, restore 0.09 s). Three full runs: "
                "0.136 / 0.152 / 0.222, 0.140 / 0.124 / 0.266 and 0.145 / 0.135 / 0.279 "
                "(the run below). The targets are now 0.10 and 1.05x. Not met: of a "
                "0.9 s recovery, 0.3 s is step K run again (a restart runs it too) and "
                "0.26 s is 200 MB crossing loopback TCP on 2 cores. Step time after: "
                "1.19x in the first of those runs. The interval policy had put every "
                "step in force at step 64, from a snapshot cost that read 0 at every 8 "
                "steps; the budget's interval now at most halves per agreement (ADR 0032 "
                "addendum): 0.95x in the run below. (A run between had each rank decide "
                "the halving from its own proposal: their intervals split, 4 and 3, and "
                "the next round failed with the ranks on different steps. The rule is "
                "now agreed with the interval.) 2026-11-29, a replacement on the "
                "survivor's host reads its state in place from the survivor's slot in "
                "shared memory (ADR 0040) while a thread touches its own slot: the "
                "transfer part went from 0.36-0.43 s to 0.23-0.40 s (newcomer: map 0.06 s, "
                "verify and restore 0.12-0.25 s; nothing received). The figures did not "
                "move beyond the noise: 0.149 / 0.138 / 0.237 the same morning before it, "
                "then 0.137 / 0.145 / 0.282, 0.154 / 0.116 / 0.261 and 0.136 / 0.122 / "
                "0.237 (the run below, restart times 7.8-9.4 s against 5.6-7.4 s earlier "
                "that day; step time after 1.09x, 0.98-1.07x in the others). On this "
                "2-core host the run-to-run spread of the recovery (0.8-1.1 s) is larger "
                "than the 0.1-0.2 s the in-place read saves; what is left is step K run "
                "again (0.26-0.3 s), waiting for the warm spare to reach its rendezvous "
                "(0.07-0.19 s: it runs the script and builds the model first), the "
                "survivor's capture of L (0.05 s) and the commit inside the recovery "
                "(0.06 s). What this does not capture: a replacement on another node "
                "still receives over the network, as before. 2026-11-29 later, with ADR "
                "0041 (the agent wakes on a worker's SIGCHLD; the survivor captures L "
                "while the rendezvous waits for the spare; a replacement's DDP "
                "constructor skips the weight broadcast that completes locally; "
                "`all_reduce_gradients` keeps its flat buffer; the replica check hashes "
                "in place), on an idle host, four full runs: 0.101 / 0.098 / 0.298, "
                "0.114 / 0.096 / 0.270, 0.108 / 0.114 / 0.272 (before the last two "
                "changes) and 0.113 / 0.091 / 0.280 (the run below); step time after "
                "0.97-1.02x. The first run of that day, on the same idle host before "
                "these changes, gave 0.124 / 0.122 / 0.282 (restart 5.0 s, recovery "
                "0.62 s): on an idle host the restart is 4.6-5.4 s, not the 7.8-9.4 s "
                "of the runs above, so the ratios move less than the seconds. A "
                "data-parallel recovery is now 0.48-0.60 s: the kill to the "
                "replacement's rendezvous 0.08-0.09 s, its verify and restore of the "
                "mapped slot 0.11-0.13 s, the commit of L 0.04-0.05 s, and step K run "
                "again 0.26-0.29 s (a steady step is 0.20-0.23 s). So the manual and "
                "DDP figures sit at the 0.10 target, on either side of it from run to "
                "run. FSDP2 cannot reach it on this host: its step is 0.42-0.50 s and "
                "the restart 5.5-6.2 s, so step K run again is already 0.08-0.09 of "
                "a restart; at the default interval the kill also replays 2 steps "
                "(the probe's snapshot is step 32), and with "
                "`replication.every_n_steps=1` a stand-alone run still replayed K-1 "
                "(its round had not committed when the kill came; 1.24 s). Quick mode "
                "the same day: 0.062 / 0.052 / 0.169, step time after 1.00x. "
                "2026-11-29, after a durable-tier fix and two live-rollback "
                "bookkeeping fixes off the timed path, two more full runs on an idle "
                "host: 0.104 / 0.110 / 0.253 and 0.109 / 0.097 / 0.271 (the run "
                "below; restart 6.1 s, step time after 1.00x); quick 0.058 / 0.050 / "
                "0.155, step time after 1.00x. Over six full runs the data-parallel "
                "figures lie between 0.091 and 0.114: the target is not reliably met. "
                "2026-12-03, with update logs (ADR 0049): the FSDP2 kill goes on from "
                "step 34 (`fsdp2.live` true, `steps_replayed_fsdp2` 0; the replacement "
                "ran 2 optimizer steps on its logged gradients, "
                "`fsdp2.optimizer_steps_replayed`), bit-identical: 0.078 / 0.061 / 0.154 (manual "
                "/ DDP / FSDP2; restart 13.8 s, FSDP2's recovery 2.26 s against its 14.6 s "
                "restart), step time after 1.04x. The "
                "host was slower that day (restarts 13.8-14.6 s against 5.5-6.2 s "
                "before, FSDP2's step 0.95 s against 0.42-0.50 s). Of FSDP2's recovery, "
                "the handover (`transfer_s`) is 1.15 s: the replica of step 32 "
                "and two marks sent, two optimizer steps, then step 34 snapshotted and "
                "committed inside the recovery; step 35 run again is the rest. What "
                "this does not capture: kills later in a long interval (the replay "
                "they avoid grows with it; tests/test_sharded_live_rollback.py kills "
                "40 steps after the snapshot), HSDP, a GPU.",
    },
    "bench_persist": {
        "title": "Durable tier, async persistence (the writer on its own)",
        "accept": {
            "block_over_sync": ("<=", 0.05),
            "throughput_during_persist_ratio": (">=", 0.85),
            "persist_over_raw_write": ("<=", 1.5),
        },
    },
    "bench_lightning": {
        "title": "Lightning: in-process recovery vs torchrun restart with ckpt_path",
        "accept": {"lightning_recovery_over_restart": ("<=", 0.1),
                   "lightning_detect_s": ("<=", 1.0),
                   "bit_identical": ("==", True)},
        "note": "Rank 1 SIGKILLed in a training step's backward, with DDP's all-reduce "
                "and Lightning's own per-batch broadcast on the runtime's process group "
                "(no comm hook). `lightning_detect_s` runs from the kill "
                "to the survivor's `failure_detected` (60 s, the collective timeout, "
                "before ADR 0015). Earlier quick runs: detect 0.02-0.32 s, "
                "`lightning_recovery_over_restart` 0.15-0.23; most of the recovery is the "
                "warm spare running the script up to `fit` (0.4-0.5 s, the survivor's "
                "`rendezvous_join_s`). With the observed loop state in "
                "every snapshot and rank 0's logged rows held until their step commits, "
                "three quick runs on an idle host: 0.11, 0.15 and 0.40 "
                "(`lightning_recovery_s` 0.42, 0.58, 1.53 s; the 0.40 run's spare took "
                "0.86 s to reach `fit`); detect 0.02-0.45 s. This job has no logger, so "
                "the held rows are not in these figures. At the default interval (`auto`, "
                "ADR 0032; the run below, 2026-11-27, full mode): the kill at step 25 "
                "found step 24's round not yet committed (the race a kill right after a "
                "snapshot meets), so the job went back to step 16 and replayed 8 steps: "
                "2.13 s, 0.29 of the restart (0.17 the run before, with every step "
                "snapshotted, 1 step replayed). 2026-11-29, Lightning goes on from its "
                "newest snapshot whether or not its round committed (ADR 0039, addendum "
                "2): the same kill goes on from step 24 and replays nothing. Three full "
                "runs: 0.081, 0.088 and 0.091 (the run below; recovery 0.77-0.81 s, "
                "restart 8.4-9.8 s that day, 7.4 s two days before: against 7.4 s the "
                "same recoveries would be 0.10-0.11). A kill later in an interval still "
                "replays from that interval's snapshot: Lightning marks no other step. "
                "Later on 2026-11-29, with ADR 0041 (the agent wakes on the worker's "
                "SIGCHLD; the spare's DDP constructor, which Lightning's strategy builds, "
                "skips the weight broadcast that completes locally): 0.077 (the run "
                "below: recovery 0.48 s against a 6.2 s restart, nothing replayed).",
    },
    "bench_goodput": {
        "title": "Chaos soak: goodput under random failures",
        "accept": {"goodput_over_bound": (">=", 0.9), "bit_identical": ("==", True),
                   "false_losses": ("==", 0)},
        "note": "Quick mode: 2-3 failures, and one run is one sample: on this 2-core host a "
                "false node loss (a starved agent) sinks a run now and then. "
                "docs/guide/operations.md, Chaos soak, gives the spread over runs and the "
                "last full-mode figures (`make bench`, 50 failures, about 12 min). "
                "`baseline_bit_identical` compares torchrun's chaos run with torchrun's own "
                "failure-free run; `baseline_reference_identical` (against ours) is false "
                "with 3+ ranks, because the runtime sums float all-reduces in rank order "
                "and gloo's ring does not (ADR 0015). Earlier full-mode runs, "
                "seeds 0, 1, 2 in a row, each bit-identical with every fault fired: "
                "50, 53 and 51 failures, 39, 43 and 40 incidents all recovered "
                "in-process, `goodput_over_bound` 0.93, 1.01 and 1.03, "
                "`goodput_over_baseline` 3.87, 4.46 and 1.92 (seed 2's chaos run had one "
                "recovery whose teardown stalled 120 s, the replication timeout, while "
                "a gloo group was destroyed on the main thread: a known defect, see "
                "docs/guide/operations.md). At the default interval (`auto`, ADR 0032), "
                "2026-11-27, full mode, seed 0 (the run below): bit-identical, 50 faults, "
                "39 incidents all recovered in-process, `goodput` 0.24 (0.35 with every step "
                "snapshotted), `goodput_over_baseline` 2.23 (3.87), `goodput_over_bound` "
                "2.54 (the bound counts the longer replays: `lost_work_s` 1.01 s per "
                "incident); steady overhead 1.9 %. A first run of the change, before "
                "the interval policy dropped the steps around a recovery as samples and "
                "let frequent failures override the budget (ADR 0032), had chosen "
                "intervals of 500-860 steps from snapshot costs misread at 290-450 ms: "
                "the commit stalled at step 541, and the job stopped when a run of "
                "failures left no copy of it.",
    },
    "bench_metrics": {
        "title": "What the operator's view costs the step (metrics, status, stragglers)",
        "accept": {"metrics_cost_over_step": ("<=", 0.005)},
        "note": "The training thread's part (the progress report's end-of-step record and "
                "the in-flight clock around each collective, timed in a tight loop and "
                "multiplied by what one step of a real job does: a 2-layer GPT under DDP, "
                "1 node x 2 ranks, with `--metrics-port`) over that job's step time, plus "
                "the watchdog thread's progress write per heartbeat and the agent's "
                "scrape, scraped once a second (15x Prometheus's default), as if both fell "
                "on the step: an upper bound. The part on the step itself is "
                "`train_thread_cost_over_step`. Not captured: an agent with hundreds of "
                "ranks (a scrape reads one file per rank), a GPU (NCCL completes its "
                "futures at enqueue, so the in-flight clock sees the host side only).",
    },
    "bench_overhead_sharded": {
        "title": "The update log's always-on cost for an FSDP2 job",
        "accept": {"log_overhead_cpu": ("<=", 0.05), "log_overhead_device": ("<=", 0.03)},
        "note": "The same FSDP2 job (2 nodes x 1 worker, `fully_shard` on 4 linear "
                "layers of width 1024) at the defaults, with live rollback and its "
                "update logs (ADR 0049) and with `recovery.live_rollback=false`, "
                "alternated on/off/on/off in one run; median step time from step 65 "
                "(after the probe) on over off. `device`: the same steps plus a 300 ms "
                "idle wait standing for a device's kernels. `log_bytes_per_rank`: what "
                "one rank's logs held at the end, next to `state_bytes_per_rank`. "
                "2026-12-03, full mode, this host idle, first cut: +26 % on CPU-bound "
                "steps (0.269 s against 0.214 s) and +8.8 % on device-like steps. Then the "
                "mark copies the gradient shard (8 MB here) once, hashing it in the same "
                "pass, straight into a reused message: a full run gave +41 % / +12 % (off "
                "0.167 s a step); timed in the workers, a mark took 24 ms of the training "
                "thread, 4.6 ms its capture and 17-18 ms the wait for it to leave (up to "
                "50 ms). Then the step stopped waiting: +96 % / +11 % (the run below; off "
                "0.117 s, on 0.231 s). On CPU-bound steps the step with logs stays near "
                "0.23 s while the one without moves with the host, so what is left is "
                "background work on the same 2 cores (not yet taken apart): 8 MB a step "
                "sent and received over loopback by each rank, each received mark in fresh "
                "pages, and the logs holding 605 MB per rank against a 42 MB state (the "
                "default budget is most of the host's RAM, so the interval chosen, not "
                "memory, bounds them). Targets 0.05 and 0.03: not "
                "met. Not captured: a GPU (the mark's copy is a device-to-host copy "
                "there), a network between the "
                "ranks (loopback here), more than one source per holder.",
    },
    "bench_overhead": {
        "title": "The always-on cost: the runtime vs plain training, and where it pays",
        "accept": {
            "overhead_plain_k2_every1_device": ("<=", 0.03),
            "overhead_plain_default_cpu": ("<=", 0.03),
            "overhead_plain_default_device": ("<=", 0.03),
            "goodput_ratio_at_mtbf_3h": (">=", 1.0),
            "goodput_ratio_at_mtbf_3h_cpu": (">=", 1.0),
        },
        "note": "The same 2-rank job (2 nodes x 1 worker, each rank its own state) plain "
                "under torchrun, under the runtime at k=1 and at k=2, snapshots every step "
                "and every 8, on cpu-bound steps (real compute sharing the 2 cores) and "
                "device-emulated steps (the host waits natively for an emulated GPU step, "
                "see docs/performance.md for what that captures and what it does not). "
                "Headline keys at 0.5 GB/s of state per rank per second of step; every "
                "point of the sweep is in the JSON. k1 and k2 pin `every_n_steps=1` (the "
                "phases choose which steps snapshot). `overhead_plain_default_<kind>`: a "
                "job with no settings at all (the default interval, `auto`, ADR 0032), "
                "every one of its 1,120 steps timed, the probe's 64 (every 8 steps) "
                "included; `_steady_` from step 96 on, in whole intervals; "
                "`default_interval_steps_<kind>` and `default_reasons_<kind>` are the "
                "runtime's own choice and words. Its reference is plain's 0.5 GB/s step "
                "measured twice, by the plain job before it and by a short plain job "
                "right after it (`plain_step_s_<kind>_0.5_after_default`), and averaged: "
                "a linear drift of the host over the four minutes between cancels "
                "(`plain_drift_<kind>`: the second against the first; -0.4 % and 0.0 % "
                "in the run below, +1.9 % and +6.6 % in two quick runs the same day). "
                "2026-11-28, full mode, the run below (load average 1.8-2.3 around the "
                "CPU-bound jobs): +1.8 % on CPU-bound steps (+0.5 % steady; -0.4 % "
                "against the same run's snapshot-free steps; every 258 steps, Daly's for "
                "an assumed 3 h MTBF) and +0.15 % on device-like steps (every 83 steps). "
                "The run before (2026-11-27, one plain job as the reference, load up to "
                "3.8) gave +3.3 % and +0.5 %, and a second CPU-bound run that evening "
                "(load up to 4.0) +4.6 %: on this host a single pair of CPU-bound jobs "
                "moves by a few percent with the load. Before `auto` was the default, "
                "the default (every step) cost +50 % (CPU) and +1.1 % (device) here "
                "(`overhead_plain_k2_every1_*`). Not understood: "
                "`overhead_plain_k2_nosnap_cpu`, the k=2 job's steps without a snapshot, "
                "read +6.0 % (+8.9 % the evening before), while the default job, whose "
                "steps carry the same runtime (k=2 replicas included), read +0.5 % "
                "steady, snapshots included; the k=2 job runs last of the CPU-bound "
                "jobs, at a load of 3.0-3.4. "
                "`goodput_ratio_at_mtbf_3h` (device-like steps) and `_cpu` and "
                "`crossover_mtbf_s` (target null or > 24 h) come from "
                "benchmarks/goodput_model.py fed with this run's costs and "
                "bench_recovery's recovery and restart times, at the default settings' "
                "steady state (the runtime has learnt the failure rate): 1.0025 and "
                "1.0004; with its estimate off by 2x either way 1.0024 and 1.0001; with "
                "no MTBF at all (the budget's interval, the former `auto`) 0.993 and "
                "0.986. On CPU-bound steps the margin is within the noise of the inputs "
                "(the run before gave 1.0017, its CPU-bound rerun 0.9975). "
                "Timings on this shared 2-core host move with its load: `load_avg_1m` "
                "lists the 1-minute load average around each job. After the GPU path's "
                "changes (ADR 0038: CUDA stream ordering in the process group, the GPU "
                "snapshot tier, which `auto` resolves to host memory on CPU hosts), "
                "quick runs side by side with the code before them, 2026-11-28: "
                "`overhead_plain_default_cpu` +5.8 %, +4.1 % and +0.0 % after against "
                "-1.6 % and +7.1 % before; `_device` +0.49 %, +0.62 % and +0.57 % "
                "against +0.61 % and +0.58 %: no change beyond the quick mode's noise. "
                "The full run below predates them.",
    },
    "bench_dataloader_cache": {
        "title": "Data loader cache",
        "accept": {
            "removed_fraction": (">=", 0.9),
            "first_batch_cached_over_uncached": ("<=", 0.1),
        },
    },
    "bench_node_loss": {
        "title": "Node loss with the store in node 0 (c10d) or in etcd",
        "accept": {
            "node_loss_recovery_s": ("<=", 5.0),
            "partition_recovery_s": ("<=", 8.0),
            "node0_loss_recovered": ("==", True),
            "node0_loss_bit_identical": ("==", True),
            "etcd_over_c10d_node_loss": ("<=", 1.5),
            "slurm_over_plain_node_loss": ("<=", 1.2),
            "slurm_node_loss_bit_identical": ("==", True),
        },
        "note": "One 2-node x 2-worker job with a spare node, at the default liveness "
                "settings (heartbeat timeout 15 s, interval 1 s), runs in one invocation: "
                "node 1 SIGKILLed under "
                "c10d and under etcd (3 members on loopback), node 0 SIGKILLed under "
                "etcd (under c10d that ends the job), node 1's link cut in network "
                "namespaces with etcd in a namespace of its own, and node 1 SIGKILLed in "
                "a job under Slurm, with its failure-free reference. Recovery is measured "
                "from the kill (or the cut) to the last rank's first step after the "
                "recovery. A killed node is detected from its agent's closed connections "
                "(about two heartbeat intervals), a partitioned one from its kernel's "
                "unanswered TCP keepalives on the same connections (about 4 s, then two "
                "intervals of silence: ADR 0036's addendum). Before the keepalives the "
                "partition took the heartbeat timeout (15.7 s from the cut, 2026-11-28), "
                "and before this run the benchmark ran at a 3 s timeout. The rest is the "
                "replacement workers' start on the spare node and the rendezvous. "
                "etcd shares the host's 2 cores with the job; real etcd "
                "members on their own machines and real network latency are not "
                "captured. Quick mode compares node 0's run with the c10d recovered run, "
                "not with a failure-free one (the test suite does that: "
                "tests/test_etcd_job.py, tests/test_partition.py). The Slurm run is the "
                "c10d run's loss in a job submitted through examples/slurm/train.sbatch "
                "to a real Slurm 22.05 (one slurmd per network namespace): its nodes talk "
                "over veth pairs and a bridge where the plain run uses loopback, and "
                "Slurm's controller and daemons share the 2 cores.",
    },
    "bench_allreduce": {
        "title": "A DDP step at 4 and 6 ranks: default settings against plain torchrun",
        "accept": {
            "ddp_step_default_over_plain_gloo_4": ("<=", 1.05),
            "ddp_step_default_over_plain_gloo_6": ("<=", 1.05),
            "allreduce_bytes_per_rank_over_ring": ("<=", 1.1),
            "ordered_sums_default": ("==", 0),
        },
        "note": "examples/gpt.py's TinyGPT (dim 256, 4 layers, sequence 64, batch 8 per "
                "rank, 12.8 MB of gradients) under DDP, one torch thread per rank, all "
                "ranks on this host: plain torchrun --standalone with gloo, then "
                "checkpointless run --standalone with no settings (snapshots at the auto "
                "interval and their replicas included in the mean step), then the same "
                "with recovery.ordered_allreduce=true (`..._ordered_...`). Bytes are what "
                "a rank wrote to its sockets per all-reduce of the gradients' size, after "
                "training (/proc/self/io), over a ring's 2(N-1)/N; "
                "`gather_sum_bytes_over_ring_<N>` is what the all-gather-then-add the "
                "default used before sent, by arithmetic. 4 and 6 ranks share 2 cores, so "
                "steps are CPU-bound; another host's network, NCCL and a failure are not "
                "captured (bit-identity after a kill is tested in tests/test_ddp_layout.py).",
    },
    "bench_elastic": {
        "title": "No spare node: shrinking in place against torchrun elastic",
        "accept": {
            "shrink_over_elastic_restart": ("<=", 0.2),
            "throughput_after_shrink_over_ideal": (">=", 0.9),
            "samples_lost": ("==", 0),
            "samples_repeated": ("==", 0),
        },
        "note": "A DDP job (an MLP of 4 x 512 x 512, a DataLoader over a DistributedSampler, "
                "batch 32 per rank, 2 nodes x 1 worker on this host, no spare node): node 1 "
                "(agent and worker) SIGKILLed at step 40. checkpointless shrinks to 1 rank, "
                "which takes both ranks' batches (the global batch kept), against torchrun "
                "--nnodes=1:2 (c10d, elastic) restarting the survivor at world size 1 from "
                "a synchronous DCP checkpoint taken every 10 steps. Times run from the kill "
                "to the first step completed at 1 rank; full mode runs both at their "
                "defaults (checkpointless declares a killed node lost two heartbeat "
                "intervals, 2 s, after its agent's connections close, and with no spare "
                "node in the job shrinks at once; torchrun's rendezvous waits its last "
                "call, 30 s), quick mode shortens both (a 0.5 s interval against a 3 s "
                "last call). A partitioned node would take checkpointless's heartbeat "
                "timeout, 15 s, to declare: not measured here. "
                "`shrink_detect_s` is the part before the loss is declared, "
                "`shrink_after_decision_s` the re-run of the script at the new size and "
                "the rollback. The throughput ratio compares steps at 1 rank (two batches) "
                "with steps at 2 ranks (one each, plus a gloo all-reduce): on a 2-core host "
                "the 2-rank steps compete for the cores, so the ratio is far above what a "
                "cluster would see (ideal scaling gives 1.0). Samples are each step's "
                "global set against the failure-free run's; the final weights deviate "
                "(`final_max_rel_dev`): the sums run in another order after the shrink.",
    },
    "bench_scale": {
        "title": "Control plane at scale: commit, liveness, rendezvous, model to 16k",
        "accept": {
            "commit_growth_64_to_1024": ("<=", 2),
            "store_ops_per_step_per_node_growth_64_to_1024": ("<=", 1),
            "predicted_commit_ms_16384": ("<=", 1000),
            "predicted_recovery_s_16384": ("<=", 15),
        },
        "note": "Simulated ranks are threads of one process running the real protocol "
                "code (docs/scale.md). The tree commit is timed in virtual time (per-rank "
                "clocks, protocol CPU by thread_time, a gloo link latency calibrated in "
                "the same run); the store count, liveness and rendezvous in wall clock "
                "against one real TCPStore, every request and key counted. Store "
                "operations per step per node: the job's requests / nodes (the tree: 2 "
                "per step for the whole job, by rank 0; `_max_node` is the busiest "
                "node); 'the same at 64 and 1024' is read as 'does not grow' (ratio <= "
                "1). `predicted_recovery_s_16384` composes detection of a crashed node (its "
                "agent's connections closed by its kernel: two heartbeat intervals of "
                "confirmation and one of polling, launcher/peer_link.py; `_silent`: a "
                "machine off or cut, after TCP keepalive gives up, 4 s more; `_stalled`: "
                "the heartbeat timeout, 15 s), the rendezvous measured on this checkout "
                "(`rendezvous_impl`), a handover and a process-group re-creation that "
                "are stated assumptions (10 s at 16k ranks: no measurement at scale "
                "here; no torch API shortens it for a replacement, ADR 0047). The 2-core "
                "host makes every "
                "wall-clock figure an upper bound of what a cluster's store would see.",
    },
}


def _ok(value, op: str, bound) -> bool:
    return {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[op]


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    text = ", ".join(f"{k} {_fmt(x)}" for k, x in v.items()) if isinstance(v, dict) else str(v)
    # Long values (a schedule, the incident log) stay whole in latest.json.
    return text if len(text) <= 160 else text[:157] + "..."


def render(results: dict, quick: bool) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Latest figures (each benchmark's last run; rendered "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}) on "
        f"{platform.machine()} with {_cpus()} CPU cores, no GPU, {_modes(results, quick)}. "
        "Every ratio is taken side by side in one run.",
        "",
        "Reproduce: `make bench` (full) or `.venv/bin/python -m benchmarks.run_all --quick`;",
        "one benchmark: `.venv/bin/python -m benchmarks.<name> [--quick]` (last stdout line is",
        "JSON). Raw results: `benchmarks/results/latest.json`.",
        "",
        "`benchmarks/bench_gpu.py` (the snapshot stall and copy throughput on a GPU, and the",
        "GPU snapshot tier's rollback against host memory) runs only on a CUDA machine and",
        "is not part of this page: it has not run yet ([docs/gpu.md](docs/gpu.md)).",
        "",
    ]
    for name, spec in BENCHES.items():
        r = results.get(name)
        lines += [f"## {spec['title']}: `benchmarks/{name}.py`", ""]
        if r is None or "error" in r:
            lines += [f"Did not complete: {r.get('error') if r else 'not run'}", ""]
            continue
        lines += [f"{'Quick' if r.get('quick', quick) else 'Full'} mode.", "",
                  "| figure | value | target | met |", "|---|---|---|---|"]
        for key, (op, bound) in spec["accept"].items():
            v = r.get(key)
            met = "yes" if v is not None and _ok(v, op, bound) else "**no**"
            lines.append(f"| `{key}` | {_fmt(v)} | {op} {bound} | {met} |")
        if spec.get("note"):
            lines += ["", spec["note"]]
        lines += ["", "<details><summary>all figures</summary>", "", "| key | value |",
                  "|---|---|"]
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in sorted(r.items())]
        lines += ["", "</details>", ""]
    return "\n".join(lines) + "\n"


def _modes(results: dict, quick: bool) -> str:
    """'quick mode', 'full mode', or a pointer to each section when runs differ."""
    modes = {bool(r.get("quick", quick)) for r in results.values() if isinstance(r, dict)}
    if len(modes) > 1:
        return "quick or full mode as each section says"
    return f"{'quick' if (modes.pop() if modes else quick) else 'full'} mode"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    latest = REPO / "benchmarks" / "results" / "latest.json"
    results: dict[str, dict] = {}
    if args.only and latest.exists():  # re-run some, keep the others' latest figures
        results = {k: v for k, v in json.loads(latest.read_text()).items() if k in BENCHES}
    for name in BENCHES:
        if args.only and name not in args.only:
            continue
        progress(f"running {name}")
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        last = proc.stdout.strip().splitlines()[-1:] or [""]
        try:
            results[name] = json.loads(last[0])
        except json.JSONDecodeError:
            results[name] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
        progress(f"{name}: {json.dumps(results[name])[:300]}")
    out = REPO / "benchmarks" / "results"
    out.mkdir(exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    (REPO / "BENCHMARKS.md").write_text(render(results, args.quick))
    progress("BENCHMARKS.md rewritten")


if __name__ == "__main__":
    main()
