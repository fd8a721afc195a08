"""Tagged checkpoints (a framework's own layout, DeepSpeed's): the commit protocol.

Two ranks are two threads here, each with its own :class:`TaggedSave`, on a real
directory; the DeepSpeed engine that drives them under real processes is tested in
``test_deepspeed.py``. What a reader that follows ``latest`` can see is checked at each
point: never a tag whose files are not all there and checksummed.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from launcher.cli import main
from replication.durable import verify
from replication.durable.catalog import open_checkpoint
from replication.durable.format import CorruptCheckpoint, DurableError
from replication.durable.tagged import (
    LATEST,
    TaggedSave,
    local_dir,
    read_verified,
    scan_tagged,
)

WORLD = 2


def _saves(root: Path, tag: str, attempt: str, step: int = 10) -> list[TaggedSave]:
    return [TaggedSave(str(root), tag, attempt, r, WORLD, step, "run-a", "deepspeed")
            for r in range(WORLD)]


def _write_part(save: TaggedSave) -> None:
    if save.rank == 0:
        save.write("mp_rank_00_model_states.pt", b"model" * 100)
    save.write(f"zero_pp_rank_{save.rank}_mp_rank_00_optim_states.pt", bytes([save.rank]) * 300)
    save.finish_rank()


def _commit(save: TaggedSave, **kw):
    return save.commit(point_latest=True, abandoned=kw.pop("abandoned", lambda: None),
                       timeout_s=kw.pop("timeout_s", 30.0), **kw)


def test_a_tag_appears_whole_and_latest_names_it_after(tmp_path):
    r0, r1 = _saves(tmp_path, "global_step10", "0-1")
    _write_part(r0)
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(_commit(r0)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "rank 0 committed before rank 1 was done"
    assert not (tmp_path / "global_step10").exists() and not (tmp_path / LATEST).exists()
    _write_part(r1)
    waiter.join(10)
    manifest = result[0]
    assert manifest is not None and manifest.step == 10 and manifest.layout == "deepspeed"
    tag = tmp_path / "global_step10"
    assert sorted(os.listdir(tag)) == ["MANIFEST.json", "mp_rank_00_model_states.pt",
                                       "rank_0.done.json", "rank_1.done.json",
                                       "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (tmp_path / LATEST).read_text() == "global_step10"
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]
    assert read_verified(str(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")) == b"\1" * 300
    (info,) = scan_tagged(str(tmp_path))
    assert info.valid and info.step == 10 and info.world_size == WORLD
    assert verify(str(tag)).ok
    assert open_checkpoint(str(tag)).url == str(tag)


def test_a_damaged_file_is_refused_at_load_and_named_by_verify(tmp_path, capsys):
    saves = _saves(tmp_path, "global_step10", "0-1")
    for s in saves:
        _write_part(s)
    assert _commit(saves[0]) is not None
    f = tmp_path / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(f.read_bytes())
    data[7] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="the checkpoint is damaged"):
        read_verified(str(f))
    report = verify(str(tmp_path / "global_step10"))
    assert not report.ok and "zero_pp_rank_1" in report.problems[0], report.problems
    assert main(["ckpt", "verify", str(tmp_path / "global_step10")]) == 1
    assert "CORRUPTED" in capsys.readouterr().out


def test_a_save_cut_short_leaves_latest_on_the_previous_tag_and_the_replay_cleans_up(tmp_path):
    first = _saves(tmp_path, "global_step10", "0-1")
    for s in first:
        _write_part(s)
    assert _commit(first[0]) is not None
    cut = _saves(tmp_path, "global_step20", "0-2", step=20)
    _write_part(cut[0])  # rank 1 dies before its record: the generation moves on
    cut[1].write("zero_pp_rank_1_mp_rank_00_optim_states.pt", b"half")
    assert _commit(cut[0], abandoned=lambda: "a failure interrupted it") is None
    assert (tmp_path / LATEST).read_text() == "global_step10"
    assert not (tmp_path / "global_step20").exists()
    infos = scan_tagged(str(tmp_path))
    assert [(i.step, i.status) for i in infos] == [(10, "valid"), (20, "incomplete")]
    replay = _saves(tmp_path, "global_step20", "1-1", step=20)  # the next generation's
    for s in replay:
        _write_part(s)
    assert _commit(replay[0]) is not None
    assert (tmp_path / LATEST).read_text() == "global_step20"
    assert [(i.step, i.status) for i in scan_tagged(str(tmp_path))] == [(10, "valid"),
                                                                         (20, "valid")]
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_a_rank_that_cannot_write_ends_the_wait_at_once(tmp_path):
    r0, r1 = _saves(tmp_path, "global_step10", "0-1")
    _write_part(r0)
    r1.give_up("OSError: [Errno 28] No space left on device")
    assert _commit(r0, timeout_s=600) is None  # at once, not after the timeout
    assert not (tmp_path / LATEST).exists()


def test_the_same_tag_saved_again_replaces_it_and_a_scripts_own_files_stay(tmp_path):
    for attempt, payload in (("0-1", b"old"), ("0-2", b"new")):
        saves = _saves(tmp_path, "last", attempt)
        for s in saves:
            s.write(f"part_{s.rank}.pt", payload)
            s.finish_rank()
        assert _commit(saves[0]) is not None
    assert (tmp_path / "last" / "part_1.pt").read_bytes() == b"new"
    assert not [n for n in os.listdir(tmp_path) if "replaced" in n]
    # A script that writes into the tag before the save is committed (its own extras).
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "rng_state_0.pth").write_bytes(b"rng")
    saves = _saves(tmp_path, "mine", "0-3")
    for s in saves:
        _write_part(s)
    assert _commit(saves[0]) is not None
    names = os.listdir(tmp_path / "mine")
    assert "rng_state_0.pth" in names and "MANIFEST.json" in names
    assert verify(str(tmp_path / "mine")).ok


def test_ckpt_list_shows_a_deepspeed_save_dir(tmp_path, capsys):
    saves = _saves(tmp_path, "global_step10", "0-1")
    for s in saves:
        _write_part(s)
    _commit(saves[0])
    _write_part(_saves(tmp_path, "global_step20", "0-2", step=20)[0])  # in progress
    assert main(["ckpt", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "global_step10" in out and "complete" in out and "global_step20" not in out
    assert main(["ckpt", "list", "--all", "--json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["status"]) for c in doc["checkpoints"]] == [(10, "valid"),
                                                                      (20, "incomplete")]
    assert main(["ckpt", "show", str(tmp_path / "global_step10")]) == 0
    assert "deepspeed's own, tag 'global_step10'" in capsys.readouterr().out


def test_a_save_dir_on_object_storage_is_refused_with_one_line():
    with pytest.raises(DurableError, match="give a local or shared file-system path"):
        local_dir("memory://bucket/ckpt")
