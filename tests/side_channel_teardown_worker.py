"""The survivor's side of ``tests/test_side_channel_teardown.py`` (run as a script).

This process is rank 0 of a replication side channel, made again for every trial, whose
rank 1 is a fresh process forked from a warm forkserver. A thread of this process runs
replication-like rounds on the channel (the announce all-gather, then a send and a
receive, as the replicator's round thread does), and the trial's fault lands at a random
moment in them: the peer SIGKILLed, SIGSTOPped (silent, its sockets open), or still
alive when the channel is aborted first. The main thread then aborts the channel as a
recovery's teardown does. What is timed: from the abort to the round thread's release,
and the longest any Python thread of this process could not run (a ticker thread's
longest gap between 10 ms ticks: a destructor that joins gloo's threads while holding
the GIL stops every thread, and shows up there). Last line: JSON.

``missed`` as the third argument makes the abort reach no socket (as if every one had
been missed), with a SIGSTOPped peer and a 3 s channel timeout: gloo's operation then
stays pending until that timeout, whatever the channel does.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from replication.side_channel.abortable_gloo import AbortableGloo
from replication.side_channel.transport import SideChannel, TransportError

FAULTS = ("kill", "stop", "abort_first")


def rounds(ch: SideChannel, other: int, size: int) -> None:
    """Replication-like rounds with rank ``other`` until the channel gives up."""
    buf = torch.zeros(size, dtype=torch.uint8)
    while True:
        ch.allgather(torch.zeros(8, dtype=torch.int64))
        sends = ch.post_send(buf, other, 100, 1 << 20)
        ch.wait(ch.post_recv(torch.empty_like(buf), other, 100, 1 << 20), "receive")
        ch.wait(sends, "send")


def peer(port: int, prefix: str, size: int, ready: Any, timeout_s: float) -> None:
    """Rank 1: join the channel, then run rounds until it is killed or stopped."""
    store = dist.TCPStore("127.0.0.1", port, None, False,
                          timeout=datetime.timedelta(seconds=30))
    ch = SideChannel(store, 1, 2, prefix=prefix, timeout_s=timeout_s)
    ready.set()
    try:
        rounds(ch, 0, size)
    except TransportError:  # the survivor aborted first: the trial is over for us
        time.sleep(60)


def main() -> None:
    trials, seed = int(sys.argv[1]), int(sys.argv[2])
    missed = sys.argv[3:] == ["missed"]
    timeout_s = 3.0 if missed else 120.0
    if missed:
        AbortableGloo.abort = lambda self: 0  # type: ignore[method-assign]
    rng = random.Random(seed)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "replication.side_channel.transport"])
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30))
    gaps: list[float] = []

    def ticker() -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    threading.Thread(target=ticker, daemon=True, name="ticker").start()
    out: list[dict[str, Any]] = []
    for i in range(trials):
        fault, size = rng.choice(FAULTS), rng.choice([64, 1 << 16, 8 << 20])
        if missed:
            fault = "stop"
        t_trial = time.monotonic()
        ready = ctx.Event()
        proc = ctx.Process(target=peer, args=(store.port, f"t{i}", size, ready, timeout_s),
                           daemon=True)
        proc.start()
        ch = SideChannel(store, 0, 2, prefix=f"t{i}", timeout_s=timeout_s)
        if not ready.wait(60):
            raise SystemExit(f"trial {i}: the peer never joined")
        setup_s = time.monotonic() - t_trial
        released: dict[str, Any] = {}

        def run(ch: SideChannel = ch, size: int = size, released: dict = released) -> None:
            try:
                rounds(ch, 1, size)
            except TransportError as exc:
                released.update(at=time.monotonic(), error=str(exc)[:120])

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        time.sleep(rng.uniform(0.0, 0.25))  # somewhere in a round
        if fault != "abort_first":
            os.kill(proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            time.sleep(rng.uniform(0.0, 0.03))  # the teardown comes a moment later
        gaps.clear()
        aborted = time.monotonic()
        # An abort that stands still leaves every thread's stack on stderr as evidence.
        faulthandler.dump_traceback_later(5, exit=False)
        ch.abort()
        abort_s = time.monotonic() - aborted
        faulthandler.cancel_dump_traceback_later()
        thread.join(30)
        if thread.is_alive():  # where the round still waits, for the report
            frame = sys._current_frames().get(thread.ident)
            released["stuck_in"] = traceback.format_stack(frame)[-3:] if frame else None
        time.sleep(timeout_s + 1.0 if missed else 0.3)  # the dropped group is destroyed
        longest_gap = max(gaps, default=0.0)
        proc.kill()  # the stopped or still running peer
        proc.join(10)
        out.append({"trial": i, "fault": fault, "bytes": size,
                    "released_s": round(released.get("at", float("inf")) - aborted, 4),
                    "longest_gil_gap_s": round(longest_gap, 4),
                    "error": released.get("error"), "stuck_in": released.get("stuck_in"),
                    "setup_s": round(setup_s, 3), "abort_s": round(abort_s, 3),
                    "trial_s": round(time.monotonic() - t_trial, 3)})
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"trials": out, "threads_left": threading.active_count()}), flush=True)
    # A wait that gloo never ended still sits in a waiter thread until its timeout, and
    # the interpreter's exit would wait for it: this process is done, whatever it holds.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
