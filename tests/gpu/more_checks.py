"""The GPU checks that start processes of their own: forked spares, a fresh replacement,
a one-rank NCCL generation cycle, and Lightning on the GPU (``run_gpu_check.py`` runs
each in a spawned process under its own timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")


# -- 2: a spare forked after the zygote's warm-up uses CUDA ------------------------------

_ZYGOTE_DRIVER = textwrap.dedent('''
    import json, os, sys, time
    from launcher import reaper
    from launcher.worker_procs import SparePool
    from launcher.zygote import Zygote, fork_hazard

    script, out0, out1 = sys.argv[1:4]
    events = []
    assert reaper.become_subreaper()
    z = Zygote(dict(os.environ), lambda event, **f: events.append(event))
    z.start()
    deadline = time.monotonic() + 120
    while not z.ready(wait_s=0.1):
        assert time.monotonic() < deadline, "the zygote never got ready"
    spare = z.fork_spare()
    time.sleep(4.0)  # past the spare's grace: it warms a context and a cuBLAS handle
    first = z.fork_spare()  # assigned at once, like a first worker
    t0 = time.monotonic()
    assert SparePool.assign(first, {"RANK": "1", "OUT": out1}, [script], False)
    assert SparePool.assign(spare, {"RANK": "0", "OUT": out0}, [script], False)
    codes = [p.wait(timeout=120) for p in (spare, first)]
    errs = [p.stderr.read().decode(errors="replace")[-2000:] for p in (spare, first)]
    z.stop()
    print(json.dumps({"codes": codes, "stderr": errs, "events": events}))
''')

_CUDA_SCRIPT = textwrap.dedent('''
    import json, os, time
    import torch
    t0 = time.perf_counter()
    was = torch.cuda.is_initialized()
    x = torch.randn(512, 512, device="cuda", requires_grad=True)
    (x @ x).sum().backward()  # cuBLAS and the autograd engine's device thread
    torch.cuda.synchronize()
    with open(os.environ["OUT"], "w") as f:
        json.dump({"initialised_before_script": was,
                   "first_cuda_work_s": time.perf_counter() - t0,
                   "grad_ok": bool(torch.isfinite(x.grad).all())}, f)
''')


def check_zygote_spare_cuda() -> dict[str, Any]:
    """A spare forked from the real zygote after its warm-up, and a worker forked and
    assigned at once, both run CUDA work (a matmul and its backward); the zygote never
    refused a fork. The spare's first CUDA work is cheaper: it warmed while it waited."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "cuda_work.py"
        script.write_text(_CUDA_SCRIPT)
        outs = [Path(tmp) / "spare.json", Path(tmp) / "first.json"]
        proc = subprocess.run([sys.executable, "-c", _ZYGOTE_DRIVER, str(script),
                               *map(str, outs)], cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["codes"] == [0, 0], out["stderr"]
        assert "zygote_failed" not in out["events"], out["events"]
        spare, first = (json.loads(p.read_text()) for p in outs)
    assert spare["grad_ok"] and first["grad_ok"]
    assert spare["initialised_before_script"], "the spare did not warm CUDA while waiting"
    return {"spare_first_cuda_work_s": round(spare["first_cuda_work_s"], 4),
            "first_worker_first_cuda_work_s": round(first["first_cuda_work_s"], 4)}


# -- 7: a fresh replacement restores bit-exactly, then dropout steps agree --------------

def _launch(run_dir: Path, overrides: list[str], spares: int,
            device: str = "cuda:0") -> dict[str, Any]:
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
           "2", "--run-dir", str(run_dir), "--spares", str(spares), *overrides,
           str(REPO / "tests/gpu/train_gpu.py"), "--steps", "16", "--device", device]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, f"job exited {proc.returncode}: {proc.stderr[-1500:]}"
    out = {f"{kind}{r}": json.loads((run_dir / f"{kind}_rank{r}.json").read_text())
           for kind in ("final", "losses") for r in (0, 1)}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
              if line.strip()]
    out["starts"] = [e.get("started") for e in events
                     if e.get("event") == "worker_start" and e.get("replacement")]
    return out


