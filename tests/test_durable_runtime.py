"""The runtime persists committed snapshots through the durable tier during a real run.

A 2-worker job under ``checkpointless run`` with ``persistence.*`` set writes durable
checkpoints in the background; retention keeps ``keep_last`` of them, the history CSV
records every save, and the newest checkpoint loads into freshly built objects with
exactly the state the run ended with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from examples.gpt import CharData, TinyGPT, lr_lambda, make_corpus, state_digest
from replication.durable import latest_checkpoint, list_checkpoints, load, read_history
from replication.training_state.state import TrainingState

REPO = Path(__file__).resolve().parent.parent
STEPS = 12


def test_run_persists_committed_snapshots_and_they_load_exactly(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node", "2",
           "--run-dir", str(run), f"persistence.path={ckpt}", "persistence.every_n_steps=4",
           "persistence.keep_last=2", str(REPO / "examples" / "train_gpt.py"), "--steps",
           str(STEPS), "--dim", "32", "--layers", "1", "--step-sleep", "0.3"]
    proc = subprocess.run(cmd, cwd=REPO, timeout=240, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]

    steps = [c.step for c in list_checkpoints(str(ckpt))]
    assert len(steps) == 2 and steps[-1] == STEPS, steps  # retention, and the final step
    rows = read_history(str(ckpt))
    assert {r["status"] for r in rows} >= {"ok"}
    # The agent's last line reads the outcome back from storage and sums up the saves.
    ok = sum(r["status"] == "ok" for r in rows)
    done = [line for line in proc.stderr.splitlines() if "job done" in line]
    assert len(done) == 1, proc.stderr[-2000:]
    assert f"durable: newest complete checkpoint step {STEPS} ({len(rows)} rank saves: " \
           f"{ok} ok" in done[0], done[0]

    # A replacement's view: fresh objects, restored from the newest durable checkpoint.
    data = CharData(make_corpus(), 32, 8, rank=0, world=2, seed=0)
    torch.manual_seed(0)
    model = TinyGPT(data.vocab_size, 32, 1, seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(10, STEPS))
    state = TrainingState()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched),
                      ("loader", data)):
        state.register(name, obj)
    load(latest_checkpoint(str(ckpt)), state, rank=0, world_size=2)
    final = json.loads((run / "final_rank0.json").read_text())
    assert state_digest(model, opt) == final["digest"]
    assert data.order_hash == final["data_order"] and data.position == STEPS
