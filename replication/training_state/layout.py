"""Where each tensor of a training state lives inside a flat snapshot buffer.

A snapshot is one contiguous byte buffer divided into *segments*, one per registered
state entry (model, optimizer, rng, ...). Each segment holds its tensors at aligned
offsets. The layout depends only on tensor dtypes and shapes, so it is computed once
and the buffer reused every step; the per-step skeleton (numbers such as the learning
rate or a step counter) travels beside it as tagged JSON. Per-segment boundaries let
replication skip segments a peer already holds (pure data parallelism) and let
checksums pinpoint which entry is corrupted.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from replication.training_state import codec
from replication.training_state.state import local_tensor

TENSOR_ALIGN = 64  # bytes; enough for any dtype view and for vectorised copies
SEGMENT_ALIGN = 4096  # segments start on page boundaries so they can move alone


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's dtype, shape and byte range within its segment."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SegmentLayout:
    """One state entry's tensors, at ``offset`` within the snapshot buffer."""

    name: str
    offset: int
    nbytes: int
    tensors: tuple[TensorSpec, ...]

    @functools.cached_property
    def spec_bytes(self) -> bytes:
        """Canonical bytes of where and what this segment's tensors are (no newline).

        Covered by the segment's checksum: a damaged shape or offset would otherwise
        pass and restore the right bytes as the wrong tensors. Cached, since a slot
        keeps its layout across steps.
        """
        specs = [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]
        return json.dumps([self.nbytes, specs], separators=(",", ":")).encode("ascii")


@dataclass(frozen=True)
class SnapshotLayout:
    """The byte layout of a whole snapshot; equal layouts share buffers."""

    segments: tuple[SegmentLayout, ...]
    nbytes: int

    def segment(self, name: str) -> SegmentLayout:
        for seg in self.segments:
            if seg.name == name:
                return seg
        raise KeyError(f"snapshot has no segment {name!r}")

    def to_json(self) -> Any:
        return {
            "nbytes": self.nbytes,
            "segments": [
                {
                    "name": s.name,
                    "offset": s.offset,
                    "nbytes": s.nbytes,
                    "tensors": [[t.dtype, list(t.shape), t.offset, t.nbytes] for t in s.tensors],
                }
                for s in self.segments
            ],
        }

    @staticmethod
    def from_json(data: Any) -> SnapshotLayout:
        try:
            segments = tuple(
                SegmentLayout(
                    name=str(s["name"]),
                    offset=int(s["offset"]),
                    nbytes=int(s["nbytes"]),
                    tensors=tuple(
                        TensorSpec(str(d), tuple(int(x) for x in shp), int(o), int(n))
                        for d, shp, o, n in s["tensors"]
                    ),
                )
                for s in data["segments"]
            )
            layout = SnapshotLayout(segments=segments, nbytes=int(data["nbytes"]))
        # OverflowError: int(Infinity); RecursionError: absurdly nested JSON.
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise codec.CodecError(f"malformed snapshot layout: {exc!r}"[:200]) from None
        layout.validate()
        return layout

    def validate(self) -> None:
        """Refuse layouts whose ranges overlap or overflow (e.g. from a bad peer).

        Negative offsets, sizes or dims must be refused too: a negative slice bound
        wraps around, and the restore would fail far from the cause (or read the wrong
        bytes). Dims must also fit torch's int64 sizes, and offsets keep the alignment
        :func:`flatten` gives them (a misaligned offset cannot be viewed as its dtype).
        """
        end = 0
        if self.nbytes < 0:
            raise codec.CodecError(f"snapshot size {self.nbytes} is negative")
        if len({seg.name for seg in self.segments}) != len(self.segments):
            raise codec.CodecError("snapshot layout names a segment twice")
        for seg in self.segments:
            if (
                seg.nbytes < 0
                or seg.offset < end
                or seg.offset % SEGMENT_ALIGN
                or seg.offset + seg.nbytes > self.nbytes
            ):
                raise codec.CodecError(f"segment {seg.name!r} lies outside the snapshot")
            end = seg.offset + seg.nbytes
            for t in seg.tensors:
                dt = codec.dtype_from_name(t.dtype)
                numel = 1
                for d in t.shape:
                    numel *= d
                if (
                    t.offset < 0
                    or t.offset % TENSOR_ALIGN
                    or t.nbytes < 0
                    or not all(0 <= d < 2**63 for d in t.shape)
                    or t.offset + t.nbytes > seg.nbytes
                    or numel * dt.itemsize != t.nbytes
                ):
                    raise codec.CodecError(f"tensor in segment {seg.name!r} is malformed")


