"""The zygote: one process per agent that holds torch's imports and forks warm spares,
and on a CPU build of torch the workers too (ADR 0029).

It is normally forked from the agent itself after the agent's imports
(:meth:`Zygote.fork_early`, :func:`run_forked`), so a node pays one ``import torch``;
an agent run in-process starts it as ``python -m launcher.zygote FD`` (:func:`main`).

A warm spare started with ``Popen`` spends about 3 s of CPU on ``import torch`` and its
warm-up step, and every replacement's durable helper spends almost 2 s more. On a busy
node that CPU comes out of the surviving ranks' training (measured on 2 cores: about
0.5-0.9 s of lost training per import, whatever its nice value or even SCHED_IDLE).
The zygote pays the imports once, then forks each spare in milliseconds; a forked spare
forks its durable helper in advance too, so a replacement imports nothing at all.

Protocol (a ``SOCK_SEQPACKET`` socketpair with the agent, descriptors passed with
``SCM_RIGHTS``):

- a zygote forked from the agent first receives ``{"env": {...}, "warm": [...]}``: the
  job's environment, which replaces the agent's, and the frameworks to import before
  the first fork (:mod:`launcher.script_imports`);
- the zygote sends ``{"ready": true}`` once warm;
- the agent sends ``{"spare": {}}`` with three descriptors (the spare's
  stdin, stdout and stderr); the zygote forks an intermediate process, which forks the
  spare and exits at once, so the kernel reparents the spare to the agent (a child
  subreaper, :mod:`launcher.reaper`); the zygote reaps the intermediate, then replies
  ``{"pid": P}``; from then on the agent owns the spare as its child;
- EOF (the agent closed its end or died) ends the zygote.

The zygote runs at the job's priority, so that it is warm by the first failure and
answers a fork request at once however busy the host is; each spare it forks lowers
itself to nice +10 while it waits. The zygote starts no threads of its own, so forking
it is safe: a fork copies only the calling thread, and torch's one idle pool thread
holds no lock that a child would need.
Between requests it imports the modules the job's workers ask spares to warm
(``<run_dir>/warm``), so forked spares inherit those too.

A forked spare reseeds Python's and NumPy's global generators (a fresh interpreter
seeds them from the OS, and two spares must not share a stream); torch's default
generator is left at its start-up state, as in a fresh process.

On a GPU build the zygote never initialises the GPU runtime, because a process forked
after that cannot use the GPU ("Cannot re-initialize CUDA in forked subprocess"): it
asks for CUDA availability through NVML (:data:`NVML_CHECK_ENV`), and its warm-up step
reaches no CUDA call (:func:`launcher.spare.warm_up`). Before each fork it checks
(:func:`fork_hazard`); if something it imported did initialise the runtime, it refuses
the fork and the agent starts new interpreters from then on. Each spare creates its
own CUDA context after the fork, while it waits (:func:`launcher.spare.warm_cuda`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from launcher.preload import describe as describe_preload
from launcher.sigint_hold import sigint_held
from recovery.common.events import Event
from replication.errors import CheckpointlessError
from replication.forked import ForkedProcess

ZYGOTE_MODULE = "launcher.zygote"
#: The script's modules for a zygote started as a new interpreter (JSON list; removed
#: from its environment before anything runs: its forks never see it).
PRELOAD_ENV = "CHECKPOINTLESS_INTERNAL_ZYGOTE_PRELOAD"
#: The first entry of a worker's ``sys.path`` (the script's directory), which the
#: zygote imports the script's modules with (see :func:`_preload_as_a_worker`).
PRELOAD_PATH_ENV = "CHECKPOINTLESS_INTERNAL_ZYGOTE_PRELOAD_PATH"
REPLY_TIMEOUT_S = 10.0


class ZygoteError(CheckpointlessError, RuntimeError):
    """The zygote could not fork a spare (it died, or stopped answering)."""


class BecomeZygote(BaseException):
    """Raised in the child of :meth:`Zygote.fork_early`.

    It unwinds the agent's own frames up to the program's entry point
    (:func:`launcher.cli.entry`), which runs the zygote from there
    (:func:`run_forked`). A worker forked from it then ends as ``python SCRIPT`` ends
    (``SystemExit``, thread joins, ``atexit``), with none of the agent's ``except`` or
    ``finally`` blocks on its way out. A ``BaseException``, so no ``except Exception``
    on the way catches it.
    """

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.fd = fd


#: Set by the program's entry point (:func:`launcher.cli.entry`), the only caller that
#: catches :class:`BecomeZygote`: an agent run in-process (tests calling
#: ``launcher.cli.main``) starts its zygote as a new interpreter instead.
early_fork_allowed = False


#: torch's switch for a CUDA availability check through NVML, which does not initialise
#: the CUDA driver (``cudaGetDeviceCount`` does, and a fork after it is unusable). Set
#: in the zygote only; a forked child gets the job's own value back (:func:`_become_spare`).
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
_UNSET = object()
_nvml_check_before: object = _UNSET  # the job's value, restored in each forked child


def _stay_cuda_free() -> None:
    """Make torch's CUDA availability checks in this process use NVML (read at each
    call, so it also holds where torch was imported before: the agent's early fork)."""
    global _nvml_check_before
    if _nvml_check_before is _UNSET:
        _nvml_check_before = os.environ.get(NVML_CHECK_ENV)
    os.environ[NVML_CHECK_ENV] = "1"


