"""Handing a lost rank's state to its replacement, from a surviving replica holder.

The provider sends a fixed-size header (metadata length, buffer length), the snapshot
metadata, then the buffer in chunks that are all posted at once, so the transfer
streams instead of blocking per tensor. The receiver checks every segment's checksum
before a byte of it reaches the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replication.snapshot import SnapshotMeta, verify_segments
from replication.transport import SideChannel

_HEADER_TAG = 1 << 29
_META_TAG = _HEADER_TAG + 1
_DATA_TAG = 1 << 24


def send_state(
    channel: SideChannel, dst: int, meta: SnapshotMeta, buffer: torch.Tensor, chunk_bytes: int
) -> int:
    """Send a verified snapshot to ``dst``; returns the bytes sent."""
    raw = meta.to_bytes()
    header = torch.tensor([len(raw), buffer.numel()], dtype=torch.int64)
    meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    works = channel.post_send(header, dst, _HEADER_TAG, 1 << 30)
    works += channel.post_send(meta_t, dst, _META_TAG, len(raw))
    works += channel.post_send(buffer, dst, _DATA_TAG, chunk_bytes)
    channel.wait(works, f"state transfer to rank {dst}")
    return buffer.numel()


def receive_state(
    channel: SideChannel, src: int, chunk_bytes: int,
    into: Callable[[SnapshotMeta], torch.Tensor] | None = None,
) -> tuple[SnapshotMeta, torch.Tensor]:
    """Receive a snapshot from ``src``. ``into(meta)``, if given, returns the buffer to
    receive into (a snapshot slot) and the caller verifies it; otherwise a new buffer
    is allocated and every segment's checksum is verified here."""
    header = torch.empty(2, dtype=torch.int64)
    channel.wait(channel.post_recv(header, src, _HEADER_TAG, 1 << 30), "state header")
    meta_len, nbytes = (int(x) for x in header.tolist())
    meta_buf = torch.empty(meta_len, dtype=torch.uint8)
    channel.wait(channel.post_recv(meta_buf, src, _META_TAG, meta_len), "state metadata")
    meta = SnapshotMeta.from_bytes(meta_buf.numpy().tobytes())
    if meta.layout.nbytes != nbytes:
        raise ValueError(f"state from rank {src}: layout says {meta.layout.nbytes} bytes, "
                         f"header says {nbytes}")
    buffer = torch.empty(nbytes, dtype=torch.uint8) if into is None else into(meta)[:nbytes]
    channel.wait(channel.post_recv(buffer, src, _DATA_TAG, chunk_bytes), "state data")
    if into is None:
        verify_segments(buffer, meta)
    return meta, buffer
