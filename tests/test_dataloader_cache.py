"""In-process tests of dataloader_cache: codec, sampler, loader, node and epoch caches.

Assertions go through the loader's event counters and the datasets' call logs, never
through timing.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from dataloader_cache import (
    BatchKey,
    CachedLoader,
    CorruptEntryError,
    DataloaderCacheConfig,
    DeterministicSampler,
    EpochSampleCache,
    NodeBatchCache,
    decode,
    encode,
)

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
support = importlib.import_module("test_dataloader_cache_support")
RecordingDataset = support.RecordingDataset


def idx_of(batches):
    return [b["idx"].tolist() for b in batches]


def run_epochs(loader, epochs):
    out = []
    for e in epochs:
        loader.set_epoch(e)
        out.extend(idx_of(loader))
    return out


def reference(n=40, bs=4, seed=7, epochs=(0, 1), **kw):
    with CachedLoader(RecordingDataset(n), bs, seed=seed, enabled=False, **kw) as ref:
        return run_epochs(ref, epochs)


def dir_bytes(path) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except FileNotFoundError:
                pass
    return total


# ---------------------------------------------------------------------------- codec
def test_codec_roundtrip_types():
    obj = {
        "f": torch.randn(3, 4)[:, ::2],
        "bf16": torch.ones(2, 3, dtype=torch.bfloat16),
        "scalar": torch.tensor(5),
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False]),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalar": np.float32(2.5),
        "text": ["a", "b"],
        "meta": (1, 2.5, None, True, b"raw"),
        7: "int key",
    }
    out = decode(bytearray(encode(obj).tobytes()))
    assert torch.equal(out["f"], obj["f"]) and out["bf16"].dtype == torch.bfloat16
    assert out["scalar"].shape == () and out["empty"].shape == (0, 3)
    assert out["mask"].dtype == torch.bool and np.array_equal(out["np"], obj["np"])
    assert type(out["np_scalar"]) is np.float32 and out["np_scalar"] == 2.5
    assert out["text"] == ["a", "b"] and out["meta"] == (1, 2.5, None, True, b"raw")
    assert out[7] == "int key"
    out["f"].add_(1)  # decoded tensors are writable


@pytest.mark.parametrize(
    "bad, name",
    [({"a": [1, {2}]}, "set"), (object(), "object"), (np.array([object()]), "dtype object")],
)
def test_codec_rejects_unsupported_types_by_name(bad, name):
    with pytest.raises(TypeError, match=name):
        encode(bad)


def test_codec_detects_truncation_and_bit_flips():
    raw = bytearray(encode({"x": torch.arange(100)}).tobytes())
    with pytest.raises(CorruptEntryError, match="length"):
        decode(raw[:-10])
    flipped = bytearray(raw)
    flipped[len(flipped) // 2] ^= 0x40
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode(flipped)
    with pytest.raises(CorruptEntryError, match="magic"):
        decode(b"XXXX" + bytes(raw[4:]))


# ---------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_matches_distributed_sampler(shuffle):
    ds = list(range(23))
    for rank in range(3):
        ours = DeterministicSampler(23, 4, seed=11, dp_rank=rank, dp_world=3, shuffle=shuffle)
        theirs = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=shuffle, seed=11)
        for epoch in range(3):
            theirs.set_epoch(epoch)
            assert ours.rank_indices(epoch) == list(theirs)
            flat = [i for s in range(ours.num_batches()) for i in ours.batch_indices(epoch, s)]
            assert flat == list(theirs)


# ---------------------------------------------------------------------------- loader
def test_same_batches_with_and_without_cache(tmp_path):
    ref = reference(epochs=(0, 1, 2))
    cfg = DataloaderCacheConfig(directory=str(tmp_path / "nc"), prefetch=3, workers=2)
    with CachedLoader(RecordingDataset(40), 4, seed=7, job_id="t", config=cfg) as cached:
        assert run_epochs(cached, (0, 1, 2)) == ref
        assert cached.stats()["misses"] == len(ref) and cached.stats()["writes"] == len(ref)
    # a second pass over the same node cache serves everything from it, in the same order
    log = tmp_path / "calls.log"
    with CachedLoader(RecordingDataset(40, str(log)), 4, seed=7, job_id="t", config=cfg) as again:
        assert run_epochs(again, (0, 1, 2)) == ref
        assert again.stats()["hits"] == len(ref) and again.stats()["computed"] == 0
    assert support.read_log(str(log)) == []


def test_contents_match_plain_dataloader_semantics(tmp_path):
    """Wrapping a DataLoader keeps its dataset, batch size, collate_fn and drop_last."""
    ds = RecordingDataset(22)
    dl = DataLoader(ds, batch_size=5, shuffle=False, drop_last=True)
    with CachedLoader(dl, seed=0, directory=str(tmp_path / "nc"), job_id="dl") as loader:
        assert len(loader) == 4
        got = list(loader)
    want = list(dl)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["idx"], b["idx"])


def test_wrapping_a_distributed_sampler_keeps_its_order():
    ds = RecordingDataset(30)
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=9)
        dl = DataLoader(ds, batch_size=4, sampler=sampler)
        with CachedLoader(dl, enabled=False) as loader:
            assert (loader.seed, loader.dp_rank, loader.dp_world) == (9, rank, 2)
            for epoch in range(2):
                sampler.set_epoch(epoch)
                loader.set_epoch(epoch)
                assert idx_of(loader) == [b["idx"].tolist() for b in dl]


def test_state_dict_reports_last_handed_out_batch_despite_prefetch(tmp_path):
    ref = reference()
    kw = dict(seed=7, job_id="sd", directory=str(tmp_path / "nc"), prefetch=4, workers=2)
    loader = CachedLoader(RecordingDataset(40), 4, **kw)
    it = iter(loader)
    got = [next(it)["idx"].tolist() for _ in range(3)]
    deadline = time.monotonic() + 20
    while loader.stats()["computed"] < 7 and time.monotonic() < deadline:
        time.sleep(0.01)  # let the prefetch run ahead of what was handed out
    assert loader.stats()["computed"] == 7  # 3 handed out + 4 prefetched
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["step"] == 3
    assert all(isinstance(v, (int, str)) for v in state.values())
    loader.close()
    # a fresh loader on an empty cache (a new node) resumes at exactly the next batch
    fresh = CachedLoader(RecordingDataset(40), 4, **{**kw, "directory": str(tmp_path / "new")})
    fresh.load_state_dict(state)
    rest = idx_of(fresh) + run_epochs(fresh, (1,))
    assert got + rest == ref
    fresh.close()


def test_state_at_epoch_end_resumes_at_next_epoch(tmp_path):
    ref = reference()
    a = CachedLoader(RecordingDataset(40), 4, seed=7, enabled=False)
    first = idx_of(a)
    state = a.state_dict()
    assert state == {**state, "epoch": 0, "step": 10, "epoch_done": 1}
    b = CachedLoader(RecordingDataset(40), 4, seed=7, enabled=False)
    b.load_state_dict(state)
    assert first + idx_of(b) == ref  # iterating a finished epoch starts the next one
    assert b.epoch == 1


def test_seek_during_iteration_rolls_back(tmp_path):
    ref = reference(epochs=(0,))
    log = tmp_path / "calls.log"
    loader = CachedLoader(
        RecordingDataset(40, str(log)), 4, seed=7, job_id="seek", directory=str(tmp_path / "c")
    )
    seen = []
    rolled = False
    for batch in loader:
        seen.append(batch["idx"].tolist())
        if len(seen) == 6 and not rolled:
            rolled = True
            loader.seek(0, 2)  # recovery: roll back to the committed step 2
    assert seen == ref[:6] + ref[2:]
    assert loader.stats()["hits"] >= 4  # steps 2..5 replayed from the node cache
    loader.close()


def test_load_state_refuses_incompatible_state():
    a = CachedLoader(RecordingDataset(40), 4, seed=7, enabled=False)
    b = CachedLoader(RecordingDataset(40), 4, seed=8, enabled=False)
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(TypeError, match="prefech"):
        CachedLoader(RecordingDataset(4), 2, prefech=2)
    with pytest.raises(ValueError, match="prefetch"):
        CachedLoader(RecordingDataset(4), 2, prefetch=-1)


def test_dp_ranks_partition_the_epoch(tmp_path):
    seen = []
    for rank in range(3):
        with CachedLoader(
            RecordingDataset(30), 4, seed=3, dp_rank=rank, dp_world=3, enabled=False
        ) as loader:
            seen += [i for b in idx_of(loader) for i in b]
    assert sorted(seen) == list(range(30))


def _join(parts):
    return {"idx": torch.cat([p["idx"] for p in parts])}


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_loader_hosting_ranks_hands_out_their_batches_joined(tmp_path, mode):
    """A job shrank from 4 ranks to 2 (ADR 0035): a loader built in the smaller world
    hands out, per step, what ranks 1 and 3 of the 4-rank world got, joined; it resumes
    from a state saved by rank 1's own loader, and caches each rank's part under that
    rank, where a rollback finds it."""
    own = {}
    for rank in (1, 3):
        with CachedLoader(RecordingDataset(40), 3, seed=5, dp_rank=rank, dp_world=4,
                          enabled=False) as ref:
            own[rank] = idx_of(ref)
    log = tmp_path / "reads.log"
    loader = CachedLoader(RecordingDataset(40, str(log)), 3, seed=5, dp_rank=1, dp_world=2,
                          job_id="host", directory=str(tmp_path / "nc"), worker_mode=mode,
                          workers=2, prefetch=2)
    loader.host((1, 3), 4, _join)
    assert len(loader) == len(own[1]) == 4 and loader.dp_world == 4
    assert idx_of(loader) == [a + b for a, b in zip(own[1], own[3], strict=True)]

    with CachedLoader(RecordingDataset(40), 3, seed=5, dp_rank=1, dp_world=4,
                      enabled=False) as rank1:
        it = iter(rank1)
        next(it), next(it)
        state = rank1.state_dict()  # rank 1's own position, before the shrink
    loader.load_state_dict(state)
    log.write_text("")
    again = idx_of(loader)
    assert again == [a + b for a, b in zip(own[1][2:], own[3][2:], strict=True)]
    assert log.read_text() == "", "a rollback should find each rank's part in the cache"
    assert loader.node_cache.lookup(BatchKey(loader.fingerprint, 0, 3, 1))[0] == "hit"

    with pytest.raises(ValueError, match="not ranks of a 4-rank world"):
        loader.host((1, 4), 4, _join)
    loader.close()


def test_a_loader_over_an_iterable_dataset_cannot_host_ranks():
    with CachedLoader(support.Stream(12), 2, dp_rank=0, dp_world=2,
                      enabled=False) as loader:
        assert "iterable dataset" in loader.host_refusal()
        with pytest.raises(ValueError, match="iterable dataset"):
            loader.host((0, 1), 2, _join)


def test_worker_errors_reach_the_caller(tmp_path):
    loader = CachedLoader(
        support.FailingDataset(8), 2, shuffle=False, enabled=False, prefetch=2, workers=2
    )
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="bad sample 3"):
        next(it)
    loader.close()


# ---------------------------------------------------------------------------- node cache
def test_size_budget_is_respected(tmp_path):
    root = tmp_path / "nc"
    one = encode({"x": torch.zeros(4, 3), "idx": torch.zeros(4, dtype=torch.int64)}).nbytes
    budget = int(one * 3.5)
    loader = CachedLoader(
        RecordingDataset(40), 4, seed=7, job_id="b", directory=str(root), size_budget_bytes=budget
    )
    for _ in loader:
        assert dir_bytes(root) <= budget
    assert dir_bytes(root) <= budget
    s = loader.stats()
    assert s["writes"] == 10 and s["evicted"] == 7  # 3 entries fit
    assert len(loader.node_cache.list_keys()) == 3
    loader.close()


def test_lookback_window_keeps_entries_back_to_the_committed_step(tmp_path):
    loader = CachedLoader(
        RecordingDataset(80),
        4,
        seed=1,
        job_id="lb",
        directory=str(tmp_path / "nc"),
        lookback=2,
        workers=0,  # synchronous: no prefetch still running when the counters are read
    )
    it = iter(loader)
    for _ in range(12):
        next(it)
    loader.mark_committed(0, 9)  # committed position: step 9; keep steps >= 7
    assert sorted(k.step for k in loader.node_cache.list_keys()) == [7, 8, 9, 10, 11]
    assert loader.stats()["evicted"] == 7
    loader.seek(0, 9)  # rollback replays from the cache
    before = loader.stats()["computed"]
    next(it)
    next(it)
    assert loader.stats()["computed"] == before
    loader.close()


def test_corrupt_entries_are_detected_and_recomputed(tmp_path):
    ref = reference(epochs=(0,))
    root = tmp_path / "nc"
    kw = dict(seed=7, job_id="cor", directory=str(root), prefetch=0, workers=0)
    with CachedLoader(RecordingDataset(40), 4, **kw) as warm:
        assert idx_of(warm) == ref
        fp = warm.fingerprint
    cache = NodeBatchCache("cor", str(root))
    truncated = cache.path(BatchKey(fp, 0, 0, 2))
    flipped = cache.path(BatchKey(fp, 0, 0, 5))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)  # a partial write
    data = bytearray(Path(flipped).read_bytes())
    data[-70] ^= 0x01  # one bit in the tensor payload
    Path(flipped).write_bytes(bytes(data))
    log = tmp_path / "calls.log"
    with CachedLoader(RecordingDataset(40, str(log)), 4, **kw) as loader:
        got = list(loader)
        s = loader.stats()
    assert idx_of(got) == ref
    for b in got:  # contents, not just indices: nothing corrupt reached the "model"
        want = torch.stack([support.sample_of(i)["x"] for i in b["idx"].tolist()])
        assert torch.equal(b["x"], want)
    assert s["corrupt"] == 2 and s["recomputed"] == 2 and s["hits"] == 8
    assert sorted(support.read_log(str(log))) == sorted(ref[2] + ref[5])
    assert cache.get(BatchKey(fp, 0, 0, 2)) is not None  # rewritten, valid again


def test_orphan_temp_files_of_dead_writers_are_removed(tmp_path):
    root = tmp_path / "nc"
    root.mkdir()
    (root / ".tmp-999999999-1-abc").write_bytes(b"half a batch")
    (root / f".tmp-{os.getpid()}-1-live").write_bytes(b"in flight")
    NodeBatchCache("o", str(root))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp")) == [
        f".tmp-{os.getpid()}-1-live"
    ]


def test_cleanup_removes_the_job_cache_and_stale_jobs(tmp_path):
    job = f"pytest-{os.getpid()}-{time.time_ns()}"
    stale_job = job + "-stale"
    stale = NodeBatchCache(stale_job)
    stale.put(BatchKey("0" * 16, 0, 0, 0), encode({"x": torch.zeros(3)}))
    old = time.time() - 7200
    os.utime(os.path.join(stale.root, ".lease"), (old, old))
    loader = CachedLoader(RecordingDataset(12), 4, seed=0, job_id=job)
    assert loader.node_cache.root.startswith("/dev/shm/checkpointless-") or "/tmp" in (
        loader.node_cache.root
    )
    assert not os.path.exists(stale.root)  # the abandoned cache of another job is gone
    list(loader)
    root = loader.node_cache.root
    assert len(os.listdir(root)) > 0
    loader.close(cleanup=True)
    assert not os.path.exists(root) and not os.path.exists(os.path.dirname(root))


def test_cleanup_of_configured_directory_keeps_foreign_files(tmp_path):
    root = tmp_path / "nc"
    root.mkdir()
    (root / "user-file.txt").write_text("keep me")
    with CachedLoader(RecordingDataset(12), 4, job_id="c", directory=str(root)) as loader:
        list(loader)
    loader.node_cache.cleanup()
    assert [p.name for p in root.iterdir()] == ["user-file.txt"]


# ---------------------------------------------------------------------------- epoch cache
def test_epoch_two_reads_the_epoch_cache_in_seeded_order(tmp_path):
    n, bs, seed = 40, 4, 7
    log = tmp_path / "calls.log"
    loader = CachedLoader(
        RecordingDataset(n, str(log)),
        bs,
        seed=seed,
        job_id="ec",
        directory=str(tmp_path / "nc"),
        epoch_cache_path=str(tmp_path / "ec"),
    )
    e0 = run_epochs(loader, (0,))
    s0 = loader.stats()
    assert s0["epoch_cache_writes"] == n and s0["samples_loaded"] == n
    assert len(support.read_log(str(log))) == n
    e1 = run_epochs(loader, (1,))
    s1 = loader.stats()
    assert s1["epoch_cache_hits"] == n and s1["samples_loaded"] == n  # no new dataset calls
    assert len(support.read_log(str(log))) == n
    g = torch.Generator()
    g.manual_seed(seed + 1)
    perm = torch.randperm(n, generator=g).tolist()
    assert [i for b in e1 for i in b] == perm  # the order the seed dictates
    assert e0 != e1 and e1 == reference(epochs=(1,))
    loader.close()


def test_epoch_cache_budget_and_corruption(tmp_path):
    one = encode(support.sample_of(0)).nbytes
    path = str(tmp_path / "ec")
    cache = EpochSampleCache(path, "f" * 16, budget_bytes=one * 5)
    cache._chunk = one  # reserve per sample so the budget is hit exactly
    stored = [cache.put(i, support.sample_of(i)) for i in range(8)]
    assert stored == [True] * 5 + [False] * 3
    assert cache.usage_bytes() <= one * 5
    assert cache.counters.snapshot()["epoch_cache_full"] == 3
    p = cache.path(2)
    Path(p).write_bytes(Path(p).read_bytes()[:-5])
    assert cache.get(2) == (False, None) and not os.path.exists(p)
    assert cache.counters.snapshot()["epoch_cache_corrupt"] == 1
    found, value = cache.get(3)
    assert found and torch.equal(value["x"], support.sample_of(3)["x"])


# ---------------------------------------------------------------------------- iterable
def test_iterable_dataset_shards_round_robin_and_resumes(tmp_path):
    def ranks_view(rank, state=None, directory=None):
        loader = CachedLoader(
            support.Stream(21),
            3,
            dp_rank=rank,
            dp_world=2,
            job_id="it",
            directory=directory or str(tmp_path / f"nc{rank}"),
        )
        if state:
            loader.load_state_dict(state)
        return loader

    full = {}
    for rank in range(2):
        with ranks_view(rank) as loader:
            full[rank] = run_epochs(loader, (0, 1))
    # 21 elements, 6 per round: 3 full rounds, then a tail of 3 (both ranks get >= 1)
    assert full[0][:4] == [[0, 2, 4], [6, 8, 10], [12, 14, 16], [18, 20]]
    assert full[1][:4] == [[1, 3, 5], [7, 9, 11], [13, 15, 17], [19]]
    assert full[0][4] == [1000, 1002, 1004]  # epoch 1 goes through set_epoch
    # resume rank 1 mid-epoch on a new node: replays the stream to the position
    a = ranks_view(1, directory=str(tmp_path / "a"))
    it = iter(a)
    head = [next(it)["idx"].tolist() for _ in range(2)]
    state = a.state_dict()
    a.close()
    b = ranks_view(1, state=state, directory=str(tmp_path / "b"))
    assert head + run_epochs(b, (0, 1)) == full[1]
    b.close()
    # on the same node, the resumed steps come from the node cache without the stream
    c = ranks_view(1, state=state, directory=str(tmp_path / "a"))
    nxt = next(iter(c))
    assert nxt["idx"].tolist() == full[1][2] and c.stats()["hits"] == 1
    assert c.stats()["samples_loaded"] == 0
    c.close()