def check_replacement_restore_dropout(device: str = "cuda:0") -> dict[str, Any]:
    """Rank 1 SIGKILLed in step 8's backward with no spare: a new process (forked from
    the zygote at the failure, not a warm spare) restores its state (CUDA RNG included)
    from a replica, and its losses in steps 8-10 (dropout on the GPU) and the final
    state equal a run without failures."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = _launch(Path(tmp) / "reference", [], spares=0, device=device)
        t0 = time.perf_counter()
        got = _launch(Path(tmp) / "killed", ["recovery.fault=1:8:backward"], spares=0,
                      device=device)
        seconds = time.perf_counter() - t0
    assert len(got["starts"]) == 1, f"expected one replacement process: {got['starts']}"
    after = {s: got["losses1"][s] for s in ("8", "9", "10")}
    assert after == {s: ref["losses1"][s] for s in after}, (after, ref["losses1"])
    for key in ("final0", "final1"):  # digest, step, data order and position
        assert got[key] == ref[key], f"{key}: {got[key]} vs {ref[key]}"
    return {"killed_run_s": round(seconds, 2), "losses_after_recovery": after,
            "replacement_started": got["starts"][0]}


# -- replicas held for a peer in GPU memory ------------------------------------------------

def check_replicas_on_device(device: str = "cuda:0") -> dict[str, Any]:
    """Two processes on the card over gloo, each holding the other's replica in GPU
    memory (received through host chunks on a real side stream): a replacement is
    served from it and restores bit-exactly, and a reseed lands on the GPU
    (``tests/test_replica_tier.py``'s worker, its tier on ``device``)."""
    sys.path.insert(0, str(REPO))
    from tests.test_replica_tier import _run

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        run = _run("tests.test_replica_tier", Path(tmp), steps=3, device=device)
        seconds = time.perf_counter() - t0
    res = run.results
    for r in range(2):
        assert res.get(r) and res[r].get("ok"), f"rank {r}: {res.get(r)}\n{run.describe()}"
        assert res[r]["reseeded_on_device"] is True
        assert res[r]["reseeded_sha"] == res[1 - r]["own_sha"]
    assert res[0]["served_from_device"] is True
    assert res[1]["restored"] == res[1]["before_loss"]
    return {"run_s": round(seconds, 2), "moved_bytes": res[1]["moved"]}


# -- 8: a one-rank NCCL generation cycle ------------------------------------------------

def check_nccl_generation_cycle() -> dict[str, Any]:
    """Build a generation's NCCL backend (non-blocking communicator), all-reduce on it,
    abort it, build the next one and all-reduce again: what a recovery does to the
    inner backend, on one rank. Threads and device memory return to where they were."""
    import torch
    import torch.distributed as dist

    from recovery.process_group import nccl_inner

    store = dist.HashStore()
    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    threads0, mem0 = threading.active_count(), torch.cuda.mem_get_info()[0]
    timings = []
    for gen in range(3):
        t0 = time.perf_counter()
        backend = nccl_inner.make_backend(dist.PrefixStore(f"g{gen}", store), 0, 1, 30.0)
        work = backend.allreduce([x])
        work.wait()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x)), "one-rank all-reduce changed the values"
        shrink = nccl_inner.can_shrink(backend)
        nccl_inner.abort(backend)
        del backend, work
        timings.append(round(time.perf_counter() - t0, 4))
    time.sleep(1.0)  # the watchdog threads of aborted backends end
    torch.cuda.synchronize()
    threads1, mem1 = threading.active_count(), torch.cuda.mem_get_info()[0]
    leaked_mib = (mem0 - mem1) / 2**20
    assert threads1 <= threads0 + 2, f"threads {threads0} -> {threads1}"
    assert leaked_mib < 256, f"{leaked_mib:.0f} MiB of device memory not released"
    return {"generation_s": timings, "threads_before_after": [threads0, threads1],
            "device_mib_not_released": round(leaked_mib, 1), "backend_can_shrink": shrink,
            "nccl_version": list(torch.cuda.nccl.version())}


# -- 10: Lightning with accelerator="gpu" -----------------------------------------------

def _lightning_job(tmp: Path, name: str, fault: str | None,
                   accelerator: str = "gpu") -> dict[int, dict[str, Any]]:
    """Two agents (two nodes of one worker each, both on cuda:0), the Lightning worker of
    ``tests/test_lightning_device_moves.py`` with ``accelerator="gpu"`` over gloo."""
    sys.path.insert(0, str(REPO))
    from tests.test_lightning_device_moves import WORKER

    script = tmp / "lightning_worker.py"
    script.write_text(WORKER)
    run_dir = tmp / name
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", name, "--run-dir", str(run_dir),
              "--spares", "1", "replication.every_n_steps=2"]
    if fault:
        common.append(f"recovery.fault={fault}")
    procs = [subprocess.Popen([sys.executable, "-m", "launcher.cli", "run", "--node-rank",
                               str(n), *common, str(script), "--accelerator", accelerator,
                               "--pg-backend", "gloo", "--out", str(run_dir)],
                              cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    errs = [p.communicate(timeout=200)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for e in errs]
    return {r: json.loads((run_dir / f"probe_rank{r}.json").read_text()) for r in (0, 1)}


def check_lightning_gpu_kill(accelerator: str = "gpu") -> dict[str, Any]:
    """Lightning, ``accelerator="gpu"``: rank 1 SIGKILLed in step 5's backward; the
    survivor recovers without moving its model or optimizer state off the card, and
    both ranks end with the weights of a run without failures."""
    with tempfile.TemporaryDirectory() as tmp:
        ref = _lightning_job(Path(tmp), "reference", None, accelerator)
        got = _lightning_job(Path(tmp), "killed", "1:5:backward", accelerator)
    survivor = got[0]
    assert survivor["attempts"] == 2, survivor
    moves = [m for m in survivor["moves"] if m["phase"].startswith("recovery")]
    assert not moves, f"the recovery moved state: {moves}"
    assert survivor["params_after_restore"] == survivor["params_at_failure"]
    assert [got[r]["digest"] for r in (0, 1)] == [ref[r]["digest"] for r in (0, 1)]
    return {"resumed_devices": survivor.get("resumed_devices"), "steps": survivor["step"]}


def check_cuda_health_probe() -> dict[str, Any]:
    """The agent's built-in device check (``launcher.health_check``) passes on a good
    card, run as the agent runs it: in a child process."""
    from launcher import health_check

    ok = health_check.problem("", cuda=True)
    return {"ok": ok is None, "problem": ok, "driver_seen": health_check.has_cuda_devices()}
