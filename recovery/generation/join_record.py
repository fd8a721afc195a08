"""What a rank brings to a generation's rendezvous (part of
:mod:`recovery.generation.protocol`'s contract, kept here so that module stays one
screenful of store keys and primitives)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class JoinRecord:
    """What a rank brings to a generation's rendezvous."""

    rank: int
    node: int
    pid: int
    newcomer: bool
    local_steps: list[int] = field(default_factory=list)  # own sealed snapshots held
    replicas: dict[str, list[int]] = field(default_factory=dict)  # src rank -> steps held
    committed: int = -1  # the newest step this rank learned is committed (ADR 0022)
    # Live rollback (ADR 0039): the step whose end this survivor's live state still is
    # (-1: none), and the step of the newest mark it holds of each source rank.
    live_step: int = -1
    marks: dict[str, int] = field(default_factory=dict)
    # A sharded job's marks carry update logs (ADR 0049): per source rank, the first
    # step of the unbroken run of marks held (its last is ``marks``'s).
    sharded: bool = False
    logs: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes | str) -> JoinRecord:
        d = json.loads(raw)
        return JoinRecord(
            rank=int(d["rank"]), node=int(d["node"]), pid=int(d["pid"]),
            newcomer=bool(d["newcomer"]), local_steps=[int(s) for s in d["local_steps"]],
            replicas={str(k): [int(s) for s in v] for k, v in d["replicas"].items()},
            committed=int(d.get("committed", -1)),
            live_step=int(d.get("live_step", -1)),
            marks={str(k): int(v) for k, v in d.get("marks", {}).items()},
            sharded=bool(d.get("sharded", False)),
            logs={str(k): int(v) for k, v in d.get("logs", {}).items()},
        )
