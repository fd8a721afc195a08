"""A watcher's connection to a peer agent ends when the peer's process dies, and only
then (``launcher/peer_link.py``): a stopped process (SIGSTOP, what a starved agent looks
like to its watchers) keeps it open, so it never passes for a loss."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from launcher.peer_link import LinkListener, PeerLinks

PEER = """
import sys, time
from launcher.peer_link import LinkListener
listener = LinkListener("127.0.0.1")
print(listener.port, flush=True)
time.sleep(600)
"""


def _wait_closed(links: PeerLinks, node: int, within_s: float) -> float | None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if (t := links.closed_at(node)) is not None:
            return t
        time.sleep(0.01)
    return None


def test_a_killed_peer_ends_the_link_and_a_stopped_one_does_not():
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        port = int(peer.stdout.readline())
        links = PeerLinks()
        links.watch({1: f"127.0.0.1:{port}"})
        time.sleep(0.3)
        os.kill(peer.pid, signal.SIGSTOP)
        # longer than the keepalive's give-up time: the stopped peer's kernel answers
        assert _wait_closed(links, 1, 5.5) is None, "a stopped peer passed for a dead one"
        os.kill(peer.pid, signal.SIGCONT)
        killed = time.monotonic()
        peer.kill()
        ended = _wait_closed(links, 1, 5.0)
        assert ended is not None, "the killed peer's link did not end"
        assert ended - killed < 1.0, ended - killed
    finally:
        peer.kill()
        peer.wait()


def test_nothing_listening_is_a_dead_peer_and_unwatched_nodes_are_forgotten():
    listener = LinkListener("127.0.0.1")
    port = listener.port
    links = PeerLinks()
    links.watch({1: f"127.0.0.1:{port}", 2: "127.0.0.1:1"})  # port 1: refused
    assert _wait_closed(links, 2, 2.0) is not None
    assert _wait_closed(links, 1, 0.5) is None
    links.watch({1: f"127.0.0.1:{port}"})  # 2 leaves the watch: its record goes
    assert links.closed_at(2) is None


def test_a_link_that_ended_while_its_peer_lives_is_opened_again():
    """A connection pushed out (a stranger opening many) ends, but its peer lives:
    ``reconnect`` forgets the end and the next watch holds a new connection."""
    listener = LinkListener("127.0.0.1")
    links = PeerLinks()
    address = {1: f"127.0.0.1:{listener.port}"}
    links.watch(address)
    time.sleep(0.2)
    for conn in list(listener._held):
        conn.close()
    assert _wait_closed(links, 1, 2.0) is not None
    links.reconnect(1)
    links.watch(address)
    time.sleep(0.3)
    assert links.closed_at(1) is None and len(listener._held) >= 1
