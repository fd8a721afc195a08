"""Worker and warm-spare processes: start, hand a rank to, watch and stop them.

Workers stay in the agent's process group, so killing that group (``os.killpg`` on an
agent started in its own session) takes a whole "node" down with its workers and
spares, which is how tests and chaos runs simulate the loss of a machine.

Stdin of workers is ``/dev/null``: many processes sharing a terminal's input is never
what anyone wants, and a spare's stdin is the pipe its assignment arrives on anyway.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from launcher import process_view, worker_output
from launcher.sigint_hold import sigint_held
from launcher.zygote import Zygote, ZygoteError
from recovery.common.events import Event
from recovery.runtime import drain
from replication.forked import ForkedProcess

SPARE_MODULE = "launcher.spare"

#: A worker or spare process: started by ``Popen``, or forked by the zygote.
Spare = subprocess.Popen | ForkedProcess

#: What :meth:`Worker.observe` finds.
ALIVE, LATE, HUNG = "alive", "late", "hung"
#: A worker whose heartbeat is silent but whose process is still at work is declared
#: hung only after this many heartbeat timeouts (60 s at the default 15 s).
BUSY_LIMIT = 4.0


def python_command(script: str, args: Iterable[str], module: bool) -> list[str]:
    """What torchrun runs (``python -u SCRIPT ...`` or ``python -u -m MODULE ...``), through
    the worker bootstrap ``python -u -m launcher.spare --run``: it installs the import
    hooks every worker gets (``strategy="checkpointless"`` for Lightning scripts), then
    runs the script exactly as a warm spare runs its assignment."""
    head = [sys.executable, "-u", "-m", SPARE_MODULE, "--run", *(["-m"] if module else [])]
    return [*head, script, *args]


def make_heartbeat_file(path: str) -> None:
    """Create the worker's heartbeat file with mtime 0, meaning "never beaten".

    Hang detection is armed only once the worker touches the file, so a plain script
    that never heard of heartbeats is supervised by its exit code alone instead of being
    killed as hung. A drain request left next to it by an earlier run in the same run
    directory (a requeued Slurm job; the names repeat) is removed first.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + drain.STOP_SUFFIX)
    with open(path, "a"):
        pass
    os.utime(path, (0, 0))


@dataclass
class Worker:
    """One process running one rank on this node."""

    rank: int
    local_rank: int
    group_rank: int
    proc: Spare
    heartbeat: str
    restart_count: int
    gen_seen: int  # the generation current when this process last showed life
    spare: bool = False
    last_mtime: float = 0.0
    beat_seen_at: float = field(default_factory=time.monotonic)
    #: Since the last beat: when the kernel last showed the process at work (CPU time
    #: grown, running, runnable or in the disk), the CPU time it had then, and whether
    #: the agent has said once that the silence is a busy host's, not a hang.
    active_at: float = 0.0
    cpu_seen: float | None = None
    late_reported: bool = False
    #: Why the last :meth:`observe` that returned HUNG judged so (for the agent's line).
    hung_because: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def observe(self, gen: int, timeout_s: float) -> str:
        """Note a sign of life (recording ``gen``); say whether the worker is hung.

        ``gen`` must have been read before this call, so it was current while the
        process was still alive. Armed workers prove life by touching their heartbeat
        file; unarmed ones by merely running.

        A heartbeat silent for ``timeout_s`` is not enough on its own: on a busy host the
        thread that touches the file can be starved for seconds. The kernel's view
        (:mod:`launcher.process_view`) decides then. A stopped process is hung; one with
        no sign of work (no CPU time, not runnable, not in the disk) for ``timeout_s`` is
        hung; one still at work gets up to :data:`BUSY_LIMIT` times ``timeout_s`` (a
        native call that holds the GIL that long, or a thread that spins, is hung too).

        Returns :data:`ALIVE`, :data:`LATE` (silent past the timeout but at work: said
        once per silence, so the agent can log it) or :data:`HUNG`.
        """
        try:
            mtime = os.stat(self.heartbeat).st_mtime
        except OSError:
            mtime = self.last_mtime
        now = time.monotonic()
        if mtime != self.last_mtime:
            self.last_mtime, self.beat_seen_at, self.gen_seen = mtime, now, gen
            self.active_at, self.cpu_seen, self.late_reported = now, None, False
            return ALIVE
        if self.last_mtime == 0.0:  # never beaten: not armed
            self.gen_seen = gen
            return ALIVE
        silent = now - self.beat_seen_at
        if silent <= timeout_s / 2:
            return ALIVE
        view = process_view.read(self.pid)
        if view is None:  # no kernel view (gone, or no /proc): the heartbeat decides
            if silent > timeout_s:
                self.hung_because = "no heartbeat"
                return HUNG
            return ALIVE
        if view.busy or (self.cpu_seen is not None and view.cpu_s > self.cpu_seen):
            self.active_at = now
        self.cpu_seen = view.cpu_s
        if silent <= timeout_s:
            return ALIVE
        if view.stopped:
            self.hung_because = f"stopped (state {view.state})"
            return HUNG
        if now - self.active_at > timeout_s:
            self.hung_because = "no CPU time, not runnable"
            return HUNG
        if silent > BUSY_LIMIT * timeout_s:
            self.hung_because = (f"at work but silent past {BUSY_LIMIT:g} x "
                                 f"recovery.heartbeat_timeout_s")
            return HUNG
        if not self.late_reported:
            self.late_reported = True
            return LATE
        return ALIVE

    def kill(self) -> None:
        """SIGKILL and reap; works on a SIGSTOPped process too."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


def exit_signal(returncode: int) -> str | None:
    """The signal name for a negative Popen return code, else None."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"SIG{-returncode}"


