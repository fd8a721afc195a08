"""Property-based tests of the durable tier against damaged checkpoint directories.

A real checkpoint root (two checkpoints of a trained model, Adam, a scheduler and loop
state) is copied for every example and damaged at random: MANIFEST, per-rank ``done``
records and ``snapshot.json`` sidecars get their JSON mutated, truncated or replaced by
garbage; DCP metadata and data files get truncated, flipped or deleted; odd entries
appear under ``step_*`` names. Sometimes the manifest is then *re-hashed* to match the
damaged files, so the damage gets past the checksums and reaches the parsers behind
them (sidecar, DCP metadata, DCP data, segment decoding).

Whatever happens, every public entry point (``scan``, ``list_checkpoints``,
``open_checkpoint``, ``verify``, ``load``, ``load_latest``, ``read_snapshot``, ``prune``)
and ``checkpointless ckpt`` must either work or raise :class:`DurableError` (its
subclass :class:`CorruptCheckpoint` for damage) with a message; a load that succeeds
must restore exactly the saved state (damage is never loaded silently).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from launcher.cli import main
from replication import durable
from replication.durable import DurableError
from replication.snapshots.snapshot import SnapshotEngine
from tests.helpers.training import assert_tree_equal
from tests.test_durable_support import config, make_state, make_writer, persist, train

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

#: Shrinking a failure here takes minutes (every example copies and loads checkpoints);
#: the failing example and the damage list are reported as found.
NOSHRINK = [Phase.explicit, Phase.reuse, Phase.generate]

FUZZ = settings(max_examples=80, deadline=10000, derandomize=True, phases=NOSHRINK,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

#: ``checkpointless ckpt`` reports an exception it did not expect as "URL: TypeName: text":
#: for these types that means a bug was papered over, not a damaged checkpoint.
_BUG_NAMES = re.compile(r"\b(AttributeError|TypeError|KeyError|IndexError|NameError|"
                        r"UnboundLocalError|RecursionError|ZeroDivisionError|AssertionError|"
                        r"OverflowError|UnicodeDecodeError|JSONDecodeError): ")


def _states(objs: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) for k, v in objs.items()}


class _Master(tuple):
    """(root, expected states by step), with a short repr for hypothesis' reports."""

    def __repr__(self) -> str:
        return "master"


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    root = tmp_path_factory.mktemp("durable_fuzz")
    state, objs = make_state()
    engine = SnapshotEngine(state)
    expected = {}
    with make_writer(config(str(root), keep_last=5), 0, 1) as writer:
        for step in (2, 4):
            train(objs, 1)
            result = persist(writer, engine, step)
            assert result.status == "ok" and result.committed, result
            expected[step] = _states(objs)
    return _Master((root, expected))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.text(max_size=12) | st.sampled_from([10**400, -1, 0, 2**63]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=3),
    max_leaves=8,
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate_json(data: st.DataObject, raw: bytes) -> bytes:
    """Replace, delete or retype one node of a JSON document (or garble the text)."""
    how = data.draw(st.sampled_from(["node", "node", "node", "truncate", "garbage", "empty"]))
    if how == "truncate":
        return raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    if how == "garbage":
        return data.draw(st.binary(max_size=64))
    if how == "empty":
        return b""
    try:
        doc = json.loads(raw)
    except ValueError:  # damaged already: damage it some more
        return raw[: len(raw) // 2]
    path = data.draw(st.sampled_from(_paths(doc)))
    if not path:
        return json.dumps(data.draw(_json)).encode()
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(_json)
    try:
        return json.dumps(doc).encode()
    except (ValueError, OverflowError):
        return raw


def _rehash(root: Path, step_dir: Path) -> None:
    """Make the manifest and the rank record agree with whatever the files now hold."""
    from fsspec.implementations.local import LocalFileSystem

    from replication.durable.storage import hash_file

    fs = LocalFileSystem()
    for record_path in (step_dir / "MANIFEST.json", step_dir / "rank_0.done.json"):
        try:
            doc = json.loads(record_path.read_bytes())
            ranks = doc.get("ranks", [doc])
            for rank in ranks:
                for rel, rec in rank["files"].items():
                    f = step_dir / rel
                    if f.is_file():
                        rec["size"], rec["xxh3_128"] = hash_file(fs, str(f))
            record_path.write_text(json.dumps(doc))
        except (ValueError, KeyError, TypeError, AttributeError, OSError):
            continue  # a record already too damaged to be re-hashed


def _damage(data: st.DataObject, root: Path) -> list[str]:
    """Apply 1-3 random kinds of damage; returns what was done (for the failure report)."""
    done = []
    for _ in range(data.draw(st.integers(1, 3))):
        step = data.draw(st.sampled_from([2, 4]))
        sdir = root / f"step_{step}"
        files = sorted(p for p in sdir.rglob("*") if p.is_file()) if sdir.exists() else []
        kind = data.draw(st.sampled_from(
            ["manifest", "done", "sidecar", "bytes", "delete", "oddity", "rehash"]))
        if kind == "manifest" and (sdir / "MANIFEST.json").is_file():
            p = sdir / "MANIFEST.json"
            p.write_bytes(_mutate_json(data, p.read_bytes()))
        elif kind == "done" and (sdir / "rank_0.done.json").is_file():
            p = sdir / "rank_0.done.json"
            p.write_bytes(_mutate_json(data, p.read_bytes()))
        elif kind == "sidecar" and (sdir / "rank_0" / "snapshot.json").is_file():
            p = sdir / "rank_0" / "snapshot.json"
            p.write_bytes(_mutate_json(data, p.read_bytes()))
            if data.draw(st.booleans()):
                _rehash(root, sdir)
        elif kind == "bytes" and files:
            p = data.draw(st.sampled_from(files))
            raw = bytearray(p.read_bytes())
            if raw and data.draw(st.booleans()):
                i = data.draw(st.integers(0, len(raw) - 1))
                raw[i] ^= data.draw(st.integers(1, 255))
            else:
                raw = raw[: data.draw(st.integers(0, len(raw)))]
            p.write_bytes(bytes(raw))
            if data.draw(st.booleans()):
                _rehash(root, sdir)
        elif kind == "delete" and files:
            p = data.draw(st.sampled_from(files))
            p.unlink()
        elif kind == "oddity":
            name = data.draw(st.sampled_from(
                ["step_5", "step_007", "step_", "step_-1", "step_" + "9" * 30, "step_2x",
                 "step_6/step_7", "step_8/MANIFEST.json"]))
            target = root / name
            make_dir = data.draw(st.booleans())
            if target.exists() or (target.parent != root and target.parent.is_file()):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if make_dir:
                target.mkdir()
            else:
                target.write_bytes(data.draw(st.binary(max_size=32)))
        elif kind == "rehash":
            _rehash(root, sdir)
        else:
            continue
        done.append(f"{kind} step_{step}")
    return done


def _check(fn, *args, **kwargs):
    """Run a durable entry point: it works, or raises DurableError with a clear message."""
    try:
        return fn(*args, **kwargs)
    except DurableError as exc:  # names the checkpoint, directory or file at fault
        assert re.search(r"step_|ckpt|MANIFEST|rank_", str(exc)), f"{fn.__name__}: {exc}"
        return None


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


@FUZZ
@given(data=st.data())
def test_damaged_checkpoints_give_clear_errors_never_wrong_state(master, tmp_path, data):
    src, expected = master
    root = tmp_path / "ckpt"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(src, root)
    damage = _damage(data, root)
    url = str(root)

    infos = _check(durable.scan, url) or []
    assert all(i.status in ("valid", "incomplete", "damaged") for i in infos), damage
    valid = _check(durable.list_checkpoints, url) or []
    assert [i.step for i in valid] == [i.step for i in infos if i.valid]
    for info in infos:
        report = _check(durable.verify, info, deep=True)
        assert report is None or isinstance(report.ok, bool)
        _check(durable.open_checkpoint, info.url)
    state, objs = make_state(seed=123)
    result = _check(durable.load_latest, url, state)
    if result is not None:  # whatever loaded is exactly what was saved at that step
        assert_tree_equal(_states(objs), expected[result.step])
    for step in (2, 4):
        state, objs = make_state(seed=321)
        got = _check(durable.load, str(root / f"step_{step}"), state)
        if got is not None:
            assert_tree_equal(_states(objs), expected[step])
        _check(durable.read_snapshot, str(root / f"step_{step}"))
    _check(durable.prune, url, 1, dry_run=True)

    for argv in (("ckpt", "list", url, "--all", "--json"), ("ckpt", "show", url),
                 ("ckpt", "verify", str(root / "step_4"), "--deep"),
                 ("ckpt", "verify", url, "--all"),
                 ("ckpt", "prune", url, "--keep-last", "1", "--dry-run")):
        code, err = _cli(*argv)
        assert code in (0, 1, 2) and "Traceback" not in err, (argv, code, err, damage)
        assert not _BUG_NAMES.search(err), (argv, err, damage)


def test_the_fuzzer_reaches_the_parsers_behind_the_checksums(master, tmp_path):
    """A re-hashed, garbled sidecar passes the checksums and must fail in the parser."""
    src, _ = master
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)
    sdir = root / "step_4"
    (sdir / "rank_0" / "snapshot.json").write_bytes(b'{"format": "checkpointless.durable"')
    _rehash(root, sdir)
    [info] = [i for i in durable.scan(str(root)) if i.step == 4]
    assert info.valid and durable.verify(info).ok  # the checksums agree with the damage
    state, _ = make_state(seed=5)
    with pytest.raises(durable.CorruptCheckpoint, match=r"snapshot\.json is not valid JSON"):
        durable.load(info, state)
    assert os.path.exists(root / "step_2" / "MANIFEST.json")
