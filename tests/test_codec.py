"""The pickle-free skeleton codec and snapshot metadata: round trips, refusals, and
robustness against malformed bytes (from a bad peer or a damaged file)."""

from __future__ import annotations

import collections
import contextlib
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from replication.snapshots import checksum
from replication.snapshots.digest_copy import compute_digests
from replication.snapshots.snapshot import SnapshotEngine, restore_from_buffer
from replication.training_state import codec
from replication.training_state.layout import flatten, unflatten_segment
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta
from replication.training_state.state import TrainingState
from tests.helpers.training import Holder, assert_tree_equal

FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
MALFORMED = (SnapshotError, codec.CodecError, checksum.ChecksumMismatch)


def _round_trip(tree: Any) -> Any:
    """Capture ``tree`` as one state entry, then rebuild it from the snapshot bytes."""
    state = TrainingState(rng=False)
    state.register("user", Holder(tree))
    engine = SnapshotEngine(state)
    slot = engine.capture(0)
    engine.seal(slot)
    seg = slot.layout.segment("user")
    return unflatten_segment(slot.segment_bytes("user"), seg, slot.skeletons["user"])


# -- round trips --------------------------------------------------------------------

_keys = st.one_of(
    st.none(), st.booleans(), st.integers(), st.text(max_size=6),
    st.tuples(st.integers(-5, 5), st.text(max_size=3)),
)
_tensors = st.one_of(
    st.lists(st.floats(width=32), max_size=6).map(lambda xs: torch.tensor(xs, dtype=torch.float32)),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(
        lambda xs: torch.tensor(xs, dtype=torch.int64)
    ),
)
_arrays = hnp.arrays(
    dtype=st.sampled_from([np.float64, np.float32, np.int32, np.uint8, np.bool_]),
    shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3),
)
# numpy scalars (no nan: the tree comparison uses == for non-python-float scalars)
_np_scalars = st.sampled_from(
    [np.float64, np.float32, np.float16, np.int64, np.int8, np.uint64, np.bool_, "<U3"]
).flatmap(lambda dt: hnp.from_dtype(np.dtype(dt), allow_nan=False))
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8),
    st.binary(max_size=8), _tensors, _arrays, _np_scalars,
)
_trees = st.recursive(
    _leaves,
    lambda c: st.one_of(
        st.lists(c, max_size=4), st.tuples(c, c), st.dictionaries(_keys, c, max_size=4)
    ),
    max_leaves=16,
)


@FUZZ
@given(_trees)
def test_any_supported_tree_round_trips_exactly(tree):
    assert_tree_equal(_round_trip(tree), tree)


def test_tag_lookalike_user_data_is_not_confused_with_codec_tags():
    tree = {"t": 0, "f": "nan", "B": "AA==", "np": 3, "D": [["a", 1]], "dt": "float32"}
    assert _round_trip(tree) == tree
    assert _round_trip([{"t": 1}]) == [{"t": 1}]


def test_special_floats_and_big_ints_round_trip():
    tree = [float("nan"), float("inf"), float("-inf"), -0.0, 5e-324, 2**200, -(2**80)]
    out = _round_trip(tree)
    assert math.isnan(out[0]) and out[1:3] == [math.inf, -math.inf]
    assert math.copysign(1.0, out[3]) == -1.0
    assert out[4:] == tree[4:]


def test_zero_d_numpy_array_keeps_its_shape():
    out = _round_trip({"a": np.array(3.5, dtype=np.float32)})["a"]
    assert out.shape == ()


def test_numpy_float64_scalar_keeps_its_type():
    out = _round_trip({"best": np.float64(0.25)})["best"]
    assert type(out) is np.float64


