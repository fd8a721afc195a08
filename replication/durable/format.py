"""The on-storage format of durable checkpoints (version 1), and how it is parsed safely.

Layout under the persistence root (any fsspec URL)::

    <root>/step_<N>/rank_<r>/__0_0.distcp     DCP data (one torch.save record per tensor)
    <root>/step_<N>/rank_<r>/.metadata        DCP metadata (DCP pickles it; see below)
    <root>/step_<N>/rank_<r>/snapshot.json    SnapshotMeta (layout, skeletons, digests)
                                              and the DCP key of every tensor
    <root>/step_<N>/rank_<r>.done.json        rank r finished: its files, sizes, checksums
    <root>/step_<N>/MANIFEST.json             written LAST: the checkpoint exists
    <root>/checkpoint_history.csv             one row per save attempt and rank

Each ``rank_<r>/`` directory is a complete, standard DCP checkpoint written with
``no_dist=True``, so ``torch.distributed.checkpoint.load(sd, checkpoint_id=".../rank_0")``
reads it. Its keys are DCP's flattened names of the state entries: the model's
``fc.weight`` registered as ``model`` is ``model.fc.weight``, exactly what DCP produces
from ``{"model": model.state_dict()}``. Only tensors go into DCP; every non-tensor
value (step counters, learning rates, RNG tuples) lives in the JSON skeletons of
``snapshot.json``, so nothing in a checkpoint is ever unpickled as an arbitrary
object: tensors are read with ``torch.load(weights_only=True)`` (DCP's reader) and
DCP's pickled ``.metadata`` is read with :func:`load_dcp_metadata`, which allows only
DCP's own metadata classes, ``torch.Size`` and dtypes, and only after its checksum
matched the manifest.
"""

from __future__ import annotations

import io
import json
import pickle
import posixpath
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from replication.errors import CheckpointlessError
from replication.snapshots import checksum
from replication.snapshots.digest_copy import segment_trailer
from replication.training_state import codec
from replication.training_state.layout import SegmentLayout
from replication.training_state.snapshot_meta import SnapshotError, SnapshotMeta

FORMAT = "checkpointless.durable"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_128"
MANIFEST = "MANIFEST.json"
SIDECAR = "snapshot.json"
HISTORY = "checkpoint_history.csv"
STEP_RE = re.compile(r"^step_(\d+)$")
LAYOUT_DCP = "dcp"


class DurableError(CheckpointlessError, RuntimeError):
    """A durable checkpoint that is missing, malformed or unusable (message says why)."""


class CorruptCheckpoint(DurableError):
    """A checkpoint whose bytes differ from what its manifest recorded."""


def step_dir(root: str, step: int) -> str:
    return posixpath.join(root, f"step_{step}")


def rank_dirname(rank: int) -> str:
    return f"rank_{rank}"


def done_name(rank: int) -> str:
    return f"rank_{rank}.done.json"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(posixpath.basename(name.rstrip("/")))
    return int(m.group(1)) if m else None


def dumps(doc: Any) -> bytes:
    return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")


