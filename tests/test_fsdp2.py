"""FSDP2 (DTensor-sharded) state round-trips bit-exactly on CPU with gloo.

Two real processes shard a model with ``fully_shard``; each snapshots its local
shards, rolls back and replays, and restores the snapshot into freshly built objects
(what a replacement rank does), matching the first pass exactly.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_fsdp2_snapshot_rollback_and_fresh_restore(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outs = [tmp_path / f"r{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.workers.fsdp2_worker", str(r),
                          str(port), str(outs[r])], cwd=REPO)
        for r in range(2)
    ]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for out in outs:
        result = json.loads(out.read_text())
        assert result == {"rollback_ok": True, "fresh_ok": True, "dtensor": "DTensor"}
