"""Pipeline schedules (``torch.distributed.pipelining``) brought back to their first step.

A schedule prepares its stages on its first ``step()``: a P2P warm-up, a vote on
static or dynamic shapes, and the exchange of each stage's input and output metadata
with its neighbours (``send_object_list``/``recv_object_list``). A replacement's
schedule is new, so it runs that preparation; the survivors' schedules had done it and
would send a micro-batch where the replacement waits for metadata. Gloo then sees a
message of the wrong size and aborts the replacement's process ("Received data size
doesn't match expected size"), every time it is replaced. Marking every survivor's
schedules unprepared makes each stage of the job prepare again at the next step,
together. The preparation forks the RNG, so it does not change what the step computes.
"""

from __future__ import annotations

from typing import Any

#: The flags a schedule keeps for "my stages are prepared" (single-stage schedules,
#: then those with several stages per rank), as torch 2.13 to 2.15 name them.
_PREPARED_FLAGS = ("_stage_forward_initialized", "_stage_backward_initialized",
                   "_stages_forward_initialized", "_stages_backward_initialized")


def schedule_types() -> tuple[type | tuple[()], type | None]:
    """torch's base class of every pipeline schedule (``()`` where it is missing: not
    imported, nothing to reset; another torch, nothing known to reset) and that of the
    schedules with several stages per rank (None where missing)."""
    import sys

    module = sys.modules.get("torch.distributed.pipelining.schedules")
    base = getattr(module, "_PipelineSchedule", None) if module is not None else None
    multi = getattr(module, "PipelineScheduleMulti", None) if module is not None else None
    return (base if base is not None else ()), multi


def reset_schedule(schedule: Any, multi: type | None) -> bool:
    """Mark ``schedule``'s stages unprepared; False if it keeps no flag known here.

    A schedule with several stages per rank (an instance of ``multi``,
    ``PipelineScheduleMulti``: interleaved 1F1B, looped BFS, the zero-bubble ones)
    raises :class:`~recovery.common.errors.RecoveryImpossible`, which stops the job with
    one line: tried with ``ScheduleInterleaved1F1B``, the replayed step failed inside
    torch ("Recv twice for stage_idx=3 mb_index=1 without executing forward"), so it
    keeps per-step state that these flags do not cover, and it was reported as a bug in
    the user's step."""
    if multi is not None and isinstance(schedule, multi):
        from recovery.common.errors import RecoveryImpossible

        raise RecoveryImpossible(
            f"a pipeline schedule with several stages per rank ({type(schedule).__name__}) "
            "cannot be recovered in-process yet; use ScheduleGPipe or Schedule1F1B (one "
            "stage per rank), or run again from the durable checkpoint")
    found = False
    for flag in _PREPARED_FLAGS:
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)
            found = True
    return found