def _restore_cuda_check() -> None:
    """In a forked child: the job's own availability check, as a fresh process has it."""
    if _nvml_check_before is _UNSET:
        return
    if _nvml_check_before is None:
        os.environ.pop(NVML_CHECK_ENV, None)
    else:
        os.environ[NVML_CHECK_ENV] = str(_nvml_check_before)


def fork_hazard() -> str | None:
    """Why a process forked from this one now could not use the GPU, or None.

    Two signs: torch's CUDA state is initialised (``torch.cuda.is_initialized()``:
    the child's first CUDA call would raise), or the CUDA driver library is loaded
    (any CUDA runtime call loads it, and ``cuInit`` in a parent leaves the driver
    unusable in its forked children even when torch's own state was never set up;
    ``import torch`` does not load it: a CUDA build imports on hosts without a driver).
    ROCm is covered by the first sign only.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return ("CUDA is initialised in the zygote; a process forked from it could not "
                "use the GPU, so workers and spares start as new interpreters")
    if _cuda_driver_loaded():
        return ("the CUDA driver is loaded in the zygote; a process forked from it could "
                "not use the GPU, so workers and spares start as new interpreters")
    return None


def _cuda_driver_loaded() -> bool:
    try:
        with open("/proc/self/maps") as maps:
            return any("/libcuda.so" in line for line in maps)
    except OSError:
        return False


# --- the agent's side -------------------------------------------------------------------
class Zygote:
    """The agent's handle on its zygote process. Not thread-safe: the agent's loop
    is its only caller."""

    def __init__(self, env: Mapping[str, str], emit: Callable[..., object],
                 log: Callable[[str], None] | None = None) -> None:
        self._env = dict(env)
        self._emit = emit
        self._log = log
        self._sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self._ready = False
        self.failed: str | None = None
        self.last_fork_s = 0.0  # how long the last fork request took (reported)

    def start(self, preload: list[str] | tuple[str, ...] = (), path0: str | None = None) -> None:
        """Start the zygote as a new interpreter; it imports ``preload`` (the script's
        modules, :mod:`launcher.preload`) before it is ready, with ``path0`` first on
        ``sys.path`` as a worker has it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**self._env, PRELOAD_ENV: json.dumps(list(preload))} if preload else self._env
        if preload and path0 is not None:
            env = {**env, PRELOAD_PATH_ENV: path0}
        try:
            with sigint_held():  # until main() ignores it
                self.proc = subprocess.Popen(
                    [sys.executable, "-u", "-m", ZYGOTE_MODULE, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )
        except OSError as exc:
            ours.close()
            self.failed = f"could not start: {exc}"
            return
        finally:
            theirs.close()
        self._sock = ours
        self._emit(Event.ZYGOTE_START, pid=self.proc.pid)

    @classmethod
    def fork_early(cls) -> Zygote | None:
        """Fork the zygote from this process: the agent, after it has imported torch and
        before it starts a thread or opens the job store (ADR 0029). The zygote then
        inherits the imports instead of paying ``import torch`` again. It waits for the
        job's environment (:meth:`configure`) before it warms up. None if the fork
        failed (the agent then starts one with :meth:`start`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:  # the zygote: leave the agent's frames (see BecomeZygote)
            ours.close()
            raise BecomeZygote(theirs.detach())
        theirs.close()
        zygote = cls({}, lambda *_a, **_k: None)
        zygote._sock = ours
        zygote.proc = ForkedProcess(pid, args=ZYGOTE_MODULE)  # type: ignore[assignment]
        return zygote

    def configure(self, env: Mapping[str, str], emit: Callable[..., object],
                  warm: tuple[str, ...] = (), preload: list[str] | tuple[str, ...] = (),
                  log: Callable[[str], None] | None = None,
                  path0: str | None = None) -> None:
        """Give a zygote from :meth:`fork_early` the job's environment, the agent's
        event log and console, and the modules to import before the first fork
        (``warm``: the frameworks, see :mod:`launcher.script_imports`; ``preload``: the
        script's own, checked first, see :mod:`launcher.preload`); it warms up once it
        has them."""
        self._env, self._emit, self._log = dict(env), emit, log
        try:
            assert self._sock is not None
            self._sock.send(json.dumps({"env": self._env, "warm": list(warm),
                                        "preload": list(preload), "path0": path0}).encode())
        except OSError as exc:
            self._fail(f"could not configure the forked zygote: {exc}")
            return
        self._emit(Event.ZYGOTE_START, pid=self.proc.pid if self.proc else None, forked=True)

    @property
    def usable(self) -> bool:
        return self._sock is not None and self.failed is None

    def ready(self, wait_s: float = 0.0) -> bool:
        """True once the zygote has finished its imports; waits up to ``wait_s``."""
        if self._ready or not self.usable:
            return self._ready
        assert self._sock is not None
        if select.select([self._sock], [], [], wait_s)[0]:
            try:
                msg = self._recv_json()
            except ZygoteError:  # it died while importing: the pool falls back
                return False
            if msg.get("ready"):
                self._ready = True
                report = {k: msg[k] for k in ("preloaded", "left", "preload_s") if k in msg}
                self._emit(Event.ZYGOTE_READY, pid=self.proc.pid if self.proc else None,
                           **report)
                line = describe_preload(report)
                if line and self._log is not None:
                    self._log(line)
        return self._ready

    def fork_spare(self, args: Any = None) -> ForkedProcess:
        """A new warm spare, the agent's child, with its stdio piped to the agent."""
        if not self.ready():
            raise ZygoteError(self.failed or "the zygote is not ready")
        assert self._sock is not None
        t0 = time.monotonic()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        theirs = (stdin_r, stdout_w, stderr_w)
        try:
            socket.send_fds(self._sock, [json.dumps({"spare": {}}).encode()],
                            list(theirs))
            reply = self._recv_json(REPLY_TIMEOUT_S)
        except (OSError, ZygoteError) as exc:
            for fd in (stdin_w, stdout_r, stderr_r):
                os.close(fd)
            self._fail(f"fork request failed: {exc}")
            raise ZygoteError(self.failed) from exc
        finally:
            for fd in theirs:
                os.close(fd)
        if "pid" not in reply:
            self._fail(f"the zygote could not fork: {reply.get('error', reply)}")
            raise ZygoteError(self.failed)
        pid = int(reply["pid"])
        self.last_fork_s = time.monotonic() - t0
        return ForkedProcess(pid, stdin=os.fdopen(stdin_w, "wb"),
                             stdout=os.fdopen(stdout_r, "rb"),
                             stderr=os.fdopen(stderr_r, "rb"), args=args)

    def _recv_json(self, timeout_s: float = 0.0) -> dict[str, Any]:
        assert self._sock is not None
        if timeout_s and not select.select([self._sock], [], [], timeout_s)[0]:
            raise ZygoteError(f"no answer within {timeout_s:.0f} s")
        data = self._sock.recv(_ENV_MESSAGE_MAX)
        if not data:
            self._fail("the zygote exited")
            raise ZygoteError(self.failed)
        return json.loads(data)

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            self._emit(Event.ZYGOTE_FAILED, reason=why)

    def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote reads EOF and exits
            self._sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the zygote's side ------------------------------------------------------------------
def _serve(sock: socket.socket) -> list[int]:
    """Answer fork requests until EOF (then exit). Returns only in a forked spare: its
    stdio descriptors."""
    from launcher.spare import import_job_modules

    seen: set[str] = set()
    while True:
        if not select.select([sock], [], [], 0.5)[0]:
            import_job_modules(seen)
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 3)
        except OSError:
            os._exit(0)
        if not data:
            os._exit(0)  # the agent is gone
        got = _fork_spare(sock, fds)
        if got is not None:
            return got
        for fd in fds:
            os.close(fd)


def _freeze_heap() -> None:
    """Move every object the zygote holds out of the garbage collector's sight
    (``gc.freeze``), as Python's documentation advises before ``fork`` without ``exec``.

    A forked process's collections, above all the full one when its interpreter exits,
    otherwise walk the whole inherited heap of torch's objects, writing to each one's
    header and so copying nearly every page shared with the zygote: 0.5-0.8 s of CPU
    per worker at exit here, all of it in ``gc_collect_main``. Frozen objects are never
    collected; the zygote's live for the whole job anyway, and a collection first frees
    the cycles its warm-up left behind."""
    gc.collect()
    gc.freeze()


def _fork_spare(sock: socket.socket, fds: list[int]) -> list[int] | None:
    """Fork the spare through an intermediate process; returns ``fds`` in the spare
    only. In the zygote: waits for the intermediate, then replies with the spare's pid,
    or refuses (an ``error`` reply, no fork) where a fork could not use the GPU."""
    hazard = fork_hazard()
    if hazard is not None:
        with contextlib.suppress(OSError):
            sock.send(json.dumps({"error": hazard}).encode())
        return None
    _freeze_heap()  # and what it imported since (the modules a job asked to warm)
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the spare, report its pid, vanish
        os.close(r)
        try:
            spare = os.fork()
        except OSError:
            os._exit(1)
        if spare == 0:
            os.close(w)
            sock.close()
            return fds
        try:
            os.write(w, str(spare).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        pid = f.read().decode()
    os.waitpid(middle, 0)  # once it is reaped, the spare's parent is the agent
    with contextlib.suppress(OSError):
        sock.send(json.dumps({"pid": int(pid)} if pid else {"error": "fork failed"}).encode())
    return None


def _become_spare(fds: list[int]) -> int:
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    _restore_cuda_check()
    _reseed()
    from replication.durable import worker as durable_worker

    durable_worker.prefork_helper()  # still single-threaded, at the job's priority
    from launcher.spare import serve

    return serve()  # it waits for its rank at nice +10


def _reseed() -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        with contextlib.suppress(Exception):
            numpy.random.seed()


#: The largest message the agent sends: the job's environment (see Zygote.configure).
_ENV_MESSAGE_MAX = 1 << 20


def run_forked(fd: int) -> int:
    """The zygote's life in the child of :meth:`Zygote.fork_early`: quiet stdio and
    SIGINT ignored (as :func:`main` has them), then the job's environment from the
    agent, in place of the agent's own, then :func:`main`'s warm-up and service."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    sock = socket.socket(fileno=fd)
    try:
        data = sock.recv(_ENV_MESSAGE_MAX)
    except OSError:
        os._exit(0)
    if not data:
        os._exit(0)  # the agent ended before it needed a zygote
    msg = json.loads(data)
    env, warm = msg["env"], tuple(msg.get("warm", ()))
    preload, path0 = list(msg.get("preload", ())), msg.get("path0")
    os.environ.clear()
    os.environ.update(env)
    _stay_cuda_free()
    import torch

    # torch read OMP_NUM_THREADS when the agent imported it; the job's value (the agent
    # sets 1 for several workers per node, as torchrun does) is applied here instead.
    threads = env.get("OMP_NUM_THREADS", "")
    return _warm_and_serve(sock, int(threads) if threads.isdigit() and int(threads) > 0
                           else torch.get_num_threads(), warm, preload, path0)


def main(argv: list[str]) -> int:
    # A Ctrl-C in the terminal reaches the whole process group; the agent ends this
    # process (closing its socket) as part of stopping the node. A spare forked from
    # here inherits this and takes the default back when it runs a rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(argv[0]))
    preload = json.loads(os.environ.pop(PRELOAD_ENV, "[]"))
    path0 = os.environ.pop(PRELOAD_PATH_ENV, None)
    _stay_cuda_free()  # before torch is imported
    import torch

    return _warm_and_serve(sock, torch.get_num_threads(), (), preload, path0)


def _preload_as_a_worker(names: list[str], path0: str | None) -> dict[str, Any]:
    """Import the script's modules (:mod:`launcher.preload`) with the worker's first
    ``sys.path`` entry, the script's directory, in place of the zygote's own (the
    agent's working directory). Otherwise a module that only the agent's directory
    reaches is preloaded into every forked worker, and missing in a worker started as
    a new interpreter (a zygote not yet ready, ``--no-zygote``): the same script then
    runs or fails with ``ModuleNotFoundError`` depending on how its process started."""
    from launcher.preload import preload as preload_modules

    saved = sys.path[0] if sys.path else None
    if path0 is not None and saved is not None:
        sys.path[0] = path0
    try:
        return preload_modules(names).as_message()
    finally:
        if saved is not None:
            sys.path[0] = saved


def _warm_and_serve(sock: socket.socket, threads: int, warm: tuple[str, ...] = (),
                    preload: list[str] | None = None, path0: str | None = None) -> int:
    from launcher.spare import warm_up

    # At the job's priority throughout: the zygote must be warm by the first failure,
    # which comes while every worker trains (at nice +10 it needed up to 20 s under
    # load, and a rank that needed a spare meanwhile waited for it or started cold).
    # It is one import per node, paid with the workers' own at start-up; a fork
    # request is answered at once however busy the host is; and each spare it forks
    # waits at nice +10 (:func:`launcher.spare.serve`).
    job_nice = os.getpriority(os.PRIO_PROCESS, 0)
    t0 = time.monotonic()
    import torch

    # One intra-op thread while warming: an OpenMP pool started here would be lost
    # in every fork (only the forking thread survives) and hang the child's first
    # parallel op. A forked spare starts its own pool when it first needs one.
    torch.set_num_threads(1)
    warm_up(warm)
    # The script's own imports, each checked in a forked probe first (launcher.preload):
    # still with one intra-op thread, so the probes fork a process without a pool.
    report = _preload_as_a_worker(preload, path0) if preload else {}
    torch.set_num_threads(threads)
    _freeze_heap()
    try:
        sock.send(json.dumps({"ready": True, "warm_s": round(time.monotonic() - t0, 3),
                              "nice": job_nice, **report}).encode())
    except OSError:
        return 0
    return _become_spare(_serve(sock))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
