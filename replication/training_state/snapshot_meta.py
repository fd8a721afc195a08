"""What a snapshot is, apart from its bytes: :class:`SnapshotMeta`, and its errors.

It exists on its own because the metadata travels further than the engine that makes
it: the side channel sends it to peers, the durable tier writes it as a checkpoint's
``snapshot.json`` sidecar, and a restore reads it back, none of which needs the slots
or the copy machinery. Everything read from elsewhere is checked here, so a faulty peer
or a damaged sidecar fails as a :class:`SnapshotError`, not deep inside a restore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from replication.errors import CheckpointlessError
from replication.training_state.layout import SnapshotLayout


class SnapshotError(CheckpointlessError, RuntimeError):
    """A snapshot that is missing, incomplete or fails its checksum."""


@dataclass(frozen=True)
class SnapshotMeta:
    """Everything about a snapshot except its tensor bytes; small, JSON on the wire."""

    step: int
    layout: SnapshotLayout
    skeletons: dict[str, bytes]
    digests: dict[str, str]  # per segment: segment_digest(its bytes, layout, skeleton)

    def __post_init__(self) -> None:
        # Every segment needs its skeleton to be restored and its digest to be verified.
        names = {seg.name for seg in self.layout.segments}
        if set(self.skeletons) != names or set(self.digests) != names:
            raise SnapshotError(
                f"snapshot metadata of step {self.step}: segments {sorted(names)}, "
                f"skeletons {sorted(self.skeletons)}, digests {sorted(self.digests)}"
            )

    def fingerprint(self, i: int) -> int:
        """A 63-bit id of segment ``i``'s name, layout and contents: two snapshots whose
        segments have equal fingerprints hold the same bytes there (pure data
        parallelism), so a peer that has one need not be sent the other."""
        seg = self.layout.segments[i]
        h = xxhash.xxh64()
        h.update(seg.name.encode())
        h.update(repr(seg.tensors).encode())
        h.update(self.digests[seg.name].encode())
        return h.intdigest() & ((1 << 63) - 1)

    def fingerprints(self) -> list[int]:
        """:meth:`fingerprint` of every segment, in layout order."""
        return [self.fingerprint(i) for i in range(len(self.layout.segments))]

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "layout": self.layout.to_json(),
                "skeletons": {k: v.decode("utf-8") for k, v in self.skeletons.items()},
                "digests": self.digests,
            },
            separators=(",", ":"),
        ).encode("utf-8")

    @staticmethod
    def from_bytes(raw: bytes) -> SnapshotMeta:
        """Parse :meth:`to_bytes` output; anything malformed raises :class:`SnapshotError`.

        The bytes may come from a faulty peer, so the checks stop every way they can be
        wrong here rather than as a stray error deep inside a restore.
        """
        try:
            data = json.loads(raw.decode("utf-8"))
            skeletons, digests = data["skeletons"], data["digests"]
            if not all(isinstance(v, str) for v in [*skeletons.values(), *digests.values()]):
                raise TypeError("skeletons and digests must be strings")
            return SnapshotMeta(
                step=int(data["step"]),
                layout=SnapshotLayout.from_json(data["layout"]),
                skeletons={str(k): v.encode("utf-8") for k, v in skeletons.items()},
                digests={str(k): v for k, v in digests.items()},
            )
        # ValueError covers bad UTF-8 and JSON; OverflowError: int(Infinity); RecursionError:
        # absurdly nested JSON; TypeError includes CodecError (a malformed layout).
        except (
            ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError
        ) as exc:
            raise SnapshotError(f"malformed snapshot metadata: {exc!r}"[:300]) from None