def spawn(cmd: list[str], env: Mapping[str, str]) -> subprocess.Popen:
    with sigint_held():
        proc = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    worker_output.relay(proc, f"rank{env.get('RANK', '?')}")  # prefixed lines on our console
    return proc


def launch(
    script: str,
    script_args: Iterable[str],
    module: bool,
    base_env: Mapping[str, str],
    rank_vars: Mapping[str, str],
    spares: SparePool | None,
    *,
    replacement: bool,
    should_stop: Callable[[], bool] = lambda: False,
) -> tuple[Spare, str]:
    """Start a rank, the cheapest way there is (ADR 0029).

    - A replacement takes an idle warm spare (``"spare"``), else a new fork from the
      zygote (``"fork"``).
    - A first start forks from the zygote, waiting for a zygote still importing (its
      import is the one the worker would pay anyway): ``"fork"``. The idle spares stay
      for failures. On GPU builds too: the zygote never initialises CUDA, and it
      refuses a fork if something did (:func:`launcher.zygote.fork_hazard`).
    - Without a zygote (``--no-zygote``, not Linux, or it failed), or if the spare died
      before it took the rank: a new interpreter, ``"exec"``.

    Returns the process and how it started. The pool refills itself later, from the
    agent's poll loop, once the recovery no longer needs the CPU.
    """
    if spares is not None:
        candidate, how = (spares.take(), "spare") if replacement else (None, "fork")
        if candidate is None and (replacement or spares.forks_workers):
            # none idle, or a first start: a fork still beats an import (take() has
            # already waited its while for a zygote still importing)
            wait_s = 0.0 if replacement else spares.zygote_wait_s
            candidate, how = spares.fork(wait_s, should_stop), "fork"
        if candidate is not None:
            if SparePool.assign(candidate, rank_vars, [script, *script_args], module):
                worker_output.relabel(candidate.pid, f"rank{rank_vars.get('RANK', '?')}")
                return candidate, how
            stop_processes([candidate], grace_s=0.0)
    cmd = python_command(script, script_args, module)
    return spawn(cmd, {**base_env, **rank_vars}), "exec"


def stop_processes(procs: Iterable[Spare], grace_s: float = 5.0) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL whatever is left (and reap it)."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(OSError):
            p.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                p.kill()
            p.wait()