def loads(raw: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(f"{what} is not valid JSON: {exc!r}"[:300]) from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{what} is not a JSON object")
    return doc


# -- file records -------------------------------------------------------------------------
@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint: its path relative to the step directory."""

    path: str
    size: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, CHECKSUM_ALGO: self.digest}


def parse_files(doc: Any, what: str) -> dict[str, FileRecord]:
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(f"{what}: 'files' is not an object")
    out = {}
    for rel, rec in doc.items():
        if (
            not isinstance(rel, str)
            or rel.startswith("/")
            or ".." in rel.split("/")
            or not isinstance(rec, dict)
            or not isinstance(rec.get("size"), int)
            or not isinstance(rec.get(CHECKSUM_ALGO), str)
        ):
            raise CorruptCheckpoint(f"{what}: malformed file entry {str(rel)[:80]!r}")
        out[rel] = FileRecord(rel, rec["size"], rec[CHECKSUM_ALGO])
    return out


# -- per-rank 'done' records and the manifest --------------------------------------------
@dataclass(frozen=True)
class RankRecord:
    """What one rank wrote for a step (its ``rank_<r>.done.json``)."""

    rank: int
    world_size: int
    step: int
    run_id: str
    files: dict[str, FileRecord]
    segments: dict[str, str]  # segment name -> digest of the persisted bytes
    nbytes: int
    finished_unix: float

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "run_id": self.run_id,
            "bytes": self.nbytes,
            "finished_unix": self.finished_unix,
            "segments": self.segments,
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }

    @staticmethod
    def from_json(doc: dict[str, Any], what: str) -> RankRecord:
        check_format(doc, what)
        try:
            segs = doc["segments"]
            if not isinstance(segs, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in segs.items()
            ):
                raise TypeError("segments")
            return RankRecord(
                rank=_int(doc["rank"]),
                world_size=_int(doc["world_size"]),
                step=_int(doc["step"]),
                run_id=str(doc["run_id"]),
                files=parse_files(doc["files"], what),
                segments=dict(segs),
                nbytes=_int(doc["bytes"]),
                finished_unix=_timestamp(doc["finished_unix"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"{what} is malformed: {exc!r}"[:300]) from None


@dataclass(frozen=True)
class Manifest:
    """The commit record of a checkpoint; it exists only once every rank is done."""

    step: int
    world_size: int
    run_id: str
    created_unix: float
    ranks: tuple[RankRecord, ...]
    #: ``dcp``: the runtime's own step directories; ``deepspeed``: a framework's own files
    #: under a tag it named (:mod:`replication.durable.tagged`), committed the same way.
    layout: str = LAYOUT_DCP
    tag: str = ""

    @property
    def files(self) -> dict[str, FileRecord]:
        return {k: v for r in self.ranks for k, v in r.files.items()}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def identical_segments(self) -> list[str]:
        """Segments whose bytes and skeleton are equal on every rank (data-parallel state)."""
        first = self.ranks[0].segments
        return sorted(
            name for name, d in first.items() if all(r.segments.get(name) == d for r in self.ranks)
        )

    def rank(self, r: int) -> RankRecord:
        return self.ranks[r]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "checksum": CHECKSUM_ALGO,
            "step": self.step,
            "world_size": self.world_size,
            "run_id": self.run_id,
            "created_unix": self.created_unix,
            "total_bytes": self.total_bytes,
            "identical_segments": self.identical_segments,
            "ranks": [r.to_json() for r in self.ranks],
            **({"layout": self.layout, "tag": self.tag} if self.layout != LAYOUT_DCP else {}),
        }

    @staticmethod
    def from_json(doc: dict[str, Any], what: str) -> Manifest:
        check_format(doc, what)
        if doc.get("checksum") != CHECKSUM_ALGO:
            raise CorruptCheckpoint(f"{what}: unknown checksum {doc.get('checksum')!r}")
        try:
            ranks = tuple(RankRecord.from_json(r, what) for r in doc["ranks"])
            m = Manifest(
                step=_int(doc["step"]),
                world_size=_int(doc["world_size"]),
                run_id=str(doc["run_id"]),
                created_unix=_timestamp(doc["created_unix"]),
                ranks=ranks,
                layout=str(doc.get("layout", LAYOUT_DCP)),
                tag=str(doc.get("tag", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpoint(f"{what} is malformed: {exc!r}"[:300]) from None
        if m.world_size < 1 or [r.rank for r in ranks] != list(range(m.world_size)):
            raise CorruptCheckpoint(f"{what}: ranks do not cover world size {m.world_size}")
        if any(r.step != m.step or r.world_size != m.world_size for r in ranks):
            raise CorruptCheckpoint(f"{what}: a rank record is for another step or world")
        return m


def check_format(doc: dict[str, Any], what: str) -> None:
    if not isinstance(doc, dict):  # e.g. an entry of a manifest's "ranks" list
        raise CorruptCheckpoint(f"{what}: a record is {type(doc).__name__}, not an object")
    if doc.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{what} is not a {FORMAT} document")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise DurableError(
            f"{what} has format version {version!r}; this build reads version {FORMAT_VERSION}"
        )


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"expected an integer, got {x!r}"[:80])
    return x


#: Timestamps past this (year 5138) are damage, not dates: they would overflow time_t.
_MAX_TIMESTAMP = 1e11


def _timestamp(x: Any) -> float:
    """A Unix time as recorded by a writer: a finite, non-negative number in range."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        raise TypeError(f"expected a timestamp, got {x!r}"[:80])
    if not 0 <= x < _MAX_TIMESTAMP:  # also refuses NaN and ints too large for a float
        raise ValueError(f"timestamp {x!r} is out of range"[:80])
    return float(x)


# -- the per-rank sidecar -----------------------------------------------------------------
@dataclass(frozen=True)
class Sidecar:
    """``rank_<r>/snapshot.json``: how to rebuild the exact state from the DCP tensors."""

    rank: int
    meta: SnapshotMeta
    keys: dict[str, list[str]]  # segment -> DCP key of each of its tensors, in layout order

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "step": self.meta.step,
            "meta": json.loads(self.meta.to_bytes()),
            "keys": self.keys,
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @staticmethod
    def from_bytes(raw: bytes, what: str) -> Sidecar:
        doc = loads(raw, what)
        check_format(doc, what)
        try:
            meta = SnapshotMeta.from_bytes(json.dumps(doc["meta"]).encode("utf-8"))
            keys = doc["keys"]
            rank = _int(doc["rank"])
        except (KeyError, TypeError, SnapshotError) as exc:
            raise CorruptCheckpoint(f"{what} is malformed: {exc}"[:300]) from None
        for seg in meta.layout.segments:
            k = keys.get(seg.name) if isinstance(keys, dict) else None
            if (
                not isinstance(k, list)
                or len(k) != len(seg.tensors)
                or not all(isinstance(x, str) for x in k)
            ):
                raise CorruptCheckpoint(f"{what}: tensor keys of segment {seg.name!r} malformed")
        return Sidecar(rank, meta, {s.name: list(keys[s.name]) for s in meta.layout.segments})


def tensor_keys(meta: SnapshotMeta) -> dict[str, list[str]]:
    """DCP keys for every tensor, named as DCP flattens ``{entry: entry.state_dict()}``.

    Paths join dict keys (``str(key)``) and list/tuple indices with ``.``, so the model
    entry's ``fc.weight`` becomes ``model.fc.weight`` and Adam's first moment of
    parameter 0 ``optim.state.0.exp_avg``. Keys are unique; in the rare case two paths
    flatten to the same string the later one gets a ``#<index>`` suffix (our own loader
    reads the key list from the sidecar, so only plain-DCP users would notice).
    """
    used: set[str] = set()
    out: dict[str, list[str]] = {}
    for seg in meta.layout.segments:
        n = len(seg.tensors)
        keys: list[str | None] = [None] * n

        def walk(node: Any, path: list[str], _keys: list[str | None] = keys, _n: int = n) -> None:
            if not isinstance(node, dict) or len(node) != 1:
                return
            (tag, val), = node.items()
            if tag in ("t", "np") and isinstance(val, int) and 0 <= val < _n:
                _keys[val] = ".".join(path)
            elif (tag == "td" and isinstance(val, list) and val  # a device tensor
                  and isinstance(val[0], int) and 0 <= val[0] < _n):
                _keys[val[0]] = ".".join(path)
            elif tag == "D" and isinstance(val, list):
                for kv in val:
                    if isinstance(kv, list) and len(kv) == 2:
                        walk(kv[1], [*path, _key_str(kv[0])])
            elif tag in ("L", "T", "set") and isinstance(val, list):
                for i, v in enumerate(val):
                    walk(v, [*path, str(i)])

        try:
            walk(codec.loads(meta.skeletons[seg.name]), [seg.name])
        except RecursionError:
            raise codec.CodecError(f"segment {seg.name!r} is nested too deeply") from None
        final = []
        for i, k in enumerate(keys):
            key = k if k is not None else f"{seg.name}.#{i}"
            if key in used:
                key = f"{key}#{i}"
            used.add(key)
            final.append(key)
        out[seg.name] = final
    return out


def _key_str(encoded: Any) -> str:
    if encoded is None or isinstance(encoded, (str, int, float, bool)):
        return str(encoded)
    try:
        return str(codec.decode(encoded, _no_tensor))
    except codec.CodecError:
        return json.dumps(encoded, separators=(",", ":"))


def _no_tensor(i: int) -> torch.Tensor:
    raise codec.CodecError("a dict key cannot be a tensor")


# -- digests of the bytes as persisted ----------------------------------------------------
def padding_ranges(seg: SegmentLayout) -> list[tuple[int, int]]:
    """Byte ranges of a segment not covered by any tensor (alignment padding)."""
    out, cursor = [], 0
    for t in sorted(seg.tensors, key=lambda t: t.offset):
        if t.offset > cursor:
            out.append((cursor, t.offset))
        cursor = max(cursor, t.offset + t.nbytes)
    if seg.nbytes > cursor:
        out.append((cursor, seg.nbytes))
    return out


def persisted_digest(seg_bytes: torch.Tensor, seg: SegmentLayout, skeleton: bytes) -> str:
    """:func:`segment_digest` of the segment as a loader rebuilds it: padding zeroed.

    DCP stores tensors, not padding; a fresh load buffer is zeroed. Snapshot buffers are
    zeroed once too, so this normally equals the recorded digest and costs nothing but
    a scan of the (small) padding ranges.
    """
    hasher = checksum.Hasher()
    cursor = 0
    for lo, hi in padding_ranges(seg):
        hasher.update(seg_bytes[cursor:lo])
        hasher.update(bytes(hi - lo))
        cursor = hi
    hasher.update(seg_bytes[cursor : seg.nbytes])
    hasher.update(segment_trailer(seg, skeleton))
    return hasher.hexdigest()


def padding_is_zero(seg_bytes: torch.Tensor, seg: SegmentLayout) -> bool:
    return not any(bool(seg_bytes[lo:hi].any()) for lo, hi in padding_ranges(seg) if hi > lo)


def persisted_digests(buffer: torch.Tensor, meta: SnapshotMeta) -> dict[str, str]:
    out = {}
    for seg in meta.layout.segments:
        seg_bytes = buffer[seg.offset : seg.offset + seg.nbytes]
        if padding_is_zero(seg_bytes, seg):
            out[seg.name] = meta.digests[seg.name]
        else:
            out[seg.name] = persisted_digest(seg_bytes, seg, meta.skeletons[seg.name])
    return out


def with_digests(meta: SnapshotMeta, digests: dict[str, str]) -> SnapshotMeta:
    return SnapshotMeta(meta.step, meta.layout, dict(meta.skeletons), dict(digests))


# -- DCP metadata, read without arbitrary unpickling --------------------------------------
_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata records, sizes, dtypes and layouts; refuses anything else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _DCP_META:
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and (
                hasattr(obj, "__dataclass_fields__") or issubclass(obj, Enum)
            ):
                return obj
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}: not allowed")


def load_dcp_metadata(raw: bytes, what: str = "DCP metadata") -> Any:
    """Parse DCP's pickled ``.metadata`` with an allow-list (no arbitrary objects).

    ``what`` names the file in errors (``<step dir>/rank_<r>/.metadata``).
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any malformed pickle: pickle raises many types
        raise CorruptCheckpoint(f"{what} cannot be read safely: {exc!r}"[:400]) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpoint(f"{what} is not a DCP Metadata record")
    return md
