"""A bug in the user's script stops the job with one line; it is never retried.

Recovery is for failures that move: a process killed, a node lost, a peer hung. A
``ModuleNotFoundError`` at import, a typo in a path, or a ``ValueError`` that step 7
raises every time it runs fails the same way in every replacement and after every
rollback; retrying it ``recovery.max_restarts`` times only buries the cause under
hundreds of lines of tracebacks. Two rules make such failures fatal at once:

- an exception that escapes the script before this process completed its first step
  (imports, argument parsing, data and model set-up): see :func:`stop_before_first_step`;
- the same exception (type and message) on the same rank at the same step as the
  failure this rank last recovered from: see :class:`RepeatGuard`.

Either way the first rank to record it prints the traceback once and one line that
names the exception, the rank, the step and the file:line of the innermost frame in
the user's code; the agents then stop the job with that line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from replication import contract

if TYPE_CHECKING:
    from recovery.common.env import WorkerEnv

#: Frames in these directories are the runtime's or a library's, not the user's.
_NOT_USER = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # this checkout
    os.path.dirname(os.__file__),  # the standard library
)

_first_step_done = False


def mark_first_step_done() -> None:
    """Called by the runtime when this process completed a training step."""
    global _first_step_done
    _first_step_done = True


def first_step_done() -> bool:
    return _first_step_done


def where(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc`` in the user's code (outside this
    checkout, the standard library and site-packages), else of the innermost frame
    that is a file; "" when there is none (an import machinery error)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    files = [f for f in frames if not f.filename.startswith("<")]
    user = [f for f in files if "site-packages" not in f.filename
            and not any(f.filename.startswith(d + os.sep) for d in _NOT_USER)]
    if not files:
        return ""
    frame = (user or files)[-1]
    return f"{os.path.relpath(frame.filename)}:{frame.lineno}"


def _shown(exc: BaseException) -> BaseException:
    """The exception to show: runpy's "Error while finding module specification"
    stands for its cause, the ``ModuleNotFoundError`` of ``-m`` with a missing module."""
    if isinstance(exc.__cause__, ModuleNotFoundError) and "module specification" in str(exc):
        return exc.__cause__
    return exc


def describe(exc: BaseException) -> str:
    """``ValueError: bad value (at train.py:12)``, on one line. ``-m`` with a module
    that does not exist is named by its cause, the ``ModuleNotFoundError``."""
    exc = _shown(exc)
    if isinstance(exc, SystemExit):
        code = exc.code
        if isinstance(code, int):
            return f"SystemExit({code}) (the lines above it say why)"
        return f"SystemExit: {' '.join(str(code).split())[:300]}"
    text = " ".join(str(exc).split())[:300]
    at = where(exc)
    return f"{type(exc).__name__}{': ' + text if text else ''}{f' (at {at})' if at else ''}"


def loop_ran_dry(rank: int, step: int, exc: StopIteration) -> str:
    """The line for a ``StopIteration`` out of the script's own ``next()`` inside a
    training step: the loop asked for a batch past the end of its data. Retrying cannot
    help, and the usual cause is a loop that counts its steps itself: after a recovery
    its counter goes on from where it was on a survivor and from 0 on a replacement,
    while the loader resumes at the batch after the restored step."""
    at = f" ({w})" if (w := where(exc)) else ""
    return (f"rank {rank} raised StopIteration inside its training step {step}{at}: "
            "the loop asked for a batch after the end of its data. A loop "
            "that counts steps itself (`for _ in range(n):` with `next(it)` inside) does "
            "not go back with a recovery, so ranks run different numbers of steps: use "
            "`for i in cl.steps(n):` or iterate the loader (`for batch in loader:`); "
            "not retried")


def stop_job(reason: str, exc: BaseException) -> bool:
    """Record ``reason`` as the job's fatal reason; print the traceback and the line if
    this rank recorded it first (the others print one line). Returns whether it did."""
    from recovery.common.env import WorkerEnv

    env = WorkerEnv.from_environ()
    with _sigterm_held():  # the agent stops every worker once the record is there
        return _record_and_say(env, reason, exc)


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """Hold a SIGTERM until this rank has said why the job stops, then act on it. The
    agent stops the workers as soon as it reads the fatal record; under load it did so
    between the record and the traceback, which was then never printed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGTERM)