@dataclass
class FlatState:
    """A captured state split into a layout, per-segment skeletons and source tensors."""

    layout: SnapshotLayout
    skeletons: dict[str, bytes]
    tensors: list[torch.Tensor]  # in layout order, across all segments

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


def flatten(states: dict[str, Any]) -> FlatState:
    """Split captured state dicts into a byte layout and JSON skeletons."""
    segments: list[SegmentLayout] = []
    skeletons: dict[str, bytes] = {}
    all_tensors: list[torch.Tensor] = []
    seg_offset = 0
    for name, sd in states.items():
        specs: list[TensorSpec] = []
        cursor = 0

        def on_tensor(
            t: torch.Tensor, path: str, _specs: list = specs, _name: str = name
        ) -> int:
            nonlocal cursor
            t = local_tensor(t.detach())
            if t.is_sparse or t.is_quantized:
                raise codec.CodecError(f"{_name}{path}: sparse/quantized tensors are not supported")
            nbytes = t.numel() * t.element_size()
            try:
                dtype = codec.dtype_name(t.dtype)
            except codec.CodecError as exc:
                raise codec.CodecError(f"at {path or '/'}: {exc}") from None
            _specs.append(TensorSpec(dtype, tuple(t.shape), cursor, nbytes))
            all_tensors.append(t)
            cursor = _align(cursor + nbytes, TENSOR_ALIGN)
            return len(_specs) - 1

        try:
            skeletons[name] = codec.dumps(codec.encode(sd, on_tensor))
        except codec.CodecError as exc:
            raise codec.CodecError(f"in state entry {name!r}: {exc}") from None
        nbytes = _align(cursor, SEGMENT_ALIGN)
        segments.append(SegmentLayout(name, seg_offset, nbytes, tuple(specs)))
        seg_offset += nbytes
    return FlatState(SnapshotLayout(tuple(segments), seg_offset), skeletons, all_tensors)


def tensor_views(buffer: torch.Tensor, layout: SnapshotLayout) -> list[torch.Tensor]:
    """Typed views into ``buffer`` for every tensor of ``layout``, in layout order."""
    views: list[torch.Tensor] = []
    for seg in layout.segments:
        views.extend(segment_views(buffer[seg.offset : seg.offset + seg.nbytes], seg))
    return views


def segment_views(seg_buffer: torch.Tensor, seg: SegmentLayout) -> list[torch.Tensor]:
    """Typed views into one segment's bytes."""
    return [
        seg_buffer[t.offset : t.offset + t.nbytes]
        .view(codec.dtype_from_name(t.dtype))
        .view(t.shape)
        for t in seg.tensors
    ]


def unflatten_segment(seg_buffer: torch.Tensor, seg: SegmentLayout, skeleton: bytes) -> Any:
    """Rebuild one entry's state dict; its tensors alias ``seg_buffer``.

    Raises :class:`codec.CodecError` for any malformed skeleton (it may come from a peer).
    """
    if seg_buffer.numel() < seg.nbytes:
        raise codec.CodecError(f"segment {seg.name!r} needs {seg.nbytes} bytes, "
                               f"got {seg_buffer.numel()}")
    views = segment_views(seg_buffer, seg)

    def tensor_at(i: int) -> torch.Tensor:
        if not 0 <= i < len(views):
            raise codec.CodecError(f"segment {seg.name!r} skeleton refers to tensor {i}")
        return views[i]

    return codec.decode(codec.loads(skeleton), tensor_at)
