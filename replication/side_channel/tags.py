"""Every message tag used on a replication side channel, allocated in one place.

A side channel carries four protocols: the per-step replication round
(:mod:`replication.replica_protocol.replicator`), its commit agreement
(:mod:`replication.replica_protocol.commit_tree`),
the per-step marks (:mod:`replication.replica_protocol.marks`) and the state handover of a recovery
(:mod:`replication.replica_protocol.handover`, :mod:`replication.replica_protocol.live_handover`).
A chunked send of
one message uses ``tag + i`` for its ``i``-th chunk
(:meth:`replication.side_channel.transport.SideChannel.post_send`), so each message owns a region
of :data:`REGION` consecutive tags. Regions are numbered here, once, so no two messages
can share a tag (the first version allocated them in two files, and segment 15's
region began exactly at the handover's data tag).
"""

from __future__ import annotations

#: Tags per message: room for this many chunks (at 1 MiB chunks, 1 TiB per message).
REGION = 1 << 20
#: The most state entries (segments) one snapshot may have.
MAX_SEGMENTS = 64

_FIRST_SEGMENT = 1  # region 0 is never used: a zero tag is easy to send by accident
_ROUND_META = _FIRST_SEGMENT + MAX_SEGMENTS
_HANDOVER_HEADER = _ROUND_META + 1
_HANDOVER_META = _HANDOVER_HEADER + 1
_HANDOVER_DATA = _HANDOVER_META + 1
_COMMIT_ACK = _HANDOVER_DATA + 1
_COMMIT_DONE = _COMMIT_ACK + 1
_MARK_DATA = _COMMIT_DONE + 1
_LIVE_MARK_HEADER = _MARK_DATA + 1
_LIVE_MARK_DATA = _LIVE_MARK_HEADER + 1
_LIVE_OFFER = _LIVE_MARK_DATA + 1
_LIVE_REPLY = _LIVE_OFFER + 1
_END = _LIVE_REPLY + 1

#: A replication round: the snapshot metadata a rank sends each holder.
ROUND_META = _ROUND_META * REGION
#: A handover: the fixed-size header (metadata length, buffer length).
HANDOVER_HEADER = _HANDOVER_HEADER * REGION
#: A handover: the snapshot metadata.
HANDOVER_META = _HANDOVER_META * REGION
#: A handover: the whole snapshot buffer.
HANDOVER_DATA = _HANDOVER_DATA * REGION
#: The commit agreement (:mod:`replication.replica_protocol.commit_tree`): a child's
#: acknowledgement.
COMMIT_ACK = _COMMIT_ACK * REGION
#: The commit agreement: the root's "committed" passed down the tree.
COMMIT_DONE = _COMMIT_DONE * REGION

#: A step's mark (:mod:`replication.replica_protocol.marks`), one message a rank sends each of its
#: holders every step.
MARK_DATA = _MARK_DATA * REGION
#: A live rollback's handover (:mod:`replication.replica_protocol.live_handover`): the
#: replacement's own
#: mark, from its holder (header, then bytes).
LIVE_MARK_HEADER = _LIVE_MARK_HEADER * REGION
LIVE_MARK_DATA = _LIVE_MARK_DATA * REGION
#: A live rollback's handover: where the provider's snapshot of the live step lies in
#: shared memory (:class:`replication.snapshots.slots.SharedOffer`), and the replacement's answer
#: (whether it reads it there, or wants it over the channel).
LIVE_OFFER = _LIVE_OFFER * REGION
LIVE_REPLY = _LIVE_REPLY * REGION

# gloo tags are C ints.
assert _END * REGION < 1 << 31


def segment(i: int) -> int:
    """The tag of segment ``i`` of a replication round."""
    if not 0 <= i < MAX_SEGMENTS:
        raise ValueError(f"segment index {i} outside 0..{MAX_SEGMENTS - 1}")
    return (_FIRST_SEGMENT + i) * REGION
