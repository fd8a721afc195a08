"""The durable tier on a local filesystem: format, exact restore, DCP compatibility,
manifest commit across ranks, resharding of data-parallel state, corruption, retention
and the history CSV."""

from __future__ import annotations

import copy
import csv
import json
import os
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from replication import durable
from replication.durable import (
    CorruptCheckpoint,
    DurableError,
    latest_checkpoint,
    list_checkpoints,
    load,
    load_latest,
    prune,
    scan,
    verify,
)
from replication.durable.format import load_dcp_metadata
from replication.snapshots.snapshot import SnapshotEngine
from tests.helpers.training import assert_tree_equal, make_model, rng_draws
from tests.test_durable_support import (
    config,
    make_state,
    make_writer,
    persist,
    snapshot,
    train,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no_dist saves



def _states(objs: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) for k, v in objs.items()}


def _flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def _master(tmp_path_factory):
    """Three persisted steps (2, 4, 6) of one rank, and the exact state at each."""
    root = tmp_path_factory.mktemp("durable")
    state, objs = make_state()
    engine = SnapshotEngine(state)
    expected = {}
    with make_writer(config(str(root), keep_last=5), 0, 1) as writer:
        for step in (2, 4, 6):
            train(objs, 2)
            result = persist(writer, engine, step)
            assert result.status == "ok" and result.committed, result
            expected[step] = (_states(objs), rng_draws())  # draws after the snapshot
    return root, expected


@pytest.fixture
def saved(_master, tmp_path):
    """A private copy of the master checkpoints, a fresh state to load into, and the
    expected states."""
    root = tmp_path / "ckpt"
    shutil.copytree(_master[0], root)
    state, objs = make_state(seed=77)
    return root, state, objs, _master[1]


def test_round_trip_restores_exact_state(saved):
    root, fresh_state, fresh, expected = saved
    assert [c.step for c in list_checkpoints(str(root))] == [2, 4, 6]
    result = load(str(root), fresh_state)  # a root means its newest valid checkpoint
    assert result.step == 6 and result.world_size == 1 and not result.fallbacks
    want, draws = expected[6]
    assert_tree_equal(_states(fresh), want)  # weights, Adam moments, lr, step counters
    assert rng_draws() == draws  # python, numpy and torch RNG streams
    # An explicit older checkpoint.
    load(latest_checkpoint(str(root)).url.replace("step_6", "step_2"), fresh_state)
    assert_tree_equal(_states(fresh), expected[2][0])