def _record_and_say(env: WorkerEnv, reason: str, exc: BaseException) -> bool:
    from recovery.common.causes import FailureCause
    from recovery.generation import protocol

    first = True
    if env.launched:
        try:
            store = env.connect_store()
            protocol.set_fatal(store, reason, rank=env.rank, kind=FailureCause.USER_ERROR)
            recorded = protocol.fatal(store) or {}
            first = recorded.get("rank") == env.rank and recorded.get("reason") == reason
        except Exception as store_exc:  # the job store is gone: say it here at least
            print(f"checkpointless: could not record the failure in the job store "
                  f"({store_exc})", file=sys.stderr, flush=True)
    if first and not isinstance(exc, SystemExit):  # its message was printed already
        shown = _shown(exc)
        traceback.print_exception(shown, chain=shown is exc)
        sys.stderr.flush()
    print(f"checkpointless: {reason}" if first else
          f"checkpointless: rank {env.rank} stopped too ({describe(exc)})",
          file=sys.stderr, flush=True)
    return first


def record_verdict(exc: BaseException) -> None:
    """A :class:`~recovery.common.errors.RecoveryImpossible` escaped the script: make it the
    job's fatal reason if nothing is recorded yet, and say it once. The runtime records
    its own verdicts; one raised where no runtime call records it (a tracked loader's
    iterator after a rollback across an epoch, the epoch loop's boundary) reached the
    agent as a plain crash, which it replaced, and the job then failed for another
    reason ("no surviving copy") after a cascade of recoveries."""
    from recovery.common.causes import FailureCause
    from recovery.common.env import WorkerEnv
    from recovery.common.errors import ScriptLoopError
    from recovery.generation import protocol

    env = WorkerEnv.from_environ()
    if not env.launched:
        return
    kind = {"kind": FailureCause.USER_ERROR} if isinstance(exc, ScriptLoopError) else {}
    try:
        store = env.connect_store()
        if protocol.fatal(store) is None:
            protocol.set_fatal(store, str(exc), rank=env.rank, **kind)
            print(f"checkpointless: {exc}", file=sys.stderr, flush=True)
    except Exception:  # the job store is gone: the job is ending anyway
        pass


def stop_before_first_step(exc: BaseException) -> NoReturn:
    """The script raised before this process completed a step: stop the job."""
    from recovery.common.env import WorkerEnv

    rank = WorkerEnv.from_environ().rank
    stop_job(f"rank {rank} raised {describe(exc)} before its first step; a failure "
             "in the script or its set-up is not retried", exc)
    raise SystemExit(contract.EXIT_FATAL)


@dataclass(frozen=True)
class _Signature:
    kind: str
    message: str
    step: int


class RepeatGuard:
    """Tells a deterministic exception from one that moved: the same type and message
    at the same step as the last local failure this rank recovered from."""

    def __init__(self) -> None:
        self._last: _Signature | None = None

    def repeated(self, exc: BaseException, step: int) -> bool:
        """Record ``exc`` at ``step``; True when it repeats the last one."""
        sig = _Signature(type(exc).__name__, str(exc)[:500], step)
        again, self._last = sig == self._last, sig
        return again


def refuse_unlaunched_multiprocess(env: WorkerEnv) -> None:
    """Several processes without ``checkpointless run`` cannot recover: say so at once.

    Plain ``torchrun`` (or processes the script spawns itself with RANK/WORLD_SIZE set)
    gives no job store, so each process would wait for peers that never come.
    """
    if env.launched:
        return
    import torch.distributed as dist

    world = env.world_size
    if dist.is_available() and dist.is_initialized():
        world = max(world, dist.get_world_size())
    if world > 1:  # one line, no traceback: SystemExit prints just the message
        raise SystemExit(
            f"checkpointless: this is rank {env.rank} of {world} processes started "
            "without `checkpointless run` (plain torchrun or python); start the job with "
            "`checkpointless run --nproc-per-node N script.py` (it takes torchrun's flags)")
