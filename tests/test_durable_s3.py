"""The durable tier on S3 through s3fs, against a real HTTP endpoint (moto's server on
127.0.0.1): commit across ranks, retention, history, corruption fallback, plain DCP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from replication.durable import (
    DurableWriter,
    latest_checkpoint,
    list_checkpoints,
    load,
    load_latest,
    read_history,
    verify,
)
from replication.snapshots.snapshot import SnapshotEngine
from tests.helpers.training import assert_tree_equal, make_model
from tests.s3_server import moto_s3
from tests.test_durable_support import config, make_state, make_writer, persist, train

pytestmark = [
    pytest.mark.s3,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # no_dist saves
]


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server


def _model_sd(objs: dict) -> dict:
    return {k: v.clone() for k, v in objs["model"].state_dict().items()}


def test_s3_retention_history_and_corruption_fallback(s3):
    url = s3.url("single")
    state, objs = make_state()
    engine = SnapshotEngine(state)
    want = {}
    cfg = config(url, keep_last=2, storage_options=s3.storage_options)
    with DurableWriter(cfg, 0, 1) as writer:  # the default: a helper process writes
        for step in (1, 2, 3):
            train(objs)
            result = persist(writer, engine, step)
            assert result.status == "ok" and result.committed, result
            want[step] = _model_sd(objs)
    opts = s3.storage_options
    assert [c.step for c in list_checkpoints(url, opts)] == [2, 3]
    assert [r["step"] for r in read_history(url, opts)] == ["1", "2", "3"]
    fresh_state, fresh = make_state(seed=7)
    assert load_latest(url, fresh_state, storage_options=opts).step == 3
    assert_tree_equal(dict(fresh["model"].state_dict()), want[3])
    # Damage the newest checkpoint's data object in the store.
    fs = s3.filesystem()
    key = f"{s3.bucket}/single/step_3/rank_0/__0_0.distcp"
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    assert not verify(latest_checkpoint(url, opts), opts).ok
    result = load_latest(url, fresh_state, storage_options=opts)
    assert result.step == 2 and [s for s, _ in result.fallbacks] == [3]
    assert_tree_equal(dict(fresh["model"].state_dict()), want[2])


def test_s3_two_ranks_commit_and_load_anywhere(s3):
    url = s3.url("dp")
    opts = s3.storage_options
    engines = []
    for _ in range(2):
        state, objs = make_state(seed=4)
        train(objs, 2)
        engines.append(SnapshotEngine(state))
    want = _model_sd(objs)
    writers = [make_writer(config(url, storage_options=opts), r, 2) for r in range(2)]
    assert not persist(writers[0], engines[0], 2).committed
    assert list_checkpoints(url, opts) == []
    assert persist(writers[1], engines[1], 2).committed
    for w in writers:
        w.close()
    (ckpt,) = list_checkpoints(url, opts)
    assert ckpt.url == s3.url("dp", "step_2") and ckpt.world_size == 2
    fresh_state, fresh = make_state(seed=8)
    load(ckpt, fresh_state, rank=0, world_size=1)
    assert_tree_equal(dict(fresh["model"].state_dict()), want)
    # Plain DCP, reading straight from S3.
    model = make_model()
    sd = {"model": model.state_dict()}
    dcp.load(sd, storage_reader=FsspecReader(s3.url("dp", "step_2", "rank_1"), **opts),
             no_dist=True)
    for k, v in sd["model"].items():
        assert torch.equal(v, want[k])


def test_cli_reads_s3_with_storage_options(s3, capsys):
    import json

    from launcher.cli import main

    url = s3.url("single")  # written by the first test of this module
    opts = ["-o", f"client_kwargs.endpoint_url={s3.endpoint_url}", "-o", "key=testing",
            "-o", "secret=testing", "-o", "use_listings_cache=false"]
    assert main(["ckpt", "list", url, "--json", *opts]) == 0
    steps = [c["step"] for c in json.loads(capsys.readouterr().out)["checkpoints"]]
    assert steps == [2, 3]
    assert main(["ckpt", "verify", s3.url("single", "step_2"), *opts]) == 0
    assert "step 2: ok" in capsys.readouterr().out
    assert main(["ckpt", "list", s3.url("nothing-here"), *opts]) == 2
    assert "checkpointless: error:" in capsys.readouterr().err