def test_layout_is_dcp_per_rank_with_manifest_last(saved):
    root = saved[0]
    step = root / "step_6"
    names = sorted(p.name for p in step.iterdir())
    assert names == ["MANIFEST.json", "rank_0", "rank_0.done.json"]
    assert sorted(p.name for p in (step / "rank_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "snapshot.json"]
    manifest = json.loads((step / "MANIFEST.json").read_text())
    assert manifest["format_version"] == 1 and manifest["world_size"] == 1
    assert manifest["step"] == 6 and manifest["checksum"] == "xxh3_128"
    files = manifest["ranks"][0]["files"]
    assert set(files) == {"rank_0/.metadata", "rank_0/__0_0.distcp", "rank_0/snapshot.json"}
    for rel, rec in files.items():
        assert (step / rel).stat().st_size == rec["size"]
    # The manifest is the newest file of the step: written after every other one.
    newest = max((p for p in step.rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "MANIFEST.json"


def test_plain_dcp_load_reads_a_checkpoint(saved):
    root, _state, _objs, expected = saved
    model = make_model()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=str(root / "step_6" / "rank_0"), no_dist=True)
    model.load_state_dict(sd["model"])
    assert_tree_equal(model.state_dict(), expected[6][0]["model"])
    # Optimizer tensors carry DCP's flattened names too.
    md = dcp.FileSystemReader(str(root / "step_6" / "rank_0")).read_metadata()
    assert "optim.state.0.exp_avg" in md.state_dict_metadata
    assert "model.0.weight" in md.state_dict_metadata
    exp_avg = torch.empty_like(expected[6][0]["optim"]["state"][0]["exp_avg"])
    dcp.load({"optim": {"state": {0: {"exp_avg": exp_avg}}}},
             checkpoint_id=str(root / "step_6" / "rank_0"), no_dist=True)
    assert torch.equal(exp_avg, expected[6][0]["optim"]["state"][0]["exp_avg"])


def test_plain_dcp_load_restores_a_whole_optimizer_and_scheduler(saved):
    """As the PyTorch docs write it: ``dcp.load({"model": m.state_dict(), "optim":
    opt.state_dict(), ...})`` then ``load_state_dict``. Non-tensor entries (``lr``,
    ``betas``, the scheduler's counters) are stored as DCP byte items, so nothing is
    silently left at its fresh value."""
    root, _state, _objs, expected = saved
    _fresh, objs = make_state(seed=5)
    train(objs)  # Adam's state exists (a fresh optimizer's state_dict has none to fill)
    objs["optim"].param_groups[0]["lr"] = 0.5  # must come back as the checkpoint's value
    sd = {name: objs[name].state_dict() for name in ("model", "optim", "sched")}
    dcp.load(sd, checkpoint_id=str(root / "step_6" / "rank_0"), no_dist=True)
    for name in ("model", "optim", "sched"):
        objs[name].load_state_dict(sd[name])
        assert_tree_equal(objs[name].state_dict(), expected[6][0][name])
    assert objs["optim"].param_groups[0]["lr"] == expected[6][0]["optim"]["param_groups"][0]["lr"]


def test_submit_returns_at_once_and_releases_before_the_write(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    train(objs)
    with make_writer(config(str(tmp_path)), 0, 1) as writer:
        meta, buf = snapshot(engine, 1)
        t0 = time.perf_counter()
        ticket = writer.submit(meta, buf)
        assert time.perf_counter() - t0 < 0.05
        assert ticket.wait_released(10)
        want = _states(objs)
        buf.fill_(7)  # the caller reuses its slot as soon as it is released
        assert ticket.result(30).status == "ok"
        assert writer.staging_bytes >= meta.layout.nbytes
    fresh_state, fresh = make_state(seed=5)
    load(str(tmp_path), fresh_state)
    assert_tree_equal(_states(fresh), want)


def test_without_staging_the_buffer_is_held_until_done(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    train(objs)
    with make_writer(config(str(tmp_path)), 0, 1, staging=False) as writer:
        meta, buf = snapshot(engine, 1)
        ticket = writer.submit(meta, buf)
        ticket.wait_released(30)
        assert ticket.done.done() and ticket.result().status == "ok"
        assert writer.staging_bytes == 0


def test_a_snapshot_that_fails_its_checksum_is_not_persisted(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    train(objs)
    with make_writer(config(str(tmp_path)), 0, 1) as writer:
        meta, buf = snapshot(engine, 1)
        buf[0] ^= 1  # overwritten or corrupted before the writer copied it
        result = writer.submit(meta, buf).result(30)
    assert result.status == "failed" and "verification" in result.error
    assert list_checkpoints(str(tmp_path)) == []


def test_should_persist_schedule(tmp_path):
    every = make_writer(config(str(tmp_path), every_n_steps=5), 0, 1)
    assert [s for s in range(1, 21) if every.should_persist(s)] == [5, 10, 15, 20]
    timed = make_writer(config(str(tmp_path), every_n_steps=0, interval_s=60.0), 0, 1)
    assert timed.should_persist(1, now=600.0)
    timed._last_window = timed._window(600.0)  # what submit records
    assert not timed.should_persist(2, now=659.0)
    assert timed.should_persist(3, now=660.0)  # epoch-aligned window: same on every rank
    both = make_writer(config(str(tmp_path), every_n_steps=10, interval_s=60.0), 0, 1)
    assert not both.should_persist(7, now=0.0) and both.should_persist(10, now=0.0)
    # The caller knows the snapshot before: a save slips to the first snapshot after its
    # multiple instead of vanishing (recovery.schedules.save_schedule).
    assert every.should_persist(11, steps_due=True)
    assert not every.should_persist(10, steps_due=False)
    off = make_writer(config("", every_n_steps=1), 0, 1)
    assert not off.should_persist(1)
    assert off.submit(*snapshot(SnapshotEngine(make_state()[0]), 1)).result().status == "skipped"
    for w in (every, timed, both, off):
        w.close()


def test_manifest_waits_for_every_rank_and_dp_state_reshards(tmp_path):
    """Two data-parallel ranks (identical state): the checkpoint appears only when both
    are done, and loads at world sizes 1, 2 and 3."""
    engines, objs_by_rank = [], []
    for _rank in range(2):
        state, objs = make_state(seed=1)
        train(objs, 3)
        engines.append(SnapshotEngine(state))
        objs_by_rank.append(objs)
    want = _states(objs_by_rank[0])
    writers = [make_writer(config(str(tmp_path)), r, 2, run_id="job") for r in range(2)]
    r0 = persist(writers[0], engines[0], 3)
    assert r0.status == "ok" and not r0.committed
    assert list_checkpoints(str(tmp_path)) == []  # rank 1 not done: nothing visible
    assert scan(str(tmp_path))[0].status == "incomplete"
    r1 = persist(writers[1], engines[1], 3)
    assert r1.committed  # the last rank to finish writes the manifest
    for w in writers:
        w.close()
    (ckpt,) = list_checkpoints(str(tmp_path))
    assert ckpt.world_size == 2
    assert ckpt.manifest.identical_segments == ["loop", "model", "optim", "rng", "sched"]
    for rank, world in ((0, 1), (1, 2), (2, 3)):
        fresh_state, fresh = make_state(seed=9)
        result = load(ckpt, fresh_state, rank=rank, world_size=world)
        assert_tree_equal(_states(fresh), want)
        assert set(result.sources.values()) == ({rank} if world == 2 else {0})


def test_per_rank_state_does_not_reshard(tmp_path):
    writers = []
    for rank in range(2):
        state, objs = make_state(seed=1, rank=rank)  # LoopState holds the rank: differs
        train(objs, 2)
        writers.append(make_writer(config(str(tmp_path)), rank, 2))
        assert persist(writers[-1], SnapshotEngine(state), 2).status == "ok"
    for w in writers:
        w.close()
    (ckpt,) = list_checkpoints(str(tmp_path))
    assert "loop" not in ckpt.manifest.identical_segments
    fresh_state, fresh = make_state(seed=3)
    with pytest.raises(DurableError, match="not data-parallel"):
        load(ckpt, fresh_state, rank=2, world_size=3)
    load(ckpt, fresh_state, rank=2, world_size=3, source_rank=1)
    assert fresh["loop"].rank == 1
    load(ckpt, fresh_state, rank=0, world_size=2)
    assert fresh["loop"].rank == 0


def test_done_files_of_another_run_are_never_committed(tmp_path):
    engines = [SnapshotEngine(make_state(seed=1)[0]) for _ in range(2)]
    old = make_writer(config(str(tmp_path)), 1, 2, run_id="crashed-run")
    assert persist(old, engines[1], 5).status == "ok"
    old.close()
    new = make_writer(config(str(tmp_path)), 0, 2, run_id="new-run")
    assert not persist(new, engines[0], 5).committed
    new.close()
    assert list_checkpoints(str(tmp_path)) == []


def _newest_data_file(root: Path) -> Path:
    return root / "step_6" / "rank_0" / "__0_0.distcp"


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "snapshot.json"])
def test_corruption_is_caught_and_load_latest_falls_back(saved, victim):
    root, state, objs, expected = saved
    _flip_byte(root / "step_6" / "rank_0" / victim)
    report = verify(latest_checkpoint(str(root)))
    assert not report.ok and victim in report.problems[0]
    assert verify(list_checkpoints(str(root))[0]).ok
    before = _states(objs)
    with pytest.raises(CorruptCheckpoint):
        load(str(root / "step_6"), state)
    assert_tree_equal(_states(objs), before)  # a refused load leaves live state alone
    result = load_latest(str(root), state)
    assert result.step == 4 and [s for s, _ in result.fallbacks] == [6]
    assert_tree_equal(_states(objs), expected[4][0])


def test_damage_past_the_file_checksums_is_caught_by_segment_digests(saved):
    """verify=False skips the file hashes; the snapshot digests still catch it."""
    root, state, _objs, _expected = saved
    data = _newest_data_file(root)
    _flip_byte(data, offset=data.stat().st_size - 200)  # inside the last tensor's bytes
    with pytest.raises(CorruptCheckpoint):
        load(str(root / "step_6"), state, verify=False)


def test_a_missing_file_makes_a_checkpoint_damaged_and_unlisted(saved):
    root = saved[0]
    os.remove(root / "step_6" / "rank_0" / "snapshot.json")
    assert [c.step for c in list_checkpoints(str(root))] == [2, 4]
    assert scan(str(root))[-1].status == "damaged"


def test_dcp_metadata_is_never_unpickled_freely():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(CorruptCheckpoint, match="not allowed"):
        load_dcp_metadata(pickle.dumps(Evil()))


def test_retention_keeps_exactly_keep_last(tmp_path):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    (tmp_path / "step_1" / "rank_0").mkdir(parents=True)  # a crashed save's leftover
    with make_writer(config(str(tmp_path), keep_last=2), 0, 1) as writer:
        for step in range(2, 7):
            train(objs)
            assert persist(writer, engine, step).committed
            assert len(list_checkpoints(str(tmp_path))) == min(step - 1, 2)
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [5, 6]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
        "step_5", "step_6"]
    # API prune: a newer incomplete directory may be a save in progress.
    (tmp_path / "step_9" / "rank_0").mkdir(parents=True)
    (tmp_path / "step_9" / "rank_0" / "__0_0.distcp").write_bytes(b"partial")
    report = prune(str(tmp_path), keep_last=1)
    assert report.kept == [6] and report.spared and len(report.deleted) == 1
    assert prune(str(tmp_path), keep_last=1, incomplete_grace_s=0).deleted[0].endswith("step_9")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("step_")] == ["step_6"]


def test_history_csv_has_one_row_per_save(saved):
    root = saved[0]
    with open(root / "checkpoint_history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["2", "4", "6"]
    assert set(rows[0]) >= {"step", "rank", "tier", "bytes", "duration_s", "throughput_MBps",
                            "status"}
    assert all(r["status"] == "ok" and int(r["bytes"]) > 0 and r["tier"] == "durable"
               for r in rows)
    assert durable.read_history(str(root))[-1]["step"] == "6"


def test_load_errors_are_clear(tmp_path):
    state, _ = make_state()
    with pytest.raises(DurableError, match="no valid checkpoint"):
        load(str(tmp_path), state)
    with pytest.raises(DurableError, match="no loadable checkpoint"):
        load_latest(str(tmp_path), state)
    assert list_checkpoints(str(tmp_path / "missing")) == []
    with pytest.raises(DurableError, match="does not exist"):
        scan(str(tmp_path / "missing"))


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_direct_file_writes_exact_bytes_with_or_without_o_direct(tmp_path, where):
    from replication.durable.storage import DIRECT_CHUNK, DirectFile

    base = tmp_path if where == "disk" or not os.path.isdir("/dev/shm") else Path("/dev/shm")
    path = base / f"direct-{os.getpid()}-{where}.bin"
    rng = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).numpy().tobytes()
              for n in (3, 70_000, DIRECT_CHUNK + 5, 1, 4096, 2 * DIRECT_CHUNK - 7)]
    try:
        with DirectFile(str(path)) as f:
            for p in pieces[:3]:
                f.write(p)
            os.fsync(f.fileno())  # DCP fsyncs before closing: every byte so far is written
            assert path.stat().st_size == sum(map(len, pieces[:3]))
            for p in pieces[3:]:
                f.write(memoryview(p))
        assert path.read_bytes() == b"".join(pieces)
    finally:
        path.unlink(missing_ok=True)


def test_max_write_mbps_paces_a_save_and_progress_is_logged(tmp_path, caplog):
    state, objs = make_state()
    engine = SnapshotEngine(state)
    train(objs)
    caplog.set_level("INFO", logger="checkpointless.durable")
    with make_writer(config(str(tmp_path)), 0, 1, max_write_mbps=0.25,
                       progress_interval_s=0.05) as writer:
        result = persist(writer, engine, 1)
    assert result.status == "ok"
    assert result.duration_s >= 0.8 * result.nbytes / 0.25e6 - 0.05  # ~70 KB at 0.25 MB/s
    assert "persisting step 1 (rank 0):" in caplog.text and "MB/s" in caplog.text
    assert "persisted step 1 (rank 0)" in caplog.text


def test_direct_file_falls_back_when_the_filesystem_refuses_direct_writes(tmp_path,
                                                                           monkeypatch):
    import errno
    import fcntl

    from replication.durable import storage

    real_write = os.write

    def refusing_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(storage.os, "write", refusing_write)
    payload = bytes(range(256)) * (storage.DIRECT_CHUNK // 256 + 3)
    with storage.DirectFile(str(tmp_path / "x.bin")) as f:
        f.write(payload)
    assert not f.direct
    assert (tmp_path / "x.bin").read_bytes() == payload


def test_staging_is_paced_unless_the_caller_needs_its_buffer_sooner(tmp_path, monkeypatch):
    from replication.durable import staging as staging_module
    from replication.training_state.state import TrainingState
    from tests.helpers.training import Holder

    # 32 MB paced at 25 MB/s: 1.28 s. Unpaced, the copy took 0.05 s on an idle host and
    # 0.48 s on a loaded one (2 cores, the suite's other files): the bounds leave room.
    monkeypatch.setattr(staging_module, "STAGE_BYTES_PER_S", 25e6)
    state = TrainingState()
    state.register("big", Holder({"w": torch.randn(8 << 20)}))
    engine = SnapshotEngine(state)
    with make_writer(config(str(tmp_path))) as writer:
        took = []
        for step, within in ((1, None), (2, 0.1)):
            meta, buf = snapshot(engine, step)
            t0 = time.monotonic()
            ticket = writer.submit(meta, buf, release_within_s=within)
            assert ticket.wait_released(10)
            took.append(time.monotonic() - t0)
            assert ticket.result(30).status == "ok"
    assert took[0] >= 1.0 and took[1] < 0.7, took


def test_a_save_submitted_just_before_close_is_written(tmp_path):
    """Regression: the writer thread, busy appending history rows when the final step
    was submitted and close() called, used to exit and abandon that save."""
    state, objs = make_state()
    engine = SnapshotEngine(state)
    writer = make_writer(config(str(tmp_path)), 0, 1)
    slow_append, entered = writer._history.append, threading.Event()

    def append(rows):  # the history write is slow (busy storage)
        if rows:
            entered.set()
            time.sleep(0.5)
        slow_append(rows)

    writer._history.append = append
    train(objs)
    assert persist(writer, engine, 1).status == "ok"  # leaves a history row to write
    assert entered.wait(10)
    train(objs)
    meta, buf = snapshot(engine, 2)
    ticket = writer.submit(meta, buf)
    writer.close(timeout=20)
    assert ticket.result(1).status == "ok"
    assert [c.step for c in durable.list_checkpoints(str(tmp_path))] == [1, 2]


def test_save_schedule_slips_a_save_and_survives_a_restore():
    """Snapshots every 4 steps, saves every 10: each save is made at the first snapshot
    at or after its multiple; a restore to a snapshot brings back the one before it, so
    a rank restored there (a replacement) decides that step as the others did."""
    from recovery.schedules.save_schedule import SaveSchedule, crosses

    schedule, due = SaveSchedule(), []
    schedule.before_capture(0)
    for step in range(4, 45, 4):
        schedule.before_capture(step)
        previous = schedule.previous(step)
        assert previous == step - 4
        if crosses(previous, step, 10):
            due.append(step)
    assert due == [12, 20, 32, 40]
    saved = schedule.state_dict()
    assert saved == {"step": 44, "previous": 40}
    replacement = SaveSchedule()
    replacement.load_state_dict({"step": 20, "previous": 16})
    assert replacement.previous(20) == 16 and crosses(16, 20, 10)
    assert replacement.previous(16) is None
    schedule.before_capture(44)  # the same step again (a restore re-snapshots it)
    assert schedule.previous(44) == 40
    empty = SaveSchedule()
    assert empty.state_dict() == {}
    empty.load_state_dict({})
    assert empty.step is None
