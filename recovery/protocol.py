"""The control-plane contract between agents and workers: store keys and primitives.

Everything that agents (``launcher``) and workers (``recovery``) coordinate on lives in
the job's c10d store under ``cl/``. Keeping every key in this one module makes the
protocol reviewable in one place and keeps both sides from drifting apart.

Generations. The job starts in generation 0. Any participant that detects a failure
moves the job to the next generation with a compare-and-set from the generation it
observed, so several detectors of the same failure produce one new generation, while a
failure *during* a recovery produces another. Every process group, commit counter and
rendezvous of a generation lives under ``cl/g{G}/``, so nothing from a dead generation
can be mistaken for a live one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist

PREFIX = "cl"
GEN_KEY = f"{PREFIX}/gen"
COMMITTED_KEY = f"{PREFIX}/committed_step"
RECOVERIES_KEY = f"{PREFIX}/recoveries"
FATAL_KEY = f"{PREFIX}/fatal"
DONE_PREFIX = f"{PREFIX}/done"

# Environment the agent gives each worker, on top of torchrun's variables.
ENV_STORE = "CHECKPOINTLESS_INTERNAL_STORE"  # host:port of the job's c10d store
ENV_NODE = "CHECKPOINTLESS_INTERNAL_NODE"  # the physical node (agent) id of this worker
ENV_RUN_DIR = "CHECKPOINTLESS_INTERNAL_RUN_DIR"  # events.jsonl and logs go here
ENV_HEARTBEAT = "CHECKPOINTLESS_INTERNAL_HEARTBEAT"  # file whose mtime the agent watches
ENV_JOB_ID = "CHECKPOINTLESS_INTERNAL_JOB_ID"
ENV_CONFIG = "CHECKPOINTLESS_CONFIG_JSON"  # the resolved recipe, JSON

# Exit codes a worker uses to tell its agent why it stopped.
EXIT_FATAL = 3  # recovery impossible; the reason is under FATAL_KEY


def gen_prefix(gen: int) -> str:
    return f"{PREFIX}/g{gen}"


def join_key(gen: int, rank: int) -> str:
    return f"{gen_prefix(gen)}/join/{rank}"


def cause_key(gen: int) -> str:
    return f"{gen_prefix(gen)}/cause"


def fault_key(spec: str) -> str:
    return f"{PREFIX}/fault/{spec}"


def agent_heartbeat_key(node: int) -> str:
    return f"{PREFIX}/agent/{node}/hb"


def agent_info_key(node: int) -> str:
    return f"{PREFIX}/agent/{node}/info"



def current_generation(store: dist.Store) -> int:
    """The job's current generation (0 before any failure)."""
    if not store.check([GEN_KEY]):
        return 0
    return int(store.get(GEN_KEY).decode())


def init_generation(store: dist.Store) -> None:
    """Create the generation counter at 0 if the job has none yet (idempotent)."""
    store.compare_set(GEN_KEY, "", "0")


def declare_failure(
    store: dist.Store, observed_gen: int, cause: dict[str, Any], timeout_s: float = 30.0
) -> int:
    """Move the job past ``observed_gen``; returns the generation now current.

    The first declarer for a generation (decided by an atomic counter, since a
    compare-and-set reply cannot tell "I set it" from "someone set the same value")
    records the cause and advances the counter; later declarers of the same failure
    just wait to see the newer generation. One failure seen by many is one generation.
    """
    nxt = observed_gen + 1
    if store.add(f"{gen_prefix(nxt)}/declared", 1) == 1:
        store.set(cause_key(nxt), json.dumps(cause))
        store.add(RECOVERIES_KEY, 1)
    # Every declarer advances the counter (idempotent), so a first declarer that dies
    # between its claim and the advance cannot leave the job stuck in a dead generation.
    store.compare_set(GEN_KEY, str(observed_gen), str(nxt))
    deadline = time.monotonic() + timeout_s
    while (gen := current_generation(store)) <= observed_gen:
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation did not advance past {observed_gen}")
        time.sleep(0.005)
    return gen


def recoveries(store: dist.Store) -> int:
    return store.add(RECOVERIES_KEY, 0)


def read_json(store: dist.Store, key: str) -> Any:
    return json.loads(store.get(key).decode()) if store.check([key]) else None


def set_fatal(store: dist.Store, reason: str, **details: Any) -> None:
    """Record why the job cannot continue; agents print it and stop."""
    store.compare_set(FATAL_KEY, "", json.dumps({"reason": reason, **details}))


def fatal(store: dist.Store) -> dict[str, Any] | None:
    return read_json(store, FATAL_KEY)


@dataclass(frozen=True)
class JoinRecord:
    """What a rank brings to a generation's rendezvous."""

    rank: int
    node: int
    pid: int
    newcomer: bool
    local_steps: list[int] = field(default_factory=list)  # own sealed snapshots held
    replicas: dict[str, list[int]] = field(default_factory=dict)  # src rank -> steps held

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(raw: bytes | str) -> JoinRecord:
        d = json.loads(raw)
        return JoinRecord(
            rank=int(d["rank"]), node=int(d["node"]), pid=int(d["pid"]),
            newcomer=bool(d["newcomer"]), local_steps=[int(s) for s in d["local_steps"]],
            replicas={str(k): [int(s) for s in v] for k, v in d["replicas"].items()},
        )


class EventLog:
    """Append-only JSON-lines file shared by agents and workers of one run.

    Each event is one ``write`` of one line on an ``O_APPEND`` descriptor, which the
    kernel keeps whole even with many writers.
    """

    def __init__(self, path: str | os.PathLike[str], source: str) -> None:
        self.path = os.fspath(path)
        self.source = source
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "event": event, "source": self.source, **fields}
        line = (json.dumps(record, default=str) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, in file order; a torn last line is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


# --- Agent coordination (added with ``checkpointless run``) ----------------------------
# Keys only agents write, kept here so the whole store layout stays reviewable in one file.

#: "1" in a process started to replace a lost rank (a fresh process or a warm spare).
ENV_REPLACEMENT = "CHECKPOINTLESS_INTERNAL_REPLACEMENT"
#: Every agent that ever joined the job, as "0,1,2," (appended at registration).
AGENTS_KEY = f"{PREFIX}/agents"
#: Counter of ranks that finished with exit status 0; the job is done at WORLD_SIZE.
DONE_COUNT_KEY = f"{DONE_PREFIX}/count"


def trained_key(rank: int) -> str:
    """Set by a worker once its last step is committed: whatever it does after that
    (saving, exiting) can no longer need a recovery."""
    return f"{PREFIX}/trained/{rank}"


def done_key(rank: int) -> str:
    return f"{DONE_PREFIX}/{rank}"


def group_owner_key(group: int) -> str:
    """Node id of the agent now running node-group ``group``'s ranks (GROUP_RANK).

    A group is owned by the node of the same rank at launch; when that node is lost, a
    spare node takes the group over with a compare-and-set from the lost owner's id, so
    exactly one agent wins whatever generation each claimer happened to observe.
    """
    return f"{PREFIX}/owner/{group}"


def agent_finished_key(node: int) -> str:
    """Set by an agent that has seen the job end; the store host waits for these."""
    return f"{PREFIX}/agent/{node}/finished"


def done_count(store: dist.Store) -> int:
    return store.add(DONE_COUNT_KEY, 0)
