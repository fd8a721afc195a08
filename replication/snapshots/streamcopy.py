"""Copy host tensors into snapshot slots without passing the slot through the cache.

A snapshot slot is written once per snapshot and read back much later (by the
replication thread, the durable writer, or a restore). An ordinary copy of a tensor
smaller than glibc's non-temporal threshold (a fraction of the last-level cache; most
per-tensor copies are under it) reads every destination line before writing it and
leaves the slot in cache, evicting the training step's own working set. The C kernel in
``_streamcopy.c`` writes with streaming stores instead. Measured in
``benchmarks/bench_snapshot.py``: the snapshot then costs the training loop less than a
plain in-loop copy of the same tensors does (see BENCHMARKS.md and ADR 0012).

The kernel is built by ``pip install`` where a C compiler is present (an optional
extension); without it, or on other architectures, or with ``enabled=False``, copies go
through torch as before. :data:`AVAILABLE` says which one this process uses.
"""

from __future__ import annotations

import torch

try:  # built by setuptools as an optional extension; absent where no compiler was found
    from replication.snapshots import _streamcopy
except ImportError:  # pragma: no cover - depends on the build host
    _streamcopy = None  # type: ignore[assignment]

AVAILABLE: bool = _streamcopy is not None and bool(_streamcopy.NONTEMPORAL)
"""Whether streaming stores are in use in this process (the extension is built, x86-64)."""

MIN_BYTES = 256 << 10
"""Tensors smaller than this are copied by torch: per-call overhead would dominate, and
they are few bytes of the whole state."""


def usable(t: torch.Tensor) -> bool:
    """Whether ``t`` may be a source or destination of :func:`copy_bytes`."""
    return t.device.type == "cpu" and t.is_contiguous()


def copy_bytes(dst_address: int, src_address: int, nbytes: int) -> None:
    """Copy ``nbytes`` between raw host addresses with streaming stores (GIL released).

    Addresses come from :meth:`torch.Tensor.data_ptr` of contiguous CPU tensors that the
    caller keeps alive; overlapping ranges are refused. Only valid when :data:`AVAILABLE`.
    """
    if _streamcopy is None:
        raise RuntimeError("the streaming-copy extension (replication.snapshots._streamcopy) "
                           "is not built")
    _streamcopy.copy(dst_address, src_address, nbytes)


def copy_tensors(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, enabled: bool = True
) -> None:
    """``dst.copy_(src)`` for each pair; large contiguous host pairs use streaming stores.

    Each destination must have the source's dtype and shape, as snapshot views do.
    """
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_tensors: {len(dsts)} destinations for {len(srcs)} sources")
    rest_d: list[torch.Tensor] = []
    rest_s: list[torch.Tensor] = []
    for dst, src in zip(dsts, srcs):
        nbytes = src.numel() * src.element_size()
        if (enabled and AVAILABLE and nbytes >= MIN_BYTES and dst.dtype == src.dtype
                and dst.shape == src.shape and usable(dst) and usable(src)):
            copy_bytes(dst.data_ptr(), src.data_ptr(), nbytes)
        else:
            rest_d.append(dst)
            rest_s.append(src)
    if rest_d:  # _foreach_copy_ refuses empty lists
        torch._foreach_copy_(rest_d, rest_s)
