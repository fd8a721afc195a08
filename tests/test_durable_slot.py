"""Zero-copy persistence: the helper process writes straight from a snapshot slot.

The snapshot engine allocates its slots in shared memory; a zero-copy writer hands the
helper the slot's segment name and offset, so the training process copies nothing.
What must hold:

- the persisted bytes are exactly the snapshot's, with no staging buffer anywhere;
- a capture into the slot being persisted waits until the helper is done with it
  (the slot is *held*), while captures into the other slots never wait;
- a snapshot that fails its digests, or a slot overwritten while the helper writes it
  (a caller that ignored the hold), is never committed, and the previous checkpoint
  stays intact;
- a save that holds its slot for too long can be cancelled;
- a training process SIGKILLed mid-save leaves the previous checkpoint the newest one,
  its helper exits and its shared segments are removed;
- the memory budget counts a third slot instead of a staging copy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from replication.config import MemoryConfig, ReplicationConfig
from replication.durable import DurableWriter, list_checkpoints, load, read_snapshot
from replication.replica_protocol.replicator import Replicator
from replication.snapshots.memory import MemoryBudgetError, MemoryPlan
from replication.snapshots.slots import shared_keys, shared_location
from replication.snapshots.snapshot import SnapshotEngine
from replication.training_state.state import TrainingState
from tests.helpers.training import Holder, assert_tree_equal
from tests.test_durable_support import config, make_state, snapshot, train

REPO = Path(__file__).resolve().parent.parent
SLOW_MBPS = 0.01  # the helper's pace: a save of make_state()'s snapshot lasts 2-3 s

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _wait_for(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _hold(engine: SnapshotEngine, step: int, ticket) -> None:
    """What the runtime does after submitting a slot: hold it until it is released."""
    slot = engine.slot_for(step)

    def wait() -> None:
        ticket.wait_released()

    engine.hold(slot, wait)
    ticket.released.add_done_callback(lambda _f: engine.unhold(slot, wait))


def _model_state(objs: dict) -> dict:
    return {k: v.clone() for k, v in objs["model"].state_dict().items()}


def test_shared_slots_are_found_and_freed_with_their_buffer():
    state = TrainingState(rng=False)
    state.register("x", Holder({"w": torch.arange(1000, dtype=torch.float32)}))
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
    assert len(engine.slots) == 3
    slot = engine.capture(1)
    assert slot.buffer is not None
    where = shared_location(slot.buffer)
    assert where is not None and where.offset == 0 and where.key in shared_keys()
    assert shared_location(slot.buffer[64:]).offset == 64
    assert shared_location(torch.zeros(8, dtype=torch.uint8)) is None
    # another mapping of the descriptor sees the same pages
    seen = torch.from_file(f"/proc/self/fd/{where.fd}", shared=True,
                           size=slot.buffer.numel(), dtype=torch.uint8)
    assert torch.equal(seen, slot.buffer)
    del seen
    # an anonymous memfd: no /dev/shm name that a killed process could leak
    assert os.readlink(f"/proc/self/fd/{where.fd}").startswith("/memfd:")
    plain = SnapshotEngine(state)
    assert shared_location(plain.capture(1).buffer) is None  # the default is unchanged
    fd = where.fd
    slot.buffer, slot.views = None, []
    assert where.key not in shared_keys()
    with pytest.raises(OSError):
        os.fstat(fd)  # the descriptor was closed with the buffer
    with pytest.raises(ValueError, match="num_slots"):
        SnapshotEngine(state, num_slots=1)


def test_zero_copy_save_persists_the_slot_bytes_without_staging(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
    with DurableWriter(config(str(tmp_path)), 0, 1, zero_copy=True) as writer:
        assert writer.isolation == "process"
        for step in (1, 2):
            train(objs)
            meta, buf = snapshot(engine, step)
            want = buf[: meta.layout.nbytes].clone()
            ticket = writer.submit(meta, buf)
            result = ticket.result(120)
            assert result.status == "ok" and result.committed, result
            assert ticket.released.done()
        assert writer.staging_bytes == 0 and writer._shm is None  # nothing was staged
        kept = _model_state(objs)
        # A slot whose bytes do not match its digests is refused by the helper.
        train(objs)
        bad_meta, bad_buf = snapshot(engine, 3)
        bad_buf[100] ^= 1
        bad = writer.submit(bad_meta, bad_buf).result(60)
        assert bad.status == "failed" and "verification" in bad.error, bad
    _assert_only_committed(tmp_path, [1, 2], failed_step=3, kept=kept)
    got_meta, got = read_snapshot(str(tmp_path / "step_2"))
    assert got_meta.digests == meta.digests
    assert torch.equal(got, want)


def test_capture_into_the_slot_being_persisted_waits_for_the_helper(tmp_path):
    """Two slots, so the capture after next must reuse the slot the helper is reading."""
    state, objs = make_state()
    engine = SnapshotEngine(state, shared_memory=True, num_slots=2)
    writer = DurableWriter(config(str(tmp_path)), 0, 1, zero_copy=True,
                           max_write_mbps=SLOW_MBPS)
    try:
        train(objs)
        meta, buf = snapshot(engine, 2)
        want_bytes, want_model = buf[: meta.layout.nbytes].clone(), _model_state(objs)
        ticket = writer.submit(meta, buf)
        _hold(engine, 2, ticket)
        held = engine.slot_for(2)
        done_at: list[float] = []
        ticket.done.add_done_callback(lambda _f: done_at.append(time.monotonic()))
        train(objs)
        t0 = time.monotonic()
        snapshot(engine, 3)  # the other slot: no wait
        assert time.monotonic() - t0 < 1.0 and not ticket.done.done()
        train(objs)  # the live state moves on: capturing it into step 2's slot would
        captured: list = []  # corrupt the save in progress
        th = threading.Thread(
            target=lambda: captured.append((engine.capture(4), time.monotonic())))
        th.start()
        th.join(0.4)
        assert th.is_alive() and not ticket.done.done(), "capture did not wait for the save"
        th.join(60)
        assert not th.is_alive()
        result = ticket.result(1)
        assert result.status == "ok" and result.committed, result
        slot, captured_at = captured[0]
        assert slot is held and captured_at >= done_at[0]
        assert slot.hold is None and slot.step == 4  # released with the save
    finally:
        writer.close()
    got_meta, got = read_snapshot(str(tmp_path / "step_2"))
    assert got_meta.digests == meta.digests and torch.equal(got, want_bytes)
    fresh_state, fresh = make_state(seed=7)
    assert load(str(tmp_path / "step_2"), fresh_state).step == 2
    assert_tree_equal(_model_state(fresh), want_model)


def test_three_slots_never_wait_and_a_bad_slot_is_never_committed(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
    with DurableWriter(config(str(tmp_path)), 0, 1, zero_copy=True,
                       max_write_mbps=SLOW_MBPS) as writer:
        # 1. While a slow save holds one slot, captures alternate in the two others.
        train(objs)
        meta, buf = snapshot(engine, 2)
        kept = _model_state(objs)
        ticket = writer.submit(meta, buf)
        _hold(engine, 2, ticket)
        worst = 0.0
        for step in range(3, 9):
            train(objs)
            t0 = time.monotonic()
            snapshot(engine, step)
            worst = max(worst, time.monotonic() - t0)
        assert not ticket.done.done() and engine.slot_for(2).hold is not None
        assert worst < 1.0, worst
        assert ticket.result(60).status == "ok"
        # 2. A careless caller overwrites the slot while the helper is writing it.
        train(objs)
        meta, buf = snapshot(engine, 10)
        ticket = writer.submit(meta, buf)
        _wait_for(lambda: (tmp_path / "step_10" / "rank_0" / "__0_0.distcp").exists(),
                  what="the helper to start writing")
        buf[: meta.layout.nbytes].fill_(7)
        bad = ticket.result(60)
        assert bad.status == "failed" and "verification" in bad.error, bad
        helper = writer._backend.proc.pid
    assert helper != os.getpid()
    _assert_only_committed(tmp_path, [2], failed_step=10, kept=kept)


def test_a_save_that_holds_its_slot_too_long_can_be_cancelled(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
    with DurableWriter(config(str(tmp_path)), 0, 1, zero_copy=True,
                       max_write_mbps=0.002) as writer:  # ~15 s per save
        train(objs)
        meta, buf = snapshot(engine, 1)
        ticket = writer.submit(meta, buf)
        _wait_for(lambda: (tmp_path / "step_1" / "rank_0" / "__0_0.distcp").exists(),
                  what="the helper to start writing")
        t0 = time.monotonic()
        assert writer.cancel(ticket, grace_s=10)
        assert time.monotonic() - t0 < 10
        assert ticket.result(1).status == "aborted"
        assert list_checkpoints(str(tmp_path)) == []
        assert writer.stats["aborted"] == 1 and writer.flush(10)  # ready for the next
    assert not (tmp_path / "step_1" / "rank_0").exists()


KILL_SCRIPT = r"""
import sys, time
from replication.durable import DurableWriter
from replication.snapshots.snapshot import SnapshotEngine
from tests.test_durable_support import config, make_state, make_writer, persist
from tests.test_durable_support import snapshot, train

