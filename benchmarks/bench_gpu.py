"""GPU snapshot figures: the snapshot's step stall and copy throughput against raw copies.

GPU only. Prints one JSON object as its last line (the convention of the other benches);
``--quick`` uses a smaller state and fewer repeats (under 2 minutes). On a host without
CUDA it exits at once with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from replication.snapshots.device_tier import DeviceTier
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.state import TrainingState


def _pinned_d2h_s(nbytes: int, repeats: int) -> float:
    """Median time of one raw pinned device-to-host copy of ``nbytes``: the floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adam_state(state_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                             Callable[[], torch.Tensor]]:
    """A model and Adam state on the current GPU of about ``state_bytes`` (weights and
    two moments), and a training step returning its loss (not synchronised)."""
    width = 4096
    layers = max(1, state_bytes // (3 * 4 * width * width))
    model = torch.nn.Sequential(
        *[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]
    ).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = model(torch.randn(8, width, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, opt, step


def measure(state_bytes: int, repeats: int) -> dict[str, object]:
    model, opt, step = adam_state(state_bytes)
    step()
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    engine = SnapshotEngine(state)
    nbytes = engine.state_bytes()
    d2h_s = _pinned_d2h_s(nbytes, repeats)
    stalls, copies = [], []
    for i in range(repeats):
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        slot = engine.capture(i + 2)
        stalls.append(time.perf_counter() - t0)  # what the training loop waits for
        engine.seal(slot)  # the copy has landed in host memory once sealed
        copies.append(time.perf_counter() - t0)
    stall, copy = statistics.median(stalls), statistics.median(copies)
    return {
        "state_bytes": nbytes,
        "pinned_d2h_gbps": round(nbytes / d2h_s / 1e9, 2),
        "snapshot_stall_over_d2h": round(stall / d2h_s, 4),
        "d2h_gbps_over_peak": round(d2h_s / copy, 4),
        **_rollbacks(state, step, repeats),
        "targets": {"snapshot_stall_over_d2h": "<= 0.1", "d2h_gbps_over_peak": ">= 0.8",
                    "gpu_tier_rollback_over_host": "<= 0.1"},
    }


def _rollback_s(engine: SnapshotEngine, step: Callable[[], None], repeats: int) -> float:
    """Median time of a rollback to a committed snapshot, the device idle before it."""
    engine.seal(engine.capture(0))  # the first capture; the tier decides at the next one
    step()
    engine.seal(engine.capture(1))
    engine.protect(1)
    times = []
    for _ in range(repeats):
        step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.restore(1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rollbacks(state: TrainingState, step: Callable[[], None], repeats: int) -> dict:
    """A rollback from the GPU tier (``replication.device``: the copy in device memory)
    against one from host memory, the same state, side by side."""
    host = _rollback_s(SnapshotEngine(state), step, repeats)
    tier = DeviceTier(torch.device("cuda", torch.cuda.current_device()), required=True)
    engine = SnapshotEngine(state, device_tier=tier)
    device = _rollback_s(engine, step, repeats)
    return {"rollback_host_s": round(host, 4), "rollback_gpu_tier_s": round(device, 4),
            "gpu_tier_rollback_over_host": round(device / host, 4),
            "gpu_tier_held": bool(tier.active)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    result = measure((256 << 20) if args.quick else (2 << 30), 3 if args.quick else 10)
    result["device"] = torch.cuda.get_device_name(0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