@pytest.mark.parametrize(
    "value",
    [np.float64(np.nan), np.float64(-np.inf), np.float32(1.5), np.float16(-0.0), np.int8(-128),
     np.uint64(2**64 - 1), np.bool_(False), np.str_("héllo")],
    ids=repr,
)
def test_numpy_scalars_keep_type_and_value(value):
    out = _round_trip([value])[0]
    assert type(out) is type(value)
    assert np.array(out).tobytes() == np.array(value).tobytes()


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.bool_, np.complex128])
def test_zero_d_numpy_arrays_of_any_dtype_keep_shape_and_value(dtype):
    value = np.array(7, dtype=dtype)
    out = _round_trip((value, np.ones((0, 2), dtype)))
    assert_tree_equal(out, (value, np.ones((0, 2), dtype)))


# -- refusals -----------------------------------------------------------------------

class _Opaque:
    pass


@pytest.mark.parametrize(
    "leaf",
    [
        pytest.param(lambda: 0, id="lambda"),
        pytest.param(_Opaque(), id="custom-object"),
        pytest.param(1 + 2j, id="complex"),
        pytest.param(collections.namedtuple("P", "x y")(1, 2), id="namedtuple"),
        pytest.param(torch.nn.Linear(1, 1), id="module"),
    ],
)
def test_unsupported_leaf_is_refused_naming_entry_and_path(leaf):
    state = TrainingState(rng=False)
    state.register("user", Holder({"cfg": {"callbacks": [1, leaf]}}))
    with pytest.raises(codec.CodecError) as info:
        SnapshotEngine(state).capture(0)
    msg = str(info.value)
    assert "'user'" in msg
    assert "/cfg/callbacks/1" in msg
    assert type(leaf).__qualname__ in msg


@pytest.mark.parametrize(
    "leaf",
    [
        pytest.param(np.array(["a", "b"]), id="str-array"),
        pytest.param(np.array([1, None], dtype=object), id="object-array"),
        pytest.param(np.complex128(1j), id="complex-scalar"),
        pytest.param(np.datetime64("2024-01-01"), id="datetime64-scalar"),
        pytest.param(np.array([1.0], dtype=">f4" if np.little_endian else "<f4"),
                     id="non-native-byte-order"),
        pytest.param(np.bytes_(b"x"), id="bytes-scalar"),
        pytest.param(np.longdouble(1), id="longdouble-scalar"),
    ],
)
def test_unsupported_numpy_leaf_is_refused_naming_entry_and_path(leaf):
    with pytest.raises(codec.CodecError, match=r"'user'.*/cfg/1"):
        flatten({"user": {"cfg": [0, leaf]}})


def test_too_deeply_nested_state_is_refused_naming_the_entry():
    tree: Any = 0
    for _ in range(10_000):
        tree = [tree]
    with pytest.raises(codec.CodecError, match="'user'"):
        flatten({"user": tree})


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize(
    "make", [lambda: torch.zeros(2, dtype=torch.complex32), lambda: torch.zeros(2).to_sparse()],
    ids=["complex32", "sparse"],
)
def test_unsupported_tensor_is_refused_naming_the_entry(make):
    with pytest.raises(codec.CodecError, match="user"):
        flatten({"user": {"q": make()}})


# -- malformed skeletons ------------------------------------------------------------

def _segment_with_one_tensor():
    flat = flatten({"u": {"w": torch.arange(4.0)}})
    seg = flat.layout.segment("u")
    buf = torch.zeros(flat.layout.nbytes, dtype=torch.uint8)
    return buf[seg.offset : seg.offset + seg.nbytes], seg


