"""Typed configuration sections owned by the replication layer.

The recipe loader in ``recovery.recipe`` composes these sections into the full
``checkpointless:`` block and validates user input against them. They live here,
not in the launcher, so that the lowest layer never imports a higher one.

Field metadata conventions (read by the validator):
``help`` (one line shown by ``config show --help``), ``choices`` (allowed values),
``min`` / ``max`` (inclusive numeric bounds), ``nullable`` (``None`` allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReplicationConfig:
    """In-memory snapshots and their peer replicas."""

    factor: int = field(
        default=2,
        metadata={"help": "copies of each rank's state, its own included", "min": 1, "max": 8},
    )
    every_n_steps: int = field(  # or the word "auto" (the recipe's "words")
        default="auto",  # ADR 0032: every step cost CPU-bound jobs +29 % to +58 %
        metadata={
            "help": "snapshot (and replicate) every N steps; 'auto' (the default) measures "
            "the costs in the first steps and picks N within max_overhead (Young/Daly with "
            "recovery.mtbf_s), re-choosing when they change (ADR 0025, 0032)",
            "min": 1,
            "words": ["auto"],
        },
    )
    max_overhead: float = field(
        default=0.02,
        metadata={
            "help": "with every_n_steps: auto, the fraction of step time snapshots may add "
                    "while failures are rare (when the budget's interval would lose more "
                    "than this to replays, Daly's optimum is taken instead: ADR 0032)",
            "min": 0.0001,
            "max": 1.0,
        },
    )
    commit: str = field(
        default="tree",
        metadata={
            "help": "how ranks agree a step is committed: 'tree' (acknowledgements up and "
            "down a tree of ranks over the side channel, one store write per step: "
            "ADR 0022) or 'store' (every rank counts itself in the job store: O(world) "
            "store operations per step, the first version's protocol)",
            "choices": ["tree", "store"],
        },
    )
    placement: str = field(
        default="ring",
        metadata={
            "help": "where replicas go: 'ring' (next nodes) or 'spread' (strided nodes)",
            "choices": ["ring", "spread"],
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "where a rank's own rollback copy lives: 'auto' (in spare memory of the "
                    "GPU that holds the state when every slot fits, measured after the first "
                    "step's peak; else host memory, with a log line saying why), 'host' (host "
                    "memory, pinned when CUDA is present; GPU tensors are copied there on a side "
                    "stream) or 'cuda' (the GPU, or an error when it cannot be). 'cpu' is the "
                    "older name of 'host'. Replicas held for peers that mostly arrive (not "
                    "shared with this rank's own state) use the same GPU when what the own "
                    "slots leave of that budget holds both of their slots; else host memory",
            "choices": ["auto", "host", "cuda", "cpu"],
        },
    )
    device_headroom: float = field(
        default=0.1,
        metadata={
            "help": "with the device tier, the fraction of the GPU's total memory left free "
                    "after the snapshot slots (for allocator fragmentation and later peaks)",
            "min": 0.0,
            "max": 0.9,
        },
    )
    checksum: str = field(
        default="inline",
        metadata={
            "help": "when host snapshots are checksummed: 'inline' (each source chunk "
            "hashed as it is copied: least work) or 'background' (after the copy, on the "
            "round thread: shortest stall, one more pass over the buffer)",
            "choices": ["inline", "background"],
        },
    )
    streaming_copy: bool = field(
        default=True,
        metadata={
            "help": "copy large host tensors into snapshot slots with streaming "
            "(non-temporal) stores, where the C kernel is built; false copies with torch",
        },
    )
    overlap_copy: bool = field(
        default=True,
        metadata={
            "help": "copy the tensors only optimizer.step() changes (weights, optimizer "
            "state) on the replication thread during the next forward and backward pass; "
            "a pre-hook on optimizer.step() waits for the copy. false copies them in the loop",
        },
    )
    overlap_min_bytes: int = field(
        default=64 << 10,
        metadata={
            "help": "with overlap_copy, optimizer-owned tensors smaller than this are "
            "copied in the loop all the same (per-tensor cost outweighs their bytes)",
            "min": 0,
        },
    )
    same_host_handover: bool = field(
        default=True,
        metadata={
            "help": "keep snapshot slots in shared memory, so a replacement on the same "
            "host as the rank that gives it the live state reads it there instead of "
            "over the network (ADR 0040); false sends every byte",
        },
    )
    dedupe: bool = field(
        default=True,
        metadata={"help": "skip sending state segments the holder already has (pure DP)"},
    )
    chunk_bytes: int = field(
        default=8 << 20,
        metadata={"help": "transfer chunk size for the pipelined peer copy", "min": 4096},
    )
    timeout_s: float = field(
        default=120.0,
        metadata={"help": "timeout of one replication round on the side group", "min": 1.0},
    )


@dataclass
class PersistenceConfig:
    """The durable tier (fsspec). Disabled when ``path`` is empty."""

    path: str = field(
        default="", metadata={"help": "fsspec URL of durable checkpoints ('' disables)"}
    )
    every_n_steps: int = field(  # or the word "auto" (the recipe's "words")
        default=0,
        metadata={
            "help": "persist every N committed steps (0: off); 'auto' measures what a save "
            "adds to the steps it overlaps and how long it lasts, and picks N within "
            "max_overhead (Young/Daly with mtbf_s), a multiple of replication.every_n_steps "
            "(ADR 0027)",
            "min": 0,
            "words": ["auto"],
        },
    )
    max_overhead: float = field(
        default=0.01,
        metadata={
            "help": "with every_n_steps: auto, the fraction of step time durable saves may add",
            "min": 0.0001,
            "max": 1.0,
        },
    )
    mtbf_s: float | None = field(
        default=None,
        metadata={
            "help": "with every_n_steps: auto, the mean time between losses that memory "
            "cannot recover (every copy of some state gone, or the job stopped), if known: "
            "the interval is Daly's optimum for it when longer than the budget's shortest "
            "(unset: recovery.mtbf_s, a lower bound of it, if that is set)",
            "min": 1.0,
        },
    )
    interval_s: float = field(
        default=0.0, metadata={"help": "persist at most every S seconds (0: off)", "min": 0.0}
    )
    keep_last: int = field(
        default=3, metadata={"help": "durable checkpoints kept by retention", "min": 1}
    )
    storage_options: dict = field(
        default_factory=dict, metadata={"help": "options passed to fsspec.filesystem()"}
    )
    resume: str = field(
        default="auto",
        metadata={
            "help": "at job start: 'auto' resumes from the newest valid checkpoint under "
            "path (if any), 'never' starts fresh",
            "choices": ["auto", "never"],
        },
    )


@dataclass
class MemoryConfig:
    """Host memory budget for snapshots, replicas and staging buffers."""

    host_budget_bytes: int = field(
        default=0,
        metadata={
            "help": "bytes this rank may use for snapshot buffers (0: a share of available RAM)",
            "min": 0,
        },
    )
    available_fraction: float = field(
        default=0.8,
        metadata={
            "help": "share of psutil's available RAM, split across local ranks, when no budget",
            "min": 0.01,
            "max": 1.0,
        },
    )
