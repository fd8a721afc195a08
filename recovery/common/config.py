"""Typed configuration of the worker-side recovery (the recipe's ``recovery`` section).

See ``replication.config`` for the field-metadata conventions the validator reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RecoveryConfig:
    """How failures are detected and how many in-process recoveries are allowed."""

    enabled: bool = field(default=True, metadata={"help": "recover in-process on failure"})
    max_restarts: int = field(
        default=10, metadata={"help": "failures recovered in-process before giving up", "min": 0}
    )
    heartbeat_interval_s: float = field(
        default=1.0, metadata={"help": "worker heartbeat period", "min": 0.05}
    )
    heartbeat_timeout_s: float = field(
        default=15.0,  # torchrun's keep-alive expiry (5 s x 3 attempts): ADR 0026
        metadata={"help": "a worker silent this long is declared hung and killed if the "
                          "kernel shows it stopped or blocked (one still at work gets four "
                          "times this); a node (its agent) silent this long is declared "
                          "lost", "min": 0.5},
    )
    mtbf_s: float | None = field(
        default=None,
        metadata={
            "help": "the job's mean time between failures, if known: with "
            "replication.every_n_steps: auto, the interval is Daly's optimum for it when "
            "that is longer than the overhead budget's shortest (persistence.every_n_steps: "
            "auto takes it as a lower bound of persistence.mtbf_s when that is unset)",
            "min": 1.0,
        },
    )
    live_rollback: bool = field(
        default=True,
        metadata={
            "help": "a data-parallel job whose model and optimizer were left untouched by "
                    "the failure goes on from the step it was in, replaying nothing: each "
                    "rank sends its small per-step state (RNG, data position, scheduler) "
                    "to its replica holders every step, and a replacement takes the model "
                    "and optimizer from a survivor (ADR 0039). Otherwise, and for jobs "
                    "that are not purely data-parallel, recoveries go back to the last "
                    "committed snapshot and replay",
        },
    )
    collective_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "timeout of training collectives before a failure is assumed",
            "min": 1.0,
        },
    )
    abort_backend: str = field(
        default="auto",
        metadata={
            "help": "no effect, accepted so that old recipes still load: each inner "
                    "backend is aborted its own way (gloo: sockets shut down, nccl: "
                    "communicator abort), see ADR 0015 and ADR 0038",
            "choices": ["auto", "gloo", "nccl"],
        },
    )
    ordered_allreduce: bool = field(
        default=False,
        metadata={"help": "opt-in: sum float all-reduces of 3+ ranks in rank order (an "
                          "all-to-all, an add in rank order, an all-gather: a ring's "
                          "traffic) so results never depend on how a buffer is laid out; "
                          "not needed for DDP, whose bucket layout is kept across "
                          "recoveries (ADR 0034). CPU tensors only"},
    )
    nccl_fixed_algorithm: bool = field(
        default=False,
        metadata={"help": "NCCL: set NCCL_ALGO=Ring and NCCL_PROTO=Simple (unless already "
                          "set) before the first communicator, so a recovered step cannot "
                          "be reduced by another algorithm than the failure-free run's on "
                          "nodes that tune differently. Untested: needs several GPUs"},
    )
    on_no_spare: str = field(
        default="shrink",
        metadata={"help": "a lost node's ranks that no spare node takes over within "
                          "spare_wait_s: 'shrink' and train on without them, the global "
                          "batch and sample order kept, growing back when a node joins "
                          "(data-parallel jobs with a DataLoader over a DistributedSampler; "
                          "others stop), or 'stop' the job (exit 75: a scheduler may "
                          "requeue it). ADR 0035",
                  "choices": ["stop", "shrink"]},
    )
    spare_wait_s: float = field(
        default=5.0,
        metadata={"help": "with on_no_spare: shrink and a spare node in the job, how long "
                          "a lost node's ranks wait for it to take them over before the job "
                          "shrinks (with no spare node, it shrinks at once)", "min": 0.0},
    )
    store_outage_s: float = field(
        default=15.0,
        metadata={"help": "etcd job store: how long every member may be unreachable or "
                          "without quorum before a store operation fails (training "
                          "stalls meanwhile, then goes on; past it the job stops)",
                  "min": 1.0},
    )
    metrics_port: int = field(
        default=0,
        metadata={"help": "serve Prometheus metrics from each agent on this port (0: off; "
                          "--metrics-port): goodput, generations, recoveries and their "
                          "phases, replication, the durable tier, memory and step time. "
                          "Workers report to their agent, so no worker opens a port",
                  "min": 0, "max": 65535},
    )
    stragglers: str = field(
        default="report",
        metadata={"help": "a rank whose own share of the step (the time it is not waiting "
                          "in a collective for its peers) stays over straggler_factor times "
                          "the job's median for a whole window: 'report' it (event, metric, "
                          "one console line), 'replace' it with a free warm spare as if it "
                          "had failed (reported only when no spare is free), or 'off'",
                  "choices": ["report", "replace", "off"]},
    )
    straggler_factor: float = field(
        default=2.0,
        metadata={"help": "how many times the job's median own step time a rank must take "
                          "over a whole window to be a straggler", "min": 1.1},
    )
    straggler_window_steps: int = field(
        default=50,
        metadata={"help": "the window of straggler detection, in steps (the medians are "
                          "taken over it)", "min": 5},
    )
    health_check: str = field(
        default="",
        metadata={"help": "a shell command each agent runs at start, and a spare node again "
                          "before it takes over a lost node's ranks; a non-zero exit fences "
                          "the node with the command's output in one line ('' : none). On "
                          "CUDA hosts each local device is also checked to allocate and run "
                          "a small kernel"},
    )
    durable_fallback: bool = field(
        default=True,
        metadata={"help": "restart from the newest durable checkpoint when memory copies are lost"},
    )
    events_file: str = field(
        default="", metadata={"help": "JSON-lines events file ('' : <run_dir>/events.jsonl)"}
    )
    fault: str = field(
        default="",
        metadata={"help": "fault injection 'rank:step:phase[:kind]' (tests and benchmarks)"},
    )
