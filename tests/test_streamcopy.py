"""The streaming-store copy kernel (replication/snapshots/_streamcopy.c) and its torch fallback."""

from __future__ import annotations

import os
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replication.snapshots import streamcopy

needs_kernel = pytest.mark.skipif(
    not streamcopy.AVAILABLE, reason=
    "replication.snapshots._streamcopy not built (no compiler or not x86-64)"
)


def test_kernel_is_built_where_ci_requires_it():
    """CI sets TESTS_REQUIRE_STREAMCOPY=1: there the install must have compiled the
    kernel, or every snapshot benchmark would silently measure the torch fallback."""
    if os.environ.get("TESTS_REQUIRE_STREAMCOPY") != "1":
        pytest.skip("TESTS_REQUIRE_STREAMCOPY is not set")
    assert platform.machine() in ("x86_64", "AMD64")
    assert streamcopy.AVAILABLE, ("replication.snapshots._streamcopy did not build: "
                                  "is gcc installed?")


@needs_kernel
@settings(max_examples=200, deadline=None)
@given(
    nbytes=st.integers(0, 5000),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    seed=st.integers(0, 2**31 - 1),
)
def test_copy_bytes_is_exact_at_any_size_and_alignment(
    nbytes: int, src_off: int, dst_off: int, seed: int
):
    """Unaligned heads, whole 64-byte lines and ragged tails all land exactly, and
    nothing outside the destination range changes."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (nbytes + 128,), dtype=torch.uint8, generator=gen)
    before = dst.clone()
    streamcopy.copy_bytes(dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes)
    assert torch.equal(dst[dst_off : dst_off + nbytes], src[src_off : src_off + nbytes])
    assert torch.equal(dst[:dst_off], before[:dst_off])
    assert torch.equal(dst[dst_off + nbytes :], before[dst_off + nbytes :])


@needs_kernel
def test_large_copy_is_exact():
    src = torch.empty(9 << 20, dtype=torch.uint8).random_()
    dst = torch.zeros_like(src)
    streamcopy.copy_bytes(dst.data_ptr(), src.data_ptr() + 1, src.numel() - 1)
    assert torch.equal(dst[:-1], src[1:])


@needs_kernel
def test_overlapping_ranges_and_negative_sizes_are_refused():
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        streamcopy.copy_bytes(buf.data_ptr() + 100, buf.data_ptr(), 200)
    with pytest.raises(ValueError, match="negative"):
        streamcopy.copy_bytes(buf.data_ptr() + 2048, buf.data_ptr(), -1)


@pytest.mark.parametrize("enabled", [True, False], ids=["streaming", "torch-copy"])
def test_copy_tensors_copies_every_kind_of_pair(enabled: bool):
    """Large contiguous pairs take the kernel (when enabled and built); small,
    strided and odd-dtype pairs go through torch. All must end equal."""
    gen = torch.Generator().manual_seed(3)
    srcs = [
        torch.randn(1 << 18, generator=gen),  # 1 MiB
        torch.randn(5, generator=gen),
        torch.randn(700, 800, generator=gen).t(),  # large but strided
        torch.randint(0, 2, (600_000,), generator=gen).bool(),
        torch.randn(300, 1000, generator=gen).to(torch.bfloat16),
        torch.empty(0),
    ]
    dsts = [torch.empty(s.shape, dtype=s.dtype) for s in srcs]
    streamcopy.copy_tensors(dsts, srcs, enabled=enabled)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)


def test_copy_tensors_refuses_mismatched_lists():
    with pytest.raises(ValueError, match="2 destinations for 1 sources"):
        streamcopy.copy_tensors([torch.empty(1), torch.empty(1)], [torch.empty(1)])
