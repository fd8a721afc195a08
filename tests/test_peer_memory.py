"""Reading another process's shared snapshot slot in place (replication.side_channel.peer_memory):
real processes, real memfds. What must never happen is a mapping of the wrong memory:
every way an offer can fail to match answers ``None``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from replication.side_channel.peer_memory import SharedOffer, map_offer, offer
from replication.snapshots.slots import allocate_host, allocate_shared

_READER = """
import sys, torch
from replication.side_channel.peer_memory import SharedOffer, map_offer
got = map_offer(SharedOffer.from_tensor(torch.tensor([int(x) for x in sys.argv[1:]])))
print("none" if got is None else f"{got.numel()} {int(got.sum())} {got[:3].tolist()}")
"""


def _read_in_another_process(o: SharedOffer) -> str:
    out = subprocess.run([sys.executable, "-c", _READER, *map(str, o.to_tensor().tolist())],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_another_process_on_this_host_reads_the_offered_bytes_where_they_lie():
    buf = allocate_shared(1 << 20)
    assert buf is not None
    buf[4096 : 4096 + 100] = 7
    o = offer(buf[4000 : 4000 + 8192])  # a slice: the offset is kept
    assert o is not None and o.offset == 4000 and o.nbytes == 8192
    assert _read_in_another_process(o) == "8192 700 [0, 0, 0]"


def test_an_offer_that_does_not_match_the_memory_is_refused():
    buf = allocate_shared(1 << 16)
    o = offer(buf)
    assert o is not None
    for wrong in (dataclasses.replace(o, ino=o.ino + 1),      # another file at that fd
                  dataclasses.replace(o, boot=o.boot ^ 1),    # another host's boot
                  dataclasses.replace(o, nbytes=o.nbytes + 1),  # past its end
                  dataclasses.replace(o, fd=999)):            # no such descriptor
        assert _read_in_another_process(wrong) == "none", wrong


def test_private_memory_is_never_offered_and_no_offer_is_the_empty_message():
    assert offer(allocate_host(4096, pin=False)) is None
    assert offer(torch.zeros(10)) is None
    assert SharedOffer.from_tensor(SharedOffer.empty()) is None


def test_the_reader_gets_a_read_only_view_in_its_own_process():
    buf = allocate_shared(4096)
    o = offer(buf)
    assert o is not None
    view = map_offer(o)  # this process may map its own offer too
    assert view is not None and view.numel() == 4096
    buf[0] = 5
    assert int(view[0]) == 5  # the same pages, not a copy