root = sys.argv[1]
state, objs = make_state()
engine = SnapshotEngine(state, shared_memory=True, num_slots=3)
writer = DurableWriter(config(root), 0, 1, zero_copy=True, max_write_mbps=0.002)
train(objs)
with make_writer(config(root), zero_copy=True) as fast:  # the same format, from a thread
    assert persist(fast, engine, 1).status == "ok"
train(objs)
writer.submit(*snapshot(engine, 2))
print("WRITING", writer._backend.proc.pid, flush=True)
time.sleep(120)
"""


def test_sigkill_of_the_training_process_mid_save_keeps_the_previous_checkpoint(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(tmp_path)], cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    helper = 0
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == "WRITING", proc.stderr.read()
        helper = int(line[1])
        _wait_for(lambda: (tmp_path / "step_2" / "rank_0" / "__0_0.distcp").exists(),
                  what="the helper to start writing")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        _wait_for(lambda: not _alive(helper), what="the helper to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if helper and _alive(helper):
            os.kill(helper, signal.SIGKILL)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [1]
    fresh_state, _ = make_state(seed=7)
    assert load(str(tmp_path), fresh_state).step == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _replicator(state: TrainingState, budget: int, **kw) -> Replicator:
    return Replicator(state, store=dist.HashStore(), rank=0, world_size=1, node=0,
                      config=ReplicationConfig(factor=1, timeout_s=10),
                      memory=MemoryConfig(host_budget_bytes=budget), **kw)


def test_memory_plan_counts_a_third_slot_instead_of_a_staging_copy():
    staged = MemoryPlan(state_bytes=100, factor=2, staging_bytes=0, durable_staging_bytes=100)
    zero_copy = MemoryPlan(state_bytes=100, factor=2, staging_bytes=0, local_slots=3)
    assert zero_copy.durable_staging_bytes == 0 and zero_copy.own_bytes == 300
    assert zero_copy.total_bytes == staged.total_bytes == 500

    state = TrainingState(rng=False)
    state.register("x", Holder({"w": torch.zeros(64 * 1024)}))  # 256 KiB
    size = 256 * 1024
    rep = _replicator(state, 10 * size, durable_staging=True, durable_zero_copy=True)
    try:
        plan = rep.check_budget()
        assert plan.local_slots == 3 and plan.durable_staging_bytes == 0
        assert len(rep.engine.slots) == 3 and rep.engine.shared_memory
        rep.snapshot(1)
        rep.wait()
        assert shared_location(rep.engine.slot_for(1).buffer) is not None
    finally:
        rep.close()
    staged_rep = _replicator(state, 10 * size, durable_staging=True)
    try:
        plan = staged_rep.check_budget()
        assert plan.local_slots == 2 and plan.durable_staging_bytes >= size
        # slots are shared all the same, for a replacement on this host (ADR 0040),
        # unless that is turned off; the third slot is the zero-copy writer's alone
        assert staged_rep.engine.shared_memory == staged_rep.config.same_host_handover
        assert len(staged_rep.engine.slots) == 2
    finally:
        staged_rep.close()
    with pytest.raises(MemoryBudgetError, match="3 x 256"):
        _replicator(state, 3 * size - 1, durable_zero_copy=True)
    _replicator(state, 3 * size - 1).close()  # two slots fit


def _assert_only_committed(root, steps: list[int], failed_step: int, kept) -> None:
    """Exactly ``steps`` are listed, the failed save left nothing behind, and the newest
    loads into fresh objects equal to ``kept`` (its model state)."""
    assert [c.step for c in list_checkpoints(str(root))] == steps
    sdir = root / f"step_{failed_step}"  # no done file, no data left behind
    assert not sdir.exists() or not any(sdir.iterdir()), list(sdir.iterdir())
    fresh_state, fresh = make_state(seed=7)
    assert load(str(root), fresh_state).step == steps[-1]
    assert_tree_equal(_model_state(fresh), kept)