@pytest.mark.parametrize(
    "skeleton",
    [
        b"", b"\xff\xfe", b"{", b"[1, 2]", b'{"a": 1, "b": 2}', b'{"zz": 1}', b'{"t": 99}',
        b'{"t": -1}', b'{"dt": "float128"}',
        *[
            pytest.param(s, id=s.decode()[:24])
            for s in (
                b'{"D": 5}', b'{"D": [[1]]}', b'{"L": 5}', b'{"T": null}', b'{"f": "abc"}',
                b'{"dt": []}', b'{"S": "ab"}', b'{"dev": "nodevice"}', b'{"set": [{"L": []}]}',
                b'{"ns": ["zzz", 1]}', b'{"t": "x"}', b'{"np": [0]}', b"[" * 100_000,
                b'{"t": true}', b'{"f": "1.5"}', b'{"f": ["nan"]}', b'{"B": "!!"}',
                b'{"S": [-1]}', b'{"S": [1e400]}', b'{"dev": 5}', b'{"D": [[{"L": []}, 1]]}',
                b'{"ns": ["<i8", 1.5]}', b'{"ns": ["<i1", 999]}', b'{"ns": ["O", 1]}',
                b'{"ns": ["<c16", 1]}', b'{"ns": [1]}', b'{"np": true}', b"1" * 5000,
            )
        ],
    ],
)
def test_malformed_skeleton_raises_codec_error(skeleton):
    seg_buf, seg = _segment_with_one_tensor()
    with pytest.raises(codec.CodecError):
        unflatten_segment(seg_buf, seg, skeleton)


def test_skeleton_too_deep_to_decode_raises_codec_error():
    """Nesting that json.loads still accepts may exceed the decoder's recursion."""
    data: Any = 1
    for _ in range(100_000):
        data = {"L": [data]}
    with pytest.raises(codec.CodecError, match="nested too deeply"):
        codec.decode(data, lambda i: torch.zeros(1))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_as_skeleton_raise_codec_error(raw):
    seg_buf, seg = _segment_with_one_tensor()
    try:
        unflatten_segment(seg_buf, seg, raw)
    except codec.CodecError:
        pass


# -- malformed metadata -------------------------------------------------------------

def _reference():
    """A sealed snapshot of a small model and a user entry, plus a fresh state."""
    def make_state():
        state = TrainingState(rng=False)
        state.register("m", torch.nn.Linear(4, 4))
        state.register("u", Holder({"step": 3, "x": torch.ones(3)}))
        return state

    engine = SnapshotEngine(make_state())
    slot = engine.capture(3)
    meta = engine.seal(slot)
    return meta, slot.buffer.clone(), make_state


def _restore_raw(raw: bytes, buf: torch.Tensor, make_state) -> None:
    meta = SnapshotMeta.from_bytes(raw)
    restore_from_buffer(make_state(), buf, meta)


def test_reference_metadata_restores():
    meta, buf, make_state = _reference()
    _restore_raw(meta.to_bytes(), buf, make_state)
    assert SnapshotMeta.from_bytes(meta.to_bytes()) == meta


