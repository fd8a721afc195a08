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


def schedule_type() -> type | None:
    """torch's base class of every pipeline schedule, or None where it is missing
    (not imported: nothing to reset; another torch: nothing known to reset)."""
    import sys

    module = sys.modules.get("torch.distributed.pipelining.schedules")
    return getattr(module, "_PipelineSchedule", None) if module is not None else None


def reset_schedule(schedule: Any) -> bool:
    """Mark ``schedule``'s stages unprepared; False if it keeps no flag known here."""
    found = False
    for flag in _PREPARED_FLAGS:
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)
            found = True
    return found
