"""The training job of ``bench_overhead``: one script, run plain or under the runtime.

- ``--mode plain``: under ``torchrun``, no runtime at all (the reference), optionally
  with ``torch.distributed.checkpoint.async_save`` every N steps (phases with
  ``dcp_every``: the torchrun + DCP baseline's save cost, measured the same way);
- ``--mode runtime``: under ``checkpointless run``; ``replication.factor`` comes from
  the recipe overrides the benchmark passes to the launcher.

The job runs a list of *phases* (``--phases``, JSON), each a number of warm-up steps
and timed steps of one kind at one snapshot interval, and writes rank 0's per-step wall
times to ``<out>/phases_<tag>.json``. Steps of either kind are synchronised across the
two ranks by a small all-reduce, as data parallelism is; each rank's state is its own
(seeded by rank: the sharded case, which ``replication.dedupe`` cannot skip).

Two kinds of step (see ``docs/performance.md``, "What the device emulation captures"):

- ``cpu``: a real forward, backward and Adam step on the host, one torch thread per rank
  (``batch`` rows sets the step time). Training and the runtime share the 2 cores.
- ``device``: what a GPU node's host sees. The "device" runs the step for ``step_s``
  seconds from the moment the host launched it; the host then blocks in a native wait
  that releases the GIL (``time.sleep``: ``clock_nanosleep`` between
  ``Py_BEGIN_ALLOW_THREADS`` and ``Py_END_ALLOW_THREADS``, as ``cudaStreamSynchronize``
  is with ``cudaDeviceScheduleBlockingSync``), so the runtime's threads get the cores
  meanwhile. The optimizer step is a real ``torch.optim.Optimizer`` (so the runtime's
  fence applies) holding Adam-shaped state; it changes one element of every tensor on
  the host (the device would change all of them; the snapshot copies and hashes every
  byte either way). Its launch may wait at the runtime's fence; the device then runs
  the optimizer's share of the step (``OPT_SHARE``) after both the forward/backward
  share and that launch, so a fence wait longer than the forward and backward shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

OPT_SHARE = 0.1
"""The optimizer step's share of a device step (it starts only after its launch)."""


