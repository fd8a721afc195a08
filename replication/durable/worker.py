"""The durable writer's helper process: serialisation and I/O off the training process.

``torch.save`` (which DCP calls once per tensor) holds the GIL while it checksums and
writes each record, so a writer *thread* stalls a Python-heavy training loop for most
of a save (measured: half the steps/s, while a separate process doing the same work
costs nothing on an idle core; see ``docs/adr/0005-durable-format.md``). Each rank's
writer therefore runs :class:`~replication.durable.saver.RankSaver` in a helper
process of its own:

- started with ``python -m replication.durable.worker FD`` (not ``multiprocessing``:
  spawn would re-import the user's ``__main__``), at a lower CPU priority, without GPUs
  (``CUDA_VISIBLE_DEVICES=""``) and with one torch thread. A warm spare forks its
  helper in advance instead (:func:`prefork_helper`), while it is still small and
  single-threaded: a replacement rank then starts no ``import torch`` at all, which on
  a busy host costs the surviving ranks about half a second of training each time;
- settings, including storage credentials, arrive over a socketpair, never argv;
- the snapshot is read from shared memory: straight from its snapshot slot when the
  snapshot engine allocates its slots there (a memfd whose descriptor is passed over
  the socket; the training process does no work for the save at all, and the helper
  checks the segment digests itself before it commits), else from a named staging
  buffer the training process copies into (one memcpy plus checksum, both without
  the GIL);
- ``torch.save``'s zip CRC32 is switched off in the helper (a third of its CPU per
  byte; torch.load ignores it, and the manifest's checksums cover every byte);
- log records are forwarded to the parent's ``checkpointless.durable`` logger;
- when the training process dies, the helper's end of the socket reads EOF: it
  aborts the save in progress and exits (the partial step is never listed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

from replication import contract
from replication.durable.messages import (
    Abort,
    Init,
    Log,
    Message,
    Ready,
    Result,
    Save,
    Stop,
)
from replication.durable.saver import (
    ABORTED,
    FAILED,
    STAGE_HEADER,
    RankSaver,
    SaveResult,
    SaverSettings,
)
from replication.errors import CheckpointlessError
from replication.forked import ForkedProcess

log = logging.getLogger("checkpointless.durable")
M = TypeVar("M", bound=Message)

HELPER_NICE = 10  # the helper yields the CPU to training when both want it
READY_TIMEOUT_S = 300.0


class HelperError(CheckpointlessError, RuntimeError):
    """The helper process could not be started or died."""


@dataclass
class _Preforked:
    pid: int
    sock: socket.socket


_preforked: _Preforked | None = None


def prefork_helper() -> bool:
    """Fork this process's durable helper now, to be taken by the first
    :meth:`ProcessBackend.start` (a warm spare calls this before it waits for a rank).

    Call it only while the process is small and has no threads of its own: the child
    shares the parent's memory copy-on-write and must not inherit held locks.
    The helper lowers its priority by ``HELPER_NICE`` from the caller's at fork time.
    Returns False where ``fork`` is unavailable.
    """
    global _preforked
    if not hasattr(os, "fork") or _preforked is not None:
        return False
    parent, child = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the helper: never returns
        parent.close()
        os.environ.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        main([str(child.detach())])
    child.close()
    _preforked = _Preforked(pid, parent)
    return True


def _take_preforked() -> _Preforked | None:
    global _preforked
    taken, _preforked = _preforked, None
    if taken is None:
        return None
    try:
        done, _ = os.waitpid(taken.pid, os.WNOHANG)
    except ChildProcessError:
        done = taken.pid
    if done:  # it died while waiting: start a helper the usual way
        taken.sock.close()
        return None
    return taken


# -- parent side --------------------------------------------------------------------------
#: The helper's command: SIGINT is ignored before the package imports torch (a Ctrl-C
#: reaches the whole process group, and an import it interrupts prints a traceback);
#: its rank ends it by closing the pipe.
_HELPER_BOOT = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "from replication.durable.worker import main; main(sys.argv[1:])")


class ProcessBackend:
    """The training-process end of one rank's helper process."""

    def __init__(self, settings: SaverSettings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.conn: Connection | None = None
        self._ready = False
        self.ever_ready = False  # a helper that never got ready points at a broken setup
        self._job = 0
        self._send_lock = threading.Lock()
        self._killed = False

    def start(self) -> None:
        """Launch the helper (returns at once; it imports torch in the background), or
        take the one this process forked in advance."""
        taken = _take_preforked()
        if taken is not None:
            self.proc = ForkedProcess(taken.pid, args="durable helper (pre-forked)")
            self.conn = Connection(taken.sock.detach())
            self._ready, self._killed = False, False
            self._send(Init(dataclasses.asdict(self.settings)))
            return
        parent, child = socket.socketpair()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        root = str(Path(__file__).resolve().parents[2])  # the directory holding replication/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _HELPER_BOOT, str(child.fileno())],
                pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self._ready, self._killed = False, False
        self._send(Init(dataclasses.asdict(self.settings)))

    def _send(self, msg: Message) -> None:
        assert self.conn is not None
        with self._send_lock:
            self.conn.send(msg)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def save(
        self, meta_bytes: bytes, step: int, shm_name: str | None, nbytes: int,
        stage: Callable[[], None] | None = None, *, offset: int = STAGE_HEADER,
        fd: int | None = None, key: str | None = None, verify: bool = False,
        live: list[str] | None = None,
    ) -> SaveResult:
        """Have the helper persist the ``nbytes`` at ``offset`` in shared memory: the
        named segment ``shm_name``, or the memfd ``fd`` (whose ``key`` names it in the
        helper's cache of mappings; the descriptor is sent along with the job).

        ``verify=True``: the bytes are a snapshot read in place (``meta_bytes`` is its own
        metadata) and the helper checks them against its digests before committing
        (:meth:`RankSaver.save`). ``live``: the keys (or names) of the shared buffers
        still in use; the helper unmaps any other it has mapped (a slot reallocated
        since), so their memory is freed.

        ``stage()`` fills the shared staging buffer, advancing its progress counter. Once
        the helper is up, it runs after the job is sent, while the helper is already
        writing (the helper waits wherever it catches up); while the helper is still
        starting, it runs first, so the caller's buffer is never held hostage by a slow
        start.
        Returns the helper's result; raises only what ``stage`` raises (after the job is
        abandoned).
        """
        rank = self.settings.rank
        try:
            if not self.alive:
                if self.proc is not None:
                    log.error("durable writer helper of rank %d had exited (code %s); "
                              "restarting it", rank, self.proc.returncode)
                    self._close_conn()
                self.start()
            if not self._ready and not self._poll_ready() and stage is not None:
                stage()
                stage = None
            if not self._ready:
                self._await(Ready, READY_TIMEOUT_S)
                self._ready = self.ever_ready = True
            self._job += 1
            job = self._job
            msg = Save(job=job, meta=meta_bytes, shm=shm_name or key, has_fd=fd is not None,
                       offset=offset, nbytes=nbytes, verify=verify,
                       progressive=stage is not None,
                       live=live if live is not None else [shm_name or key])
            assert self.conn is not None and self.proc is not None
            with self._send_lock:
                self.conn.send(msg)
                if fd is not None:  # the helper's reader takes it right after the job
                    reduction.send_handle(self.conn, fd, self.proc.pid)
            if stage is not None:
                try:
                    stage()
                except BaseException:
                    self._send(Abort(job))
                    self._await(Result, None)
                    raise
            return SaveResult(**self._await(Result, None).result)
        except (EOFError, OSError, HelperError) as exc:
            code = None
            if self.proc is not None:  # a helper that stopped talking is finished for good
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    code = self.proc.wait()
            self._close_conn()
            if self._killed:
                return SaveResult(step, rank, ABORTED, error="helper stopped by close()")
            return SaveResult(step, rank, FAILED,
                              error=f"writer helper process died (exit code {code}): {exc!r}")

    def wait_ready(self, timeout: float) -> bool:
        """Block until the helper is ready (it has imported torch and DCP), at most
        ``timeout`` seconds; False if it is not (then the first save waits as before).
        Call only while no save is in flight (the save path reads the same socket)."""
        if self._ready:
            return True
        deadline = time.monotonic() + timeout
        try:
            while not self._poll_ready():
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive:
                    return False
                assert self.conn is not None
                self.conn.poll(min(left, 0.1))
        except (EOFError, OSError):
            return False
        return True

    def _poll_ready(self) -> bool:
        """Handle what the helper has sent so far, without waiting; True once ready."""
        assert self.conn is not None
        while not self._ready and self.conn.poll(0):
            match self.conn.recv():
                case Log() as record:
                    log.log(record.level, "%s", record.message)
                case Ready():
                    self._ready = self.ever_ready = True
        return self._ready

    def _await(self, kind: type[M], timeout: float | None) -> M:
        """The next message of type ``kind`` (log records on the way are logged)."""
        assert self.conn is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise HelperError(
                    f"no {kind.kind()!r} from the writer helper within {timeout:.0f}s")
            msg = self.conn.recv()
            if isinstance(msg, Log):
                log.log(msg.level, "%s", msg.message)
            elif isinstance(msg, kind):
                return msg

    def abort_current(self) -> None:
        """Ask the helper to abandon the save in progress (later ones still run)."""
        try:
            self._send(Abort(self._job))
        except (OSError, AttributeError, AssertionError):
            pass

    def abort(self) -> None:
        """Ask the helper to abandon every save, the current one included (close)."""
        try:
            self._send(Abort(None))
        except (OSError, AttributeError, AssertionError):
            pass

    def kill(self) -> None:
        self._killed = True
        if self.alive:
            assert self.proc is not None
            self.proc.kill()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        try:
            self._send(Stop())
        except (OSError, AssertionError):
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
        self._close_conn()

    def _close_conn(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn, self._ready = None, False


# -- child side ---------------------------------------------------------------------------
class _Forward(logging.Handler):
    def __init__(self, send: Callable[[Message], None]) -> None:
        super().__init__(logging.INFO)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(Log(record.levelno, record.getMessage()))
        except Exception:  # the parent is gone: nothing to tell
            pass


class _Segments:
    """The training process's shared buffers, mapped once and kept mapped across saves
    (mapping and first-touching hundreds of MB costs milliseconds).

    Mapped with ``torch.from_file``: a mapping lives exactly as long as the tensors
    over it. A named segment is found in /dev/shm (its creator unlinks it); a memfd
    arrives as a descriptor with its job and is cached under its key (device and
    inode: our mapping keeps the file alive, so the key cannot be reused meanwhile).
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._maps: dict[str, Any] = {}

    def get(self, key: str, fd: int | None = None) -> Any:
        seg = self._maps.get(key)
        if seg is None:
            path = (f"/proc/self/fd/{fd}" if fd is not None
                    else os.path.join("/dev/shm", key.lstrip("/")))
            size = os.fstat(fd).st_size if fd is not None else os.stat(path).st_size
            seg = self._torch.from_file(path, shared=True, size=size,
                                        dtype=self._torch.uint8)
            self._maps[key] = seg
        return seg

    def keep_only(self, names: list[str]) -> None:
        for name in [n for n in self._maps if n not in names]:
            del self._maps[name]


@dataclass
class _Job:
    """A save as the helper runs it: the request, and its memfd once received."""

    save: Save
    fd: int | None = None
    error: str = ""  # why the memfd did not arrive


class _Control:
    """The helper's reader: queues saves and applies aborts as they arrive, from a
    thread of its own, so that an abort reaches the save in progress."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.jobs: queue.Queue[_Job | None] = queue.Queue()  # None: no more saves
        self.abort = threading.Event()  # set: abandon the current save
        self._lock = threading.Lock()
        self._current: int | None = None
        self._aborted: set[int] = set()
        self._closing = False

    def read(self) -> None:
        """Take messages until :class:`Stop` or the end of the socket."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the training process is gone
                self._on_gone()
                return
            match msg:
                case Save():
                    self._on_save(msg)
                case Abort():
                    self._on_abort(msg)
                case Stop():
                    self.jobs.put(None)
                    return

    def _on_save(self, msg: Save) -> None:
        job = _Job(msg)
        if msg.has_fd:  # its descriptor follows the job
            try:
                job.fd = reduction.recv_handle(self.conn)
            except (EOFError, OSError) as exc:
                job.error = repr(exc)
        self.jobs.put(job)

    def _on_abort(self, msg: Abort) -> None:
        with self._lock:
            if msg.job is None:
                self._closing = True
            else:
                self._aborted.add(msg.job)
            if msg.job is None or msg.job == self._current:
                self.abort.set()

    def _on_gone(self) -> None:
        with self._lock:
            self._closing = True
        self.abort.set()
        self.jobs.put(None)

    def begin(self, job: _Job) -> None:
        """Make ``job`` the current save; aborted already if it (or every save) was."""
        with self._lock:
            self._current = job.save.job
            if self._closing or job.save.job in self._aborted:
                self.abort.set()
            else:
                self.abort.clear()


def serve(conn: Connection) -> None:
    """The helper's main loop: start up, then run the saves one at a time, reporting
    each result, until the training process stops it or goes away."""
    send = _sender(conn)
    _forward_logs(send)
    try:
        os.nice(HELPER_NICE)
    except OSError:
        pass
    saver = _start_saver(conn)
    control = _Control(conn)
    threading.Thread(target=control.read, name="checkpointless-helper-reader",
                     daemon=True).start()
    send(Ready(os.getpid()))
    segments = _Segments()
    while (job := control.jobs.get()) is not None:
        control.begin(job)
        result = _run_save(saver, segments, job, control.abort)
        try:
            send(Result(result.to_json()))
        except OSError:
            break


def _sender(conn: Connection) -> Callable[[Message], None]:
    """``send(msg)``, safe from the log handler's threads as well as the main loop."""
    lock = threading.Lock()

    def send(msg: Message) -> None:
        with lock:
            conn.send(msg)

    return send


def _forward_logs(send: Callable[[Message], None]) -> None:
    """Send the helper's ``checkpointless.durable`` records to the training process."""
    logger = logging.getLogger("checkpointless.durable")
    logger.addHandler(_Forward(send))
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _start_saver(conn: Connection) -> RankSaver:
    """Take the :class:`Init` message, import torch and DCP, and build the saver."""
    init = conn.recv()
    assert isinstance(init, Init)
    import torch

    torch.set_num_threads(1)
    # torch.save's zip CRC32 is a third of the helper's CPU per byte. This process runs
    # no user code, so the global switch affects only our writes, and integrity is the
    # manifest's job (xxh3-128 of every file, and the snapshot digests of every segment);
    # torch.load does not check the zip CRC (see torch.serialization.set_crc32_options).
    if hasattr(torch.serialization, "set_crc32_options"):
        torch.serialization.set_crc32_options(False)
    import replication.durable.dcp_io  # noqa: F401  (DCP is slow to import: before ready)

    return RankSaver(SaverSettings(**init.settings))


def _run_save(
    saver: RankSaver, segments: _Segments, job: _Job, abort: threading.Event
) -> SaveResult:
    """Run one save; report any failure as its result, never die of it."""
    from replication.training_state.snapshot_meta import SnapshotMeta

    save = job.save
    meta = SnapshotMeta.from_bytes(save.meta)
    try:
        if job.error:
            raise HelperError(f"the snapshot's descriptor did not arrive: {job.error}")
        seg = segments.get(save.shm, job.fd)
        buf = seg[save.offset : save.offset + save.nbytes]
        wait = _staged_waiter(seg, abort) if save.progressive else None
        result = saver.save(meta, buf, abort, wait, verify=save.verify)
        del seg, buf, wait
    except BaseException as exc:  # report, never die silently
        result = SaveResult(meta.step, saver.rank, FAILED, error=repr(exc)[:400])
    if job.fd is not None:
        os.close(job.fd)  # the mapping, if any, keeps the memory
    segments.keep_only(save.live or [save.shm])
    if abort.is_set() and result.status == FAILED:
        result.status = ABORTED
    return result


def _staged_waiter(seg: Any, abort: threading.Event):
    """``wait(end)``: block until the training process has staged ``buf[:end]``
    (the staging segment's first 8 bytes count the bytes staged so far)."""
    import numpy as np

    from replication.durable.storage import SaveAborted

    counter = seg[:8].numpy().view(np.int64)

    def wait(end: int) -> None:
        while int(counter[0]) < end:
            if abort.wait(0.0005):
                raise SaveAborted("staging was abandoned")

    return wait


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # Its rank stops it (it exits when the rank's end of the pipe closes): a Ctrl-C
    # that reaches the whole process group must not print a traceback from here, and
    # the SIGTERM Slurm sends every process of a job step must not kill the save the
    # rank makes before it stops (recovery.runtime.drain).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get(contract.ENV_ON_SIGTERM) == "drain":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(args[0]))
    code = 0
    try:
        serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the training process went away (a SIGKILLed rank): nothing to report
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        conn.close()
        sys.stderr.flush()
        # Skip interpreter teardown: torch's can take seconds and nothing is left to do.
        os._exit(code)


if __name__ == "__main__":
    main()