def _with(path: tuple, value: Any):
    def mutate(d: dict) -> None:
        target = d
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(_with(("step",), float("nan")), id="step-nan"),
        pytest.param(_with(("step",), None), id="step-null"),
        pytest.param(_with(("digests",), []), id="digests-list"),
        pytest.param(_with(("skeletons",), 5), id="skeletons-int"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 0), "float128"),
                     id="unknown-dtype"),
        pytest.param(_with(("layout", "segments", 1, "offset"), 0), id="overlapping-segments"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 2), 10**6),
                     id="tensor-outside-segment"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 1), [5, 4]),
                     id="shape-does-not-match-size"),
        pytest.param(_with(("layout", "nbytes"), 10), id="segments-beyond-buffer"),
        pytest.param(_with(("digests", "m"), "0" * 32), id="wrong-digest"),
        pytest.param(_with(("skeletons", "u"), '{"t": 99}'), id="skeleton-bad-index"),
        pytest.param(_with(("skeletons", "u"), "{"), id="skeleton-not-json"),
        pytest.param(_with(("step",), float("inf")), id="step-infinity"),
        pytest.param(_with(("layout", "nbytes"), float("inf")), id="nbytes-infinity"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 2), -64),
                     id="negative-tensor-offset"),
        pytest.param(_with(("skeletons", "u"), _DELETE), id="skeleton-missing"),
        pytest.param(_with(("skeletons", "u"), '{"L": 5}'), id="skeleton-malformed"),
        pytest.param(_with(("skeletons", "u"), "[" * 100_000), id="skeleton-deep"),
        pytest.param(_with(("skeletons", "u"), 5), id="skeleton-not-a-string"),
        pytest.param(_with(("skeletons", "zz"), "1"), id="skeleton-for-no-segment"),
        pytest.param(_with(("digests", "u"), _DELETE), id="digest-missing"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 1), [-4, -4]),
                     id="negative-shape"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 1, 2), 68),
                     id="misaligned-tensor-offset"),
        pytest.param(_with(("layout", "segments", 1, "nbytes"), -4096),
                     id="negative-segment-size"),
        pytest.param(_with(("layout", "segments", 1, "name"), "m"), id="duplicate-segment"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 1), [2, 8]),
                     id="consistent-wrong-shape"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 1, 2), 0),
                     id="consistent-wrong-offset"),
        pytest.param(_with(("layout", "segments", 0, "tensors", 0, 1), [0, 2**70]),
                     id="huge-dim"),
    ],
)
def test_malformed_metadata_raises_snapshot_or_codec_error(mutate):
    meta, buf, make_state = _reference()
    data = json.loads(meta.to_bytes())
    assert [s["name"] for s in data["layout"]["segments"]] == ["m", "u"]
    assert data["layout"]["segments"][0]["tensors"][0][:3] == ["float32", [4, 4], 0]
    mutate(data)
    raw = json.dumps(data).encode()
    with pytest.raises(MALFORMED):
        _restore_raw(raw, buf, make_state)


def test_undecodable_skeleton_with_matching_digest_raises_snapshot_error():
    """Even a skeleton whose checksum matches (written by a buggy peer, say) must fail
    as a SnapshotError naming the segment, before anything is loaded."""
    meta, buf, make_state = _reference()
    skeletons = {**meta.skeletons, "u": b'{"D": [["step", {"L": 5}]]}'}
    digests = compute_digests(buf, meta.layout, skeletons)
    bad = SnapshotMeta(meta.step, meta.layout, skeletons, digests)
    state = make_state()
    before = state.capture()["m"]["weight"].clone()
    with pytest.raises(SnapshotError, match="segment 'u'"):
        restore_from_buffer(state, buf, bad)
    assert torch.equal(state.capture()["m"]["weight"], before)


def test_metadata_without_a_segments_skeleton_cannot_be_built():
    meta, _, _ = _reference()
    with pytest.raises(SnapshotError, match="skeletons"):
        SnapshotMeta(meta.step, meta.layout, {"m": meta.skeletons["m"]}, meta.digests)


def test_deeply_nested_metadata_raises_snapshot_error():
    with pytest.raises(SnapshotError):
        SnapshotMeta.from_bytes(b"[" * 100_000)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_metadata_raise_snapshot_error(raw):
    with pytest.raises(SnapshotError):
        SnapshotMeta.from_bytes(raw)


@FUZZ
@given(st.data())
def test_damaged_metadata_is_refused_or_restores(data):
    """Flipped or truncated metadata either is refused with a snapshot/codec/checksum
    error or still restores; no other exception escapes."""
    meta, buf, make_state = _reference()
    raw = bytearray(meta.to_bytes())
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.sampled_from(b'0123456789-"{}[],:eE.x'))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    with contextlib.suppress(*MALFORMED):
        _restore_raw(bytes(raw), buf, make_state)


def test_corrupted_skeleton_value_is_detected():
    meta, buf, make_state = _reference()
    raw = meta.to_bytes()
    assert raw.count(b'\\"step\\",3') == 1  # the user entry's step counter, in its skeleton
    with pytest.raises(MALFORMED):
        _restore_raw(raw.replace(b'\\"step\\",3', b'\\"step\\",7'), buf, make_state)
