"""One rank of a multi-process replication test (real gloo side group, real TCPStore).

Started by ``tests/test_replication_mp.py`` as ``python -m tests.workers.replication_worker
'<json config>'``. It trains a tiny model, calls ``Replicator.snapshot(step)`` every step
and writes what it observed (own snapshot hashes, replicas it holds, round statistics,
errors, timings) to ``<out>/rank<r>.json``.

Config keys: rank, world_size, out, port, store_on_rank0 (rank 0 hosts the TCPStore;
otherwise the test process does), ranks_per_node, seed_mode ("rank" | "same"), steps,
factor, timeout_s, chunk_bytes, retrain_steps, sleep ({rank, step, seconds} | null),
die ({rank, step} | null), corrupt ({rank, step} | null: that rank flips one byte of
every chunk it sends in that step's round, as a bad link or NIC would).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import torch

from replication.config import ReplicationConfig
from replication.replica_protocol.replicator import _META_TAG as META_TAG
from replication.replica_protocol.replicator import ReplicationError, Replicator
from replication.snapshots.snapshot import restore_from_buffer
from replication.training_state.state import TrainingState
from tests.helpers.mp import tcp_store, write_result
from tests.helpers.training import (
    Holder,
    LoopState,
    ShardState,
    buffer_sha,
    digest,
    make_model,
    rng_draws,
    seed_all,
    train_step,
)

EXIT_BARRIER = "test/exit"


def build(rank: int) -> tuple[TrainingState, dict[str, Any]]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loop = LoopState(rank)
    shard = ShardState(rank)
    state = TrainingState()
    for name, obj in (
        ("model", model), ("optim", opt), ("sched", sched), ("loop", loop), ("shard", shard)
    ):
        state.register(name, obj)
    return state, {"model": model, "opt": opt, "sched": sched, "loop": loop}


def step(objs: dict[str, Any]) -> float:
    loss = train_step(objs["model"], objs["opt"], objs["sched"])
    objs["loop"].step += 1
    objs["loop"].history.append(loss)
    return loss


def state_digest(state: TrainingState) -> str:
    return digest(state.capture())


def round_dict(stats: Any) -> dict[str, Any] | None:
    if stats is None:
        return None
    return {
        "step": stats.step,
        "bytes_sent": stats.bytes_sent,
        "bytes_received": stats.bytes_received,
        "segments_skipped": stats.segments_skipped,
    }


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    rank, world = cfg["rank"], cfg["world_size"]
    torch.set_num_threads(1)
    store = tcp_store(cfg["port"], is_master=cfg["store_on_rank0"] and rank == 0)
    seed_all(1000 + (rank if cfg["seed_mode"] == "rank" else 0))
    state, objs = build(rank)
    rep = Replicator(
        state,
        store=store,
        rank=rank,
        world_size=world,
        node=rank // cfg["ranks_per_node"],
        local_world_size=cfg["ranks_per_node"],
        config=ReplicationConfig(
            factor=cfg["factor"], timeout_s=cfg["timeout_s"], chunk_bytes=cfg["chunk_bytes"]
        ),
    )
    res: dict[str, Any] = {
        "rank": rank,
        "holders": rep.holders,
        "sources": rep.sources,
        "node_of_rank": rep.node_of_rank,
        "rounds": {},
        "own_sha": {},
        "state_digest": {},
        "losses": [],
        "stalls": {},
    }
    sleep, die, corrupt = cfg.get("sleep"), cfg.get("die"), cfg.get("corrupt")
    failing = die or corrupt  # the step whose round must fail
    steps = cfg["steps"]

    def record_round() -> None:
        rd = round_dict(rep.last_round)
        if rd is not None:
            res["rounds"][str(rd["step"])] = rd

    for s in range(1, steps + 1):
        if die and s == die["step"] and rank == die["rank"]:
            rep.wait()
            record_round()
            res["own_sha"][str(s - 1)] = buffer_sha(rep.engine.slot_for(s - 1).buffer)
            res["died_at"] = s
            write_result(cfg["out"], rank, res)
            step(objs)
            rep.snapshot(s)  # posts step s; its round has not finished when we die
            os._exit(17)
        res["losses"].append(step(objs))
        res["state_digest"][str(s)] = state_digest(state)
        if sleep and rank == sleep["rank"] and s == sleep["step"]:
            res["sleep_started_at"] = time.time()
            time.sleep(sleep["seconds"])
            res["snapshot_called_at"] = time.time()
        if corrupt and rank == corrupt["rank"] and s == corrupt["step"]:
            corrupt_sends(rep)
        res["stalls"][str(s)] = rep.snapshot(s)
        record_round()
        if failing and s == failing["step"]:
            t0 = time.monotonic()
            try:
                rep.wait()
                res["wait_error"] = None
            except ReplicationError as exc:
                res["wait_error"] = {"type": type(exc).__name__, "message": str(exc)}
            except Exception as exc:  # reported, so the test shows the wrong type
                res["wait_error"] = {"type": type(exc).__name__, "message": str(exc)}
            res["wait_error_after_s"] = time.monotonic() - t0
            after_failure(rep, state, objs, s, res)
            return res

    rep.wait()
    record_round()
    res["committed"] = rep.committed_step()
    res["held_steps"] = rep.engine.held_steps()
    res["layout"] = {
        seg.name: seg.nbytes for seg in rep.engine.slot_for(steps).layout.segments
    }
    for s in (steps - 1, steps):
        res["own_sha"][str(s)] = buffer_sha(rep.engine.slot_for(s).buffer)

    # (e) bit-exact local round trip: train on, roll back to the snapshot, train again.
    m = cfg["retrain_steps"]
    first = [step(objs) for _ in range(m)] + rng_draws()
    res["after_first_pass"] = state_digest(state)
    rep.restore_local(steps)
    res["after_restore"] = state_digest(state)
    second = [step(objs) for _ in range(m)] + rng_draws()
    res["after_second_pass"] = state_digest(state)
    res["first_pass"], res["second_pass"] = first, second
    rep.restore_local(steps - 1)  # the older slot survived the newer capture
    step(objs)
    res["older_slot_replayed"] = state_digest(state)

    # (a) every replica this rank holds rebuilds its source's exact snapshot.
    res["replicas"] = {}
    for src in rep.sources[rank]:
        meta, buf = rep.replica_buffer(src, steps)
        fresh, _ = build(rank=-1)
        fresh_rng = Holder()
        fresh = replace_rng(fresh, fresh_rng)
        restore_from_buffer(fresh, buf, meta)
        res["replicas"][str(src)] = {
            "step": meta.step,
            "sha": buffer_sha(buf),
            "restored_digest": digest(fresh.capture()),
            "loop": dict(fresh.capture()["loop"], history=None),
        }
    res["replica_store_bytes"] = rep.replicas.nbytes()
    finish(rep, store, cfg)
    return res


def corrupt_sends(rep: Replicator) -> None:
    """From the next round on, every chunk of snapshot data this rank sends has its first
    byte flipped in transit (the snapshot itself stays intact; the metadata too)."""
    rep.wait()  # the previous round's sends stay clean
    send = rep.channel.post_send

    def flipped(buf: torch.Tensor, dst: int, tag: int, chunk_bytes: int) -> list:
        if tag == META_TAG:
            return send(buf, dst, tag, chunk_bytes)
        bad = buf.clone()
        for start in range(0, bad.numel(), chunk_bytes):
            bad[start] ^= 0xFF
        return send(bad, dst, tag, chunk_bytes)

    rep.channel.post_send = flipped  # type: ignore[method-assign]


def replace_rng(state: TrainingState, rng: Holder) -> TrainingState:
    """The same entries, but the rng entry only records what it is given."""
    out = TrainingState(rng=False)
    for name, obj in state:
        out.register(name, rng if name == "rng" else obj)
    return out


def after_failure(
    rep: Replicator, state: TrainingState, objs: dict[str, Any], s: int, res: dict[str, Any]
) -> None:
    """What a survivor still has after step ``s`` failed: the committed step, intact."""
    res["committed"] = rep.committed_step()
    res["held_steps"] = rep.engine.held_steps()
    res["own_sha"][str(s - 1)] = buffer_sha(rep.engine.slot_for(s - 1).buffer)
    rep.restore_local(s - 1)
    res["restored_digest"] = state_digest(state)
    res["replicas"] = {}
    for src in rep.sources[rep.rank]:
        try:
            meta, buf = rep.replica_buffer(src, s - 1)
            res["replicas"][str(src)] = {"step": meta.step, "sha": buffer_sha(buf)}
        except Exception as exc:
            res["replicas"][str(src)] = {"error": f"{type(exc).__name__}: {exc}"}


def finish(rep: Replicator, store: Any, cfg: dict[str, Any]) -> None:
    """Close, and keep rank 0 (which may host the store) alive until all are done."""
    rep.close()
    store.add(EXIT_BARRIER, 1)
    if cfg["store_on_rank0"] and cfg["rank"] == 0:
        deadline = time.monotonic() + 30
        while int(store.add(EXIT_BARRIER, 0)) < cfg["world_size"]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    try:
        result = main(config)
        result["ok"] = True
    except BaseException as exc:
        result = {
            "ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()
        }
    write_result(config["out"], config["rank"], result)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a gloo group whose peer died can block in destructors.
    os._exit(0 if result["ok"] else 1)