class SparePool:
    """Processes that have imported torch and the runtime and wait for a rank.

    A spare turns into a worker when it receives one JSON line on stdin (see
    :mod:`launcher.spare`), which saves a replacement the interpreter start and the
    imports. The pool is refilled ``refill_delay_s`` after a spare is taken: a new
    spare spends seconds of CPU importing torch, which would slow down the very
    replacement it is meant to speed up. A spare that dies while idle is replaced,
    within a budget so that a spare that cannot even start does not become a fork loop.
    """

    refill_delay_s = 15.0
    #: With a zygote a refill is a fork, not an import: only let the recovery pass.
    forked_refill_delay_s = 1.0
    #: How long the pool waits for its zygote's imports before starting spares itself.
    zygote_wait_s = 60.0
    #: How long a rank that needs a spare now waits for a zygote still importing (the
    #: agent's loop is blocked meanwhile); past it, the rank starts a new interpreter.
    zygote_take_wait_s = 3.0

    def __init__(
        self, size: int, env: Mapping[str, str], emit: Callable[..., object],
        zygote: Zygote | None = None,
    ) -> None:
        self.size = size
        self._env = dict(env)
        self._emit = emit
        self._idle: list[Spare] = []
        self._restarts_left = 2 * size + 2
        self._refill_at = 0.0
        self.zygote = zygote
        self._zygote_since = time.monotonic()
        #: First starts fork from the zygote too (ADR 0029; any build of torch).
        self.forks_workers = zygote is not None

    def fill(self) -> None:
        if time.monotonic() < self._refill_at:
            return
        while len(self._idle) < self.size:
            proc = self._new_spare()
            if proc is None:
                return  # the zygote is still importing: fork them once it is ready
            self._idle.append(self._started(proc))

    def _started(self, proc: Spare) -> Spare:
        worker_output.relay(proc, "spare")
        forked = isinstance(proc, ForkedProcess)
        extra = {"fork_s": round(self.zygote.last_fork_s, 4)} if forked and self.zygote else {}
        self._emit(Event.SPARE_START, pid=proc.pid, forked=forked, **extra)
        return proc

    def _new_spare(self) -> Spare | None:
        z = self.zygote
        if z is not None and z.usable:
            if z.ready():
                try:
                    return z.fork_spare(args=SPARE_MODULE)
                except ZygoteError as exc:
                    self._emit(Event.SPARE_FORK_FAILED, reason=str(exc))
            elif time.monotonic() - self._zygote_since < self.zygote_wait_s:
                return None
        with sigint_held():
            return subprocess.Popen(
                [sys.executable, "-u", "-m", SPARE_MODULE],
                env=self._env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )

    def maintain(self) -> None:
        """Reap spares that died while idle and start new ones (within the budget)."""
        for proc in [p for p in self._idle if p.poll() is not None]:
            self._idle.remove(proc)
            self._emit(Event.SPARE_EXIT, pid=proc.pid, exitcode=proc.returncode)
            if self._restarts_left <= 0:
                self.size = len(self._idle)
                self._emit(Event.SPARE_POOL_SHRUNK, size=self.size)
                continue
            self._restarts_left -= 1
        self.fill()

    def idle_count(self) -> int:
        """Spares a failed rank could be handed to now (forked on demand: the pool's size
        while its zygote lives)."""
        if self.forks_workers:
            return self.size if self.zygote is not None and self.zygote.usable else 0
        return len(self._idle)

    def take(self) -> Spare | None:
        """An idle spare, if any. Taking one schedules the refill; a zygote still
        importing is waited for, briefly, when none is idle, because its head start
        beats a new interpreter's (the caller then forks: :meth:`fork`)."""
        z = self.zygote
        forked = z is not None and z.usable and z.ready(
            wait_s=0.0 if self._idle else self.zygote_take_wait_s)
        delay = self.forked_refill_delay_s if forked else self.refill_delay_s
        self._refill_at = time.monotonic() + delay
        while self._idle:
            proc = self._idle.pop(0)
            if proc.poll() is None:
                return proc
        return None

    def fork(self, wait_s: float, should_stop: Callable[[], bool] = lambda: False) -> Spare | None:
        """A process forked from the zygote for a rank that starts now, without touching
        the idle spares (they stay for failures). Waits up to ``wait_s`` for a zygote
        still importing, in slices so that a stop request is seen; None without a
        usable zygote (the caller starts a new interpreter)."""
        z = self.zygote
        if z is None:
            return None
        deadline = time.monotonic() + wait_s
        while z.usable and not z.ready(wait_s=0.1):
            if should_stop() or time.monotonic() >= deadline:
                return None
        if not z.usable:
            return None
        try:
            proc = z.fork_spare(args=SPARE_MODULE)
        except ZygoteError as exc:
            self._emit(Event.SPARE_FORK_FAILED, reason=str(exc))
            return None
        worker_output.relay(proc, "spare")
        return proc

    @staticmethod
    def assign(
        proc: Spare, env: Mapping[str, str], argv: list[str], module: bool
    ) -> bool:
        """Hand a rank to a spare; False if it died before it could take it."""
        line = json.dumps({"env": dict(env), "argv": argv, "module": module}) + "\n"
        try:
            assert proc.stdin is not None
            proc.stdin.write(line.encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            return False
        return True

    def stop(self) -> None:
        """Close the spares' stdin (they exit on EOF), then make sure they are gone."""
        for proc in self._idle:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        stop_processes(self._idle, grace_s=2.0)
        self._idle.clear()
        if self.zygote is not None:
            self.zygote.stop()

    def pids(self) -> set[int]:
        """The processes the pool owns (they collect their own exit status)."""
        owned = {p.pid for p in self._idle}
        if self.zygote is not None and self.zygote.proc is not None:
            owned.add(self.zygote.proc.pid)
        return owned

