"""A generation's NCCL backend, built so that a failure can always be aborted (ADR 0038).

The runtime's process group forwards CUDA collectives to an inner NCCL backend made
for the current generation (:meth:`recovery.process_group.controller.Controller.make_inner`).
On a failure the survivors must leave that backend at once and build the next
generation's, in the same process. Three NCCL defaults work against that:

- **A blocking communicator.** ``ncclCommInitRank`` waits for every peer; a peer that
  died during the init leaves it waiting, and ``ncclCommAbort`` from another thread
  cannot interrupt a blocking init. A *non-blocking* communicator (``config.blocking =
  0``) returns ``ncclInProgress`` instead and torch polls it, so the abort the runtime
  issues on a declared failure ends it.
- **The watchdog's error handling.** ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` tears the
  whole process down on a collective error or timeout: a survivor that notices a dead
  peer before the runtime aborts would die instead of recovering. The worker
  environment sets a mode that never kills the process (``launcher/worker_env.py``).
- **One algorithm per call site.** With ``recovery.nccl_fixed_algorithm`` the ring and
  the simple protocol are pinned, so a replayed step reduces in the same order as the
  first run (ADR 0034).

What this module does not do (ADR 0038): reuse the previous generation's communicator.
``torch.distributed.shrink_group`` (and ``Backend.shrink`` under it, NCCL >= 2.27) builds
a smaller communicator from a live one, but a recovery with a spare keeps the world's
size (the replacement is a new process the old communicator never had), and a shrink
without a spare runs the script again in the new world (ADR 0035), which builds its
groups afresh. :func:`can_shrink` reports whether the backend offers it, for the GPU
check's record.

Every path here needs a GPU; the GPU check (``make test-gpu``, one-rank generation
cycle) runs it on one card. NCCL refuses two ranks on one device, so nothing with more
than one rank has run.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

NON_BLOCKING = 0
"""``NCCLConfig.blocking`` for a communicator whose init and collectives return
``ncclInProgress`` rather than block (so an abort can interrupt them)."""


def nccl_options(options_cls: Any, timeout_s: float) -> Any:
    """Options for a generation's NCCL backend: the collective timeout, and a
    non-blocking communicator where torch exposes the setting.

    ``options_cls`` is ``dist.ProcessGroupNCCL.Options`` (a parameter so the choice can
    be checked on a host whose torch has no NCCL). Torch builds without the ``config``
    attribute keep NCCL's blocking default: then an init stuck on a dead peer ends only
    at its timeout, which the returned options also carry.
    """
    opts = options_cls()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    config = getattr(opts, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = NON_BLOCKING
    return opts


def pin_algorithm(environ: dict[str, str] | None = None) -> None:
    """``recovery.nccl_fixed_algorithm``: pin NCCL's ring and simple protocol, which
    NCCL reads when it makes its first communicator; values the user set stay."""
    env = os.environ if environ is None else environ
    env.setdefault("NCCL_ALGO", "Ring")
    env.setdefault("NCCL_PROTO", "Simple")


def make_backend(store: dist.Store, rank: int, size: int, timeout_s: float,
                 *, fixed_algorithm: bool = False) -> Any:  # pragma: no cover - needs a GPU
    """A generation's NCCL backend over ``store`` (a prefix store of the generation)."""
    if fixed_algorithm:
        pin_algorithm()
    opts = nccl_options(dist.ProcessGroupNCCL.Options, timeout_s)
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def abort(backend: Any) -> None:
    """Abort ``backend``'s communicators: pending and future operations on it fail, and
    a non-blocking init in progress ends. Errors are dropped: the generation is over
    whatever NCCL says, and the next one builds a new backend."""
    try:
        backend.abort()
    except Exception:  # an abort that fails leaves nothing to do
        pass


def can_shrink(backend: Any) -> bool:
    """Whether ``backend`` can build a smaller communicator from itself
    (``Backend.shrink``, what ``torch.distributed.shrink_group`` calls)."""
    try:
        return bool(backend.supports_shrinking)
    except Exception:  # older torch: the attribute is missing
        return False