class DeviceOptimizer(torch.optim.Optimizer):
    """Adam-shaped state (two moments per parameter), updated as a device would be.

    The host changes one element of every parameter and moment per step: the bytes a
    snapshot must copy and hash are all there, and every snapshot differs from the last,
    but the host spends no time on an update that a GPU would make."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 1e-4})
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {"step": torch.zeros(()),
                                 "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["step"] += 1
                p.view(-1)[0] += 1e-3
                st["exp_avg"].view(-1)[0] += 1e-3
                st["exp_avg_sq"].view(-1)[0] += 1e-3


def build(width: int, layers: int, rank: int, kind: str
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1000 + rank)  # each rank its own state: nothing to dedupe
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    if kind == "device":
        return model, DeviceOptimizer(model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.zeros(1, width)).sum().backward()
    opt.step()  # materialise Adam's moments: the state's full size from the start
    opt.zero_grad(set_to_none=False)
    return model, opt


class Job:
    """The loop shared by both modes; ``cl`` is the runtime or None (plain)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ["RANK"])
        self.kind = args.kind
        self.model, self.opt = build(args.width, args.layers, self.rank, self.kind)
        self.cl: Any = None
        self.sync = torch.zeros(1)
        self.step = 0
        self.dcp_future: Any = None
        self.dcp_group: Any = None

    def all_reduce(self) -> None:
        if self.cl is not None:
            self.cl.wait(dist.all_reduce(self.sync, async_op=True))
        else:
            dist.all_reduce(self.sync)

    def compute(self, phase: dict) -> None:
        if self.kind == "cpu":
            x = torch.randn(phase["batch"], self.args.width)
            self.opt.zero_grad(set_to_none=False)
            self.model(x).pow(2).mean().backward()
            self.all_reduce()
            self.opt.step()
            return
        t0 = time.perf_counter()
        fwd_bwd_end = t0 + (1 - OPT_SHARE) * phase["step_s"]
        self.all_reduce()  # a collective in the step, as data parallelism has
        self.opt.step()  # its launch waits at the runtime's fence, if a copy is unfinished
        end = max(fwd_bwd_end, time.perf_counter()) + OPT_SHARE * phase["step_s"]
        time.sleep(max(0.0, end - time.perf_counter()))  # the host waits for the device

    def run_phase(self, phase: dict) -> dict:
        every = int(phase.get("every", 0))
        times: list[float] = []
        snaps: list[bool] = []
        total = phase["warm"] + phase["steps"]
        t_prev = time.perf_counter()
        i = 0
        cpu_at_warm = time.process_time() if phase["warm"] == 0 else None
        while i < total:
            if i == phase["warm"] and cpu_at_warm is None:
                cpu_at_warm = time.process_time()  # this process, every thread
            i += 1
            self.step += 1
            if self.cl is not None:
                self.cl.begin_step(self.step)
            self.compute(phase)
            if every == -2 and self.cl is not None:  # the runtime's cadence (auto)
                snap = None
                taken = self.step % int(self.cl.settings.replication.every_n_steps) == 0
            else:
                snap = every > 0 and self.step % every == 0
            if self.cl is not None:
                self.cl.end_step(self.step, snapshot=snap)
            elif phase.get("dcp_every") and self.step % phase["dcp_every"] == 0:
                self.dcp_save()
            t = time.perf_counter()
            times.append(t - t_prev)
            snaps.append(bool(snap) if snap is not None else taken)
            t_prev = t
        out: dict = {"name": phase["name"], "times": times[phase["warm"]:],
                     "snaps": snaps[phase["warm"]:],
                     "cpu_s": time.process_time() - (cpu_at_warm or 0.0)}
        if every == -2 and self.cl is not None and self.cl.auto_interval is not None:
            out.update(auto_every=int(self.cl.settings.replication.every_n_steps))
        if self.dcp_future is not None:
            self.dcp_future.result()
            self.dcp_future = None
        return out

    def dcp_save(self) -> None:
        """``async_save`` as torchrun + DCP jobs use it: the previous save must be done
        before the next starts (its staging buffer is reused)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.dcp_future is not None:
            self.dcp_future.result()
        msd, osd = get_state_dict(self.model, self.opt)
        self.dcp_future = dcp.async_save({"model": msd, "optim": osd},
                                         checkpoint_id=f"{self.args.dcp_dir}/r{self.step}",
                                         process_group=self.dcp_group)


def instrument(cl: Any, sink: dict[str, float]) -> None:
    """Time the parts of a replication round (the bench's profile): wraps methods of the
    live replicator and its engine in this process only; replication/ is unchanged."""
    rep = cl.replicator
    eng = rep.engine

    def timed(obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                sink[key] = sink.get(key, 0.0) + time.perf_counter() - t0
                sink[key + "_n"] = sink.get(key + "_n", 0) + 1

        setattr(obj, name, wrapper)

    timed(eng, "capture", "capture_s")  # in the loop: small tensors copied, rest deferred
    timed(eng, "seal", "seal_s")  # round thread: the overlapped copy + hash of the rest
    timed(rep, "_announce", "announce_s")  # fingerprints + the allgather
    timed(rep, "_receive_replica", "receive_verify_s")  # recv + hash of each chunk
    timed(rep, "_exchange", "exchange_s")  # announce + post sends + receive + send wait
    timed(rep, "_commit", "commit_s")  # the tree agreement
    timed(rep, "wait", "loop_wait_s")  # snapshot()'s wait for the previous round
    # The receiver's verification hash, apart from its waits for chunks to land.
    import replication.snapshots.digest_copy as digest_module  # verify_as_they_land's Hasher

    base_hasher = digest_module.Hasher

    class TimedHasher(base_hasher):  # type: ignore[misc,valid-type]
        def update(self, data: Any) -> None:
            t0 = time.perf_counter()
            super().update(data)
            sink["receive_hash_s"] = sink.get("receive_hash_s", 0.0) + time.perf_counter() - t0

    digest_module.Hasher = TimedHasher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["plain", "runtime"], required=True)
    ap.add_argument("--job", default="", help="plain, k1 or k2: phases with 'only' skip others")
    ap.add_argument("--kind", choices=["cpu", "device"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--phases", required=True, help="JSON list of phases")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dcp-dir", default="")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    job = Job(args)
    if args.mode == "runtime":
        from recovery import Checkpointless

        job.cl = Checkpointless(model=job.model, optimizer=job.opt)
        job.step = job.cl.start_step - 1
    else:
        dist.init_process_group("gloo")
        # async_save's collectives run on a thread of their own: never on the training group
        job.dcp_group = dist.new_group(backend="gloo")
    prof: dict[str, float] = {}
    if args.profile and job.cl is not None:
        instrument(job.cl, prof)
    phases = json.loads(args.phases)
    results = []
    for ph in phases:
        if "only" in ph and args.job not in ph["only"]:
            continue
        if job.cl is not None and job.cl.replicator is not None:
            job.cl.wait_committed()
        dist.barrier()
        before = dict(prof)
        fenced = job.cl.replicator.fence_wait_s if job.cl is not None else 0.0
        t0 = time.perf_counter()
        results.append(job.run_phase(ph))
        if job.rank == 0:
            ts = results[-1]["times"]
            print(f"  [{args.tag}] {ph['name']}: {len(ts)} steps, mean {sum(ts) / len(ts):.4f} s"
                  f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        if job.cl is not None:
            results[-1]["fence_wait_s"] = job.cl.replicator.fence_wait_s - fenced
        if prof:
            results[-1]["profile"] = {k: v - before.get(k, 0) for k, v in prof.items()
                                      if k != "fence_wait_s"}
    if job.cl is not None:
        job.cl.finish()
    else:
        dist.destroy_process_group()
    if job.rank == 0:
        state_bytes = sum(p.numel() * 4 * 3 for p in job.model.parameters())
        Path(args.out, f"phases_{args.tag}.json").write_text(
            json.dumps({"state_bytes": state_bytes, "phases": results}))


if __name__ == "__main__":
    main()
