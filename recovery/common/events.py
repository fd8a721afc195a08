"""Every event name a run writes to its ``events.jsonl``, registered in one place.

Agents, workers, the durable helper and the chaos harness write events; the run
report, the chaos metrics, the benchmarks and the tests read them. Before this
registry each side spelled the names on its own, so a renamed event silently emptied
a report column. :meth:`recovery.generation.protocol.EventLog.emit` refuses a name that is not
registered here, and every reader compares against these members (a ``StrEnum``:
each member *is* its string, so the file format is unchanged and old runs still read).
"""

from __future__ import annotations

from enum import StrEnum


class Event(StrEnum):
    """An event of a run. Grouped by who writes it."""

    # -- the agent (launcher/agent.py and friends) --------------------------------------
    AGENT_START = "agent_start"
    AGENT_STALLED = "agent_stalled"
    AGENT_EXIT = "agent_exit"
    AUTH_REJECTED = "auth_rejected"  # a store value not sealed with the job key
    WORKER_START = "worker_start"
    WORKER_READY = "worker_ready"
    WORKER_EXIT = "worker_exit"
    WORKER_HUNG = "worker_hung"
    WORKER_LATE = "worker_late"  # heartbeat silent past the timeout, the kernel shows it at work
    WORKER_DONE = "worker_done"
    STRAGGLER = "straggler"  # a rank slower than the job's median for a whole window
    HEALTH_CHECK_FAILED = "health_check_failed"  # recovery.health_check fenced this node
    FAILURE_DECLARED = "failure_declared"
    REPLACEMENT_ASSIGNED = "replacement_assigned"
    NODE_LOST = "node_lost"
    NODE_RETURNED = "node_returned"
    NODE_TAKEOVER = "node_takeover"
    NODE_FENCED = "node_fenced"
    WORLD_SHRUNK = "world_shrunk"  # no spare node: the job trains on without a lost node
    WORLD_GROWN = "world_grown"  # a node took retired ranks back: the job grows
    WORLD_RESIZED = "world_resized"  # a worker left its world to run again in a new one
    NODE_ISOLATED = "node_isolated"  # this agent cannot reach the job store: fenced
    STORAGE_CHECK_FAILED = "storage_check_failed"  # a joining agent's probe, job running
    SPARE_START = "spare_start"
    SPARE_EXIT = "spare_exit"
    SPARE_FORK_FAILED = "spare_fork_failed"
    SPARE_POOL_SHRUNK = "spare_pool_shrunk"
    ZYGOTE_START = "zygote_start"
    ZYGOTE_READY = "zygote_ready"
    ZYGOTE_FAILED = "zygote_failed"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"

    # -- a worker (recovery/runtime/checkpointless.py) ---------------------------------------------
    START = "start"
    STEP = "step"
    AUTO_INTERVAL = "auto_interval"  # every_n_steps: auto chose an interval (tier, why)
    FAILURE_DETECTED = "failure_detected"
    RECOVERY = "recovery"
    RECOVERY_INTERRUPTED = "recovery_interrupted"
    RESUMED = "resumed"
    DURABLE_FALLBACK = "durable_fallback"
    DURABLE_RESUME = "durable_resume"
    DURABLE_SAVE = "durable_save"  # a committed step handed to the durable writer
    FENCED = "fenced"
    DRAINED = "drained"  # stopped for the scheduler: the committed step persisted (drain)
    FATAL = "fatal"
    FAULT_INJECTED = "fault_injected"
    REPLICAS_DIFFER = "replicas_differ"
    REPLICAS_DRIFTED = "replicas_drifted"
    REPLAY_DIVERGED = "replay_diverged"

    # -- the durable tier -----------------------------------------------------------------
    SAVED = "saved"
    #: a framework's own checkpoint (DeepSpeed's save_checkpoint) written by a rank, and
    #: on rank 0 committed (replication.durable.tagged)
    TAGGED_CHECKPOINT = "tagged_checkpoint"
    SAVE_FAILED = "save_failed"

    # -- the chaos harness and the benchmarks' workloads ------------------------------------
    KILL = "kill"
    STORAGE_OUTAGE_START = "storage_outage_start"
    STORAGE_OUTAGE_END = "storage_outage_end"


def registered(name: str) -> Event:
    """``name`` as an :class:`Event`; ``ValueError`` naming it if it is not registered."""
    try:
        return Event(name)
    except ValueError:
        raise ValueError(f"event {name!r} is not registered in "
                         "recovery.common.events.Event") from None
