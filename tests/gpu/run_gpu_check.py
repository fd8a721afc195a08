"""The GPU check behind ``make test-gpu``: each check in its own process, under its own timeout.

Why a script and not pytest: the device machine runs it on its own ``python3`` (no
venv, no pytest guaranteed), a hung CUDA call must not stop the other checks, and the
results must come back as JSON lines under ``$OUT``. ``--dry-run`` (or no CUDA) reports
every check as skipped, so the CPU suite can exercise the plumbing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import more_checks  # noqa: E402  (a sibling module: the script runs from any directory)

RUNTIME_DEPS = ["torch", "fsspec", "psutil", "omegaconf", "numpy", "xxhash", "lightning"]
Check = Callable[[], dict[str, Any]]


def missing_deps() -> list[str]:
    """Runtime dependencies absent here: their wheels must be carried to the device."""
    return [name for name in RUNTIME_DEPS if importlib.util.find_spec(name) is None]


def check_dependencies() -> dict[str, Any]:
    """Needs no CUDA, so a dry run also exercises the spawned-process plumbing."""
    try:
        from replication.snapshots import streamcopy
        streamcopy_ok = bool(streamcopy.AVAILABLE)
    except Exception:  # reported, not fatal: snapshots fall back to torch copies
        streamcopy_ok = False
    missing = missing_deps()
    assert not missing, f"missing runtime dependencies (carry their wheels): {missing}"
    return {"streamcopy_extension": streamcopy_ok, "python": sys.version.split()[0]}


def check_environment() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
        "capability": torch.cuda.get_device_capability(0), "card": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver_version": _driver_version(),
    }


def _driver_version() -> str | None:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _adam_state(target_bytes: int) -> tuple[Any, Any, Callable[[], float]]:
    """The benchmark's model and Adam state on ``cuda:0`` (:func:`benchmarks.bench_gpu.
    adam_state`, imported here so that a missing dependency fails this check only), with
    a step that returns its loss as a float."""
    from benchmarks.bench_gpu import adam_state

    model, opt, step = adam_state(target_bytes)
    return model, opt, lambda: float(step())


def _engine(model: Any, opt: Any) -> Any:
    from replication.snapshots.snapshot import SnapshotEngine
    from replication.training_state.state import TrainingState

    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    return SnapshotEngine(state)


def check_snapshot_bytes() -> dict[str, Any]:
    """Snapshot then restore into a perturbed model must equal a synchronous ``.cpu()``."""
    import torch

    model, opt, step = _adam_state(1 << 30)
    for _ in range(2):
        step()
    engine = _engine(model, opt)
    torch.cuda.synchronize()
    reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    slot = engine.capture(2)
    engine.seal(slot)
    engine.protect(2)
    step()
    engine.restore(2)
    torch.cuda.synchronize()
    bad = [k for k, v in model.state_dict().items() if not torch.equal(v.cpu(), reference[k])]
    assert not bad, f"restored tensors differ from .cpu(): {bad[:5]}"
    return {"state_bytes": engine.state_bytes(), "device_bytes": engine.device_bytes()}


def check_snapshot_stall() -> dict[str, Any]:
    """The step stall of a snapshot against one raw pinned device-to-host copy."""
    import torch

    model, opt, step = _adam_state(1 << 30)
    for _ in range(3):
        step()
    engine = _engine(model, opt)
    nbytes = engine.state_bytes()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    d2h_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    slot = engine.capture(3)
    stall_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    next_step_s = time.perf_counter() - t0
    engine.seal(slot)
    return {"d2h_s": d2h_s, "stall_s": stall_s, "next_step_s": next_step_s,
            "stall_over_d2h": stall_s / d2h_s, "gbps": nbytes / d2h_s / 1e9}


def check_rollback() -> dict[str, Any]:
    """Restore CUDA model, optimizer and RNG from the snapshot, then replay bit-exactly."""

    model, opt, step = _adam_state(64 << 20)
    step()
    engine = _engine(model, opt)
    slot = engine.capture(1)
    engine.seal(slot)
    engine.protect(1)
    first = [step() for _ in range(3)]
    engine.restore(1)
    second = [step() for _ in range(3)]
    assert first == second, f"replay losses differ: {first} vs {second}"
    return {"losses": first}


def _launch(run_dir: Path, overrides: list[str], script: str = "train_gpu.py",
            prefix: str = "final", args: tuple[str, ...] = ("--steps", "16"),
            ) -> dict[int, dict[str, Any]]:
    """One ``launcher.cli run`` job of two workers on the one GPU; its per-rank JSON files."""
    import subprocess

    cmd = [sys.executable, "-m", "launcher.cli", "run", "--standalone", "--nproc-per-node",
           "2", "--run-dir", str(run_dir), "--spares", "1", "--rdzv-conf", "join_timeout=60",
           *overrides, str(REPO / "tests/gpu" / script), *args]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, f"job exited {proc.returncode}: {proc.stderr[-1500:]}"
    return {r: json.loads((run_dir / f"{prefix}_rank{r}.json").read_text()) for r in (0, 1)}


def check_stream_ordering() -> dict[str, Any]:
    """CUDA tensors over gloo in the runtime's group: exact sums, sync and async; DDP agrees."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ranks = _launch(Path(tmp), [], "collectives_gpu.py", "collectives", ())
    errors = {r: v["errors"] for r, v in ranks.items() if v["errors"]}
    assert not errors, f"wrong all-reduce results: {errors}"
    assert ranks[0]["ddp_params"] == ranks[1]["ddp_params"], "DDP replicas diverged"
    return {"ddp_sum": ranks[0]["ddp_sum"]}


def check_launcher_kill() -> dict[str, Any]:
    """A SIGKILLed worker on the GPU is replaced and the run ends bit-identical."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        reference = _launch(Path(tmp) / "reference", [])
        t0 = time.perf_counter()
        killed = _launch(Path(tmp) / "killed", ["recovery.fault=1:8:backward"])
        seconds = time.perf_counter() - t0
    assert killed == reference, f"final state differs: {killed} vs {reference}"
    return {"killed_run_s": round(seconds, 2), "step": reference[0]["step"]}


# The dependencies check runs even without CUDA; every other one needs a card.
NO_CUDA_NEEDED = {"dependencies"}
CHECKS: list[tuple[str, Check, float]] = [
    ("dependencies", check_dependencies, 60),
    ("environment", check_environment, 60),
    ("zygote_spare_cuda", more_checks.check_zygote_spare_cuda, 90),
    ("stream_ordering_gloo_cuda", check_stream_ordering, 120),
    ("snapshot_bytes", check_snapshot_bytes, 90),
    ("snapshot_stall", check_snapshot_stall, 90),
    ("rollback_bit_exact", check_rollback, 60),
    ("replicas_on_device", more_checks.check_replicas_on_device, 90),
    ("replacement_restore_dropout", more_checks.check_replacement_restore_dropout, 150),
    ("nccl_generation_cycle", more_checks.check_nccl_generation_cycle, 60),
    ("launcher_kill_two_workers", check_launcher_kill, 200),
    ("lightning_gpu_kill", more_checks.check_lightning_gpu_kill, 150),
    ("cuda_health_probe", more_checks.check_cuda_health_probe, 60),
]


def _child(fn: Check, queue: Any) -> None:
    try:
        queue.put((True, fn(), None))
    except BaseException as exc:  # every failure, exit included, becomes a result line
        queue.put((False, {}, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))


def _child_entry(fn: Check, queue: Any) -> None:
    sys.path.insert(0, str(REPO))
    _child(fn, queue)


def run_one(name: str, fn: Check, timeout_s: float, skip: str | None) -> dict[str, Any]:
    """Run one check in a fresh spawned process so a hang or crash stays contained."""
    t0 = time.perf_counter()
    if skip:
        return {"name": name, "passed": None, "seconds": 0.0, "figures": {}, "error": skip}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_entry, args=(fn, queue))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        ok, figures, error = False, {}, f"timed out after {timeout_s:.0f} s"
    elif queue.empty():
        ok, figures, error = False, {}, f"process died, exit code {proc.exitcode}"
    else:
        ok, figures, error = queue.get()
    return {"name": name, "passed": ok, "seconds": round(time.perf_counter() - t0, 2),
            "figures": figures, "error": error}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="report every check skipped")
    parser.add_argument("--budget-s", type=float, default=480.0)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    skip = "skipped: dry run" if args.dry_run else None
    if skip is None:
        try:
            import torch
            skip = None if torch.cuda.is_available() else "skipped: no CUDA"
        except ImportError:
            skip = "skipped: torch missing"
    out_dir = os.environ.get("OUT")
    results_path = Path(out_dir) / "gpu_check.jsonl" if out_dir else None
    deadline = time.monotonic() + args.budget_s
    results = []
    for name, fn, timeout_s in CHECKS:
        left = deadline - time.monotonic()
        why = None if name in NO_CUDA_NEEDED else skip
        why = why or (None if left > 5 else "skipped: total budget spent")
        result = run_one(name, fn, min(timeout_s, left), why)
        results.append(result)
        line = json.dumps(result, default=str)
        print(line, flush=True)
        if results_path:
            with results_path.open("a") as fh:
                fh.write(line + "\n")
    failed = [r["name"] for r in results if r["passed"] is False]
    summary = {"summary": True, "passed": sum(r["passed"] is True for r in results),
               "failed": failed, "skipped": sum(r["passed"] is None for r in results),
               "missing_deps": missing_deps()}
    print(json.dumps(summary), flush=True)
    if results_path:
        with results_path.open("a") as fh:
            fh.write(json.dumps(summary) + "\n")
    if failed:
        return 1
    # Without --dry-run a host with no CUDA has checked nothing: that is not a pass.
    return 2 if skip and not args.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
