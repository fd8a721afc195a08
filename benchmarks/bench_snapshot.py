"""Snapshot and replication cost, side by side with the alternatives, in one run.

Two processes (one per simulated node, one torch thread each on this 2-core host)
hold a model whose training state (fp32 weights plus Adam's two moments) is a few
hundred MB. Every figure is measured in the same run on the same bytes:

- ``stall_s``: the training loop's blocking time per snapshot made the default way
  (``default_kind``), measured in the training blocks below: the time in
  ``snapshot()`` plus the time optimizer steps wait at the fence for an overlapped copy
  to finish. ``stall_<kind>_s`` for each of :data:`KINDS` (``overlap``, ``inline``,
  ``background``, ``torch_copy``: see :data:`CONFIGS`); ``stall_isolated_<kind>_s``:
  the same with nothing run between the snapshot and its fence, so an overlapped copy
  has nothing to overlap;
- ``memcpy_s``: one flat copy of the same number of bytes into preallocated memory,
  both ranks at once, as their snapshots are;
- ``torch_save_s``: a synchronous ``torch.save`` of the same state plus fsync;
- ``dcp_async_block_s``: how long ``torch.distributed.checkpoint.async_save`` blocks;
- ``replication_s`` / ``raw_send_s``: a replication round (announce, pipelined chunks,
  verification on receipt, commit) against one plain gloo send of the same bytes in
  each direction;
- ``train_step_overhead``: the fractional slowdown of data-parallel-style training (a
  sync between the two ranks) with a snapshot every step, the median over blocks of the
  difference from the same block's run without; ``overhead_over_copy_cost`` is that
  added time per step divided by ``memcpy_s`` (``overhead_over_copy_cost_<kind>``: each
  kind; ``train_step_overhead_replicated``: with k=2 replication to the other process);
- ``overhead_over_inloop_copy``: a control, the same added time divided by that of a
  plain torch copy of the same tensors into a buffer of the same layout each step
  (``inloop_copy_over_memcpy``: what that copy costs the loop against ``memcpy_s``).

Usage: ``python -m benchmarks.bench_snapshot [--quick]``; the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks._harness import emit, median, progress, run_ranks
from replication.config import MemoryConfig, ReplicationConfig
from replication.replica_protocol.replicator import Replicator
from replication.snapshots import streamcopy
from replication.training_state.layout import flatten, tensor_views
from replication.training_state.state import TrainingState


def build(width: int, layers: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


CONFIGS = {
    "overlap": ReplicationConfig(factor=1, overlap_copy=True, checksum="inline"),
    "inline": ReplicationConfig(factor=1, overlap_copy=False, checksum="inline"),
    "background": ReplicationConfig(factor=1, overlap_copy=False, checksum="background"),
    "torch_copy": ReplicationConfig(factor=1, overlap_copy=False, checksum="inline",
                                    streaming_copy=False),
}
"""Ways of snapshotting, each timed (k=1: snapshot and commit, no peer copy).
``overlap``: the optimizer-owned tensors copied (and hashed) on the round thread during
the next forward and backward pass; the others copy in the loop: ``inline`` (each source
chunk hashed, then streamed into the slot), ``background`` (the copy only; the hash runs
on the round thread) and ``torch_copy`` (``inline`` copying with torch: the streaming
kernel's same-run control)."""
KINDS = tuple(CONFIGS)
_defaults = ReplicationConfig()
DEFAULT = "overlap" if _defaults.overlap_copy else _defaults.checksum
"""The default way: ``stall_s`` and ``overhead_over_copy_cost`` measure it."""
assert CONFIGS[DEFAULT].checksum == _defaults.checksum


def local_replicator(
    state: TrainingState, store: dist.Store, rank: int, world: int, kind: str, prefix: str
) -> Replicator:
    """A k=1 replicator for one of :data:`KINDS`."""
    return Replicator(state, store=store, rank=rank, world_size=world, node=rank,
                      config=CONFIGS[kind], memory=MemoryConfig(), prefix=prefix)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    """One step, synchronised across ranks by a small all-reduce as data parallelism
    is (without a sync, the per-step commit would be the only one and its wait would
    be charged to the snapshot). The full gradient all-reduce is left out on purpose:
    over gloo it is slow and noisy, and would drown the copy-sized difference we time."""
    opt.zero_grad(set_to_none=False)
    model(batch).pow(2).mean().backward()
    sync = torch.zeros(1)
    dist.all_reduce(sync)  # a small all-reduce: the per-step sync of data parallelism
    opt.step()


def rank_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    rank, world = args.rank, args.world_size
    store = dist.TCPStore("127.0.0.1", args.port, world, rank == 0, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("default", store), rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    model, opt = build(args.width, args.layers, seed=rank)  # distinct states: no dedupe
    batch = torch.randn(args.batch, args.width)
    train_step(model, opt, batch)  # materialise Adam's moments
    state = TrainingState()
    state.register("model", model)
    state.register("optim", opt)
    say = progress if rank == 0 else (lambda _m: None)

    # -- local snapshot stall vs memcpy (interleaved), for each way of snapshotting ------
    # Isolated: nothing runs between the snapshot and the fence, so an overlapped copy
    # has nothing to overlap and its fence waits for all of it. The loop's stall_s is
    # measured in the training blocks below.
    stalls: dict[str, list[float]] = {}
    copies: list[float] = []
    for kind in KINDS:
        local = local_replicator(state, store, rank, world, kind, f"bench/local-{kind}")
        for warm in (-2, -1):  # allocate and touch both slots before timing anything
            local.snapshot(warm)
            local.wait()
        nbytes = local.engine.state_bytes
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        say(f"state {nbytes / 2**20:.0f} MiB per rank; stall ({kind}) vs memcpy")
        stalls[kind] = []
        for i in range(args.reps):
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
            dist.barrier()
            stalls[kind].append(local.snapshot(i + 1) + local.engine.fence())
            local.wait()
        local.close()
        del src, dst

    # -- synchronous torch.save + fsync ---------------------------------------------
    say("torch.save + fsync")
    saves = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        path = Path(tmp) / f"rank{rank}.pt"
        for _ in range(args.save_reps):
            dist.barrier()
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            saves.append(time.perf_counter() - t0)
            path.unlink()

    # -- DCP async_save blocking time ----------------------------------------------------
    say("torch.distributed.checkpoint.async_save")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dcp_blocks = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for i in range(args.save_reps):
            msd, osd = get_state_dict(model, opt)
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{tmp}/c{i}")
            dcp_blocks.append(time.perf_counter() - t0)
            fut.result()

    # -- replication round vs a raw gloo exchange of the same bytes -----------------------
    say("replication round vs raw gloo send")
    rep = Replicator(
        state, store=store, rank=rank, world_size=world, node=rank,
        config=ReplicationConfig(factor=2, dedupe=False), memory=MemoryConfig(),
        prefix="bench/rep",
    )
    for warm in (-2, -1):
        rep.snapshot(warm)
        rep.wait()
    peer = 1 - rank
    out_buf = torch.empty(nbytes, dtype=torch.uint8).random_()
    in_buf = torch.empty_like(out_buf)
    rounds, raws = [], []
    for i in range(args.reps):
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.isend(out_buf, peer), dist.irecv(in_buf, peer)]
        for w in works:
            w.wait()
        raws.append(time.perf_counter() - t0)
        dist.barrier()
        rep.snapshot(i + 1)
        stats = rep.wait()
        assert stats is not None and stats.bytes_received > 0
        rounds.append(stats.transfer_s + stats.commit_s)
    del out_buf, in_buf

    # -- training throughput with and without a snapshot every step ---------------------
    say("training with vs without a snapshot every step (interleaved blocks)")
    # Each block of steps runs once without snapshots, then once with each kind of
    # snapshot (KINDS, then k=2 replication) and once with a control that copies the same
    # tensors with a plain torch copy into a buffer of the same layout. The added time is
    # the difference from the block's own run without (drift between blocks cancels), and
    # the order rotates from block to block (no kind always runs first or last). A block
    # snapshots on its first block_steps steps and ends with one step without: the last
    # round's work (the background hash, the commit) overlaps that step, as it overlaps
    # the next step in steady training. Its idle tail, waiting for the other rank's
    # acknowledgement, is not training time and is left out of the timing. (A k=2 round
    # can outlast that extra step; what it has left then is not timed either, so
    # train_step_overhead_replicated may read a little low.)
    reps = {kind: local_replicator(state, store, rank, world, kind, f"bench/train-{kind}")
            for kind in KINDS}
    reps["replicated"] = rep
    flat = flatten(state.capture())
    copy_dst = torch.empty(flat.layout.nbytes, dtype=torch.uint8)
    copy_pairs = (tensor_views(copy_dst, flat.layout), flat.tensors)
    step = 10_000
    for r in reps.values():
        for _ in range(2):  # both slots allocated before the timed blocks
            step += 1
            r.snapshot(step)
            r.wait()
    kinds = [*reps, "copy"]
    diffs: dict[str, list[float]] = {kind: [] for kind in kinds}
    loop_stalls: dict[str, list[float]] = {kind: [] for kind in reps}
    none_t: list[float] = []
    for b in range(args.blocks):
        order = kinds[b % len(kinds):] + kinds[: b % len(kinds)]  # rotated: no fixed position
        times: dict[str, float] = {}
        for kind in ["none", *order]:
            blocked = 0.0  # in snapshot() and in optimizer steps' fences: the loop's stall
            fenced = reps[kind].engine.fence_wait_s if kind in reps else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.block_steps + 1):
                train_step(model, opt, batch)
                if i == args.block_steps:
                    break  # one more step, without: the last round's work lands in it
                if kind == "copy":
                    torch._foreach_copy_(*copy_pairs)
                elif kind != "none":
                    step += 1
                    blocked += reps[kind].snapshot(step)
            times[kind] = time.perf_counter() - t0
            if kind in reps:
                blocked += reps[kind].engine.fence_wait_s - fenced
                loop_stalls[kind].append(blocked / args.block_steps)
                reps[kind].wait()  # untimed: idle until the other rank's ack, see above
        none_t.append(times["none"] / (args.block_steps + 1))
        for kind in kinds:
            diffs[kind].append((times[kind] - times["none"]) / args.block_steps)
    del copy_dst, copy_pairs, flat
    for r in reps.values():
        r.close()

    if rank == 0:
        out = {
            "state_bytes": nbytes,
            "stall_s": median(loop_stalls[DEFAULT]),
            **{f"stall_{kind}_s": median(loop_stalls[kind]) for kind in KINDS},
            **{f"stall_isolated_{kind}_s": median(stalls[kind]) for kind in KINDS},
            "memcpy_s": median(copies),
            "torch_save_s": median(saves),
            "dcp_async_block_s": median(dcp_blocks),
            "replication_s": median(rounds),
            "raw_send_s": median(raws),
            "step_s_no_snapshot": median(none_t),
            "added_s": median(diffs[DEFAULT]),
            **{f"added_{kind}_s": median(d) for kind, d in diffs.items()},
        }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller state, fewer repetitions")
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--tmp", default=None, help="directory for torch.save/DCP files")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=0)
    ap.add_argument("--save-reps", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0)
    ap.add_argument("--block-steps", type=int, default=0)
    args = ap.parse_args()
    q = args.quick
    args.layers = args.layers or (4 if q else 8)
    args.reps = args.reps or (11 if q else 31)
    args.save_reps = args.save_reps or (2 if q else 4)
    args.blocks = args.blocks or (6 if q else 20)
    args.block_steps = args.block_steps or (4 if q else 6)
    if args.rank >= 0:
        rank_main(args)
        # Rank 0 hosts the TCPStore; skip interpreter teardown, where its server
        # thread can abort in static destruction after the result is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        fwd = sys.argv[1:]
        progress(f"bench_snapshot: 2 ranks, {args.layers} x {args.width}^2 fp32 + Adam")
        t0 = time.perf_counter()
        run_ranks("benchmarks.bench_snapshot", args.world_size, [*fwd, "--out", str(out)])
        r = json.loads(out.read_text())
    mem, base = r["memcpy_s"], r["step_s_no_snapshot"]
    r.update(
        quick=q,
        default_kind=DEFAULT,
        streaming_kernel=streamcopy.AVAILABLE,
        wall_s=round(time.perf_counter() - t0, 1),
        stall_over_memcpy=r["stall_s"] / mem,
        torch_save_over_stall=r["torch_save_s"] / r["stall_s"],
        dcp_async_block_over_stall=r["dcp_async_block_s"] / r["stall_s"],
        replication_over_raw_send=r["replication_s"] / r["raw_send_s"],
        train_step_overhead=r["added_s"] / base,
        overhead_over_copy_cost=r["added_s"] / mem,
        **{f"stall_{kind}_over_memcpy": r[f"stall_{kind}_s"] / mem for kind in KINDS},
        **{f"stall_isolated_{kind}_over_memcpy": r[f"stall_isolated_{kind}_s"] / mem
           for kind in KINDS},
        **{f"overhead_over_copy_cost_{kind}": r[f"added_{kind}_s"] / mem for kind in KINDS},
        # Controls: the same added time over that of a plain torch copy of the same bytes
        # made in the training loop (same cache and memory-bandwidth conditions), and what
        # that copy costs the loop against the isolated memcpy.
        overhead_over_inloop_copy=r["added_s"] / r["added_copy_s"],
        inloop_copy_over_memcpy=r["added_copy_s"] / mem,
        train_step_overhead_replicated=r["added_replicated_s"] / base,
    )
    emit({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
    main()
