"""A warm spare: a Python process that has already paid for its imports, waiting for a rank.

Started by the agent as ``python -u -m launcher.spare`` with the job-wide environment
(no rank). It imports torch, torch.distributed and the runtime packages, then blocks
on ONE JSON line from stdin::

    {"env": {...}, "argv": ["train.py", "--lr", "1"], "module": false}

Meanwhile it imports whatever this job's workers asked spares to warm (``<run_dir>/warm``,
see :func:`warm_job_modules`). On receipt it applies ``env``, sets ``sys.argv`` and runs
the script as ``__main__``
exactly as ``python -u train.py`` would (the script's directory first on
``sys.path``), so the replacement skips interpreter start-up and ``import torch``.
The exit status is the script's: ``SystemExit`` codes are kept and an uncaught
exception prints its traceback and exits 1, as Python itself does.

``python -m launcher.spare --run [-m] SCRIPT ARGS`` is the bootstrap of a *fresh* worker:
the same hooks and the same way of running the script, without warm-up or waiting.

A spare warms up and waits at a lower CPU priority, back to the job's own the moment
its assignment arrives (:class:`WarmUpPriority`). A spare prints nothing until
assigned. EOF on stdin (the agent went away or is shutting the pool down) makes it exit
0 quietly, so spares never outlive their agent.

Caveat: variables read only at import time (anything consumed by ``import torch``
itself) come from the job-wide environment, never from the rank's. So do those CUDA
reads when it initialises (``CUDA_VISIBLE_DEVICES``), because a waiting spare
initialises CUDA (:func:`warm_cuda`): a script that changes them itself before its
first CUDA call needs ``CHECKPOINTLESS_SPARE_CUDA=off``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import resource
import runpy
import signal
import sys
import threading
import time
import warnings
from typing import NoReturn

from launcher.sigint_hold import release_sigint
from replication import contract

SPARE_NICE = 10  # added to the nice value while warming up and waiting (see WarmUpPriority)

#: Imported before waiting; failures are ignored (a spare that cannot warm a package
#: still saves the interpreter start, and the script will report the real error).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "replication",
    "recovery",
    "recovery.runtime.checkpointless",
    "dataloader_cache",
)


def warm_up(extra: tuple[str, ...] = ()) -> None:
    """Import what a worker will need (``extra``: the frameworks its script imports,
    see :mod:`launcher.script_imports`), silently: a spare prints nothing until
    assigned."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (*WARM_MODULES, *extra):
            try:
                importlib.import_module(name)
            except Exception:
                continue
        try:
            _exercise_torch()
        except Exception:
            pass


def _exercise_torch() -> None:
    """Run a tiny training step so torch's lazy imports happen now, not after assignment.

    The first optimizer built in a process imports torch's compile machinery (over a
    second of CPU here); a replacement would otherwise pay it on the recovery path.
    Torch's default generator is left as a fresh process has it.
    """
    import torch

    rng = torch.get_rng_state()
    try:
        _one_step(torch)
    finally:
        torch.set_rng_state(rng)


def _one_step(torch) -> None:
    """A forward pass and each optimizer's step, reaching no GPU call, because the
    zygote forks after it (:mod:`launcher.zygote`): on a GPU build with a device

    - ``backward()`` would start the autograd engine's per-device threads, counting the
      devices with ``cudaGetDeviceCount`` (which initialises the CUDA driver), and
      torch marks every process forked after that unable to run autograd at all;
      the gradients are set directly instead;
    - ``step()`` of Adam and AdamW runs a CUDA-graph capture health check that asks for
      the current CUDA stream, which initialises CUDA; it is skipped here (nothing is
      captured in a warm-up).
    """
    model = torch.nn.Linear(4, 4)
    for opt_cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        opt = opt_cls(model.parameters(), lr=0.1)
        for name in _CAPTURE_CHECKS:
            if hasattr(opt, name):
                setattr(opt, name, _no_capture_check)  # this instance only
        with torch.no_grad():
            model(torch.randn(2, 4))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()


#: The optimizer's CUDA-graph capture check, by its names across torch versions.
_CAPTURE_CHECKS = ("_accelerator_graph_capture_health_check",
                   "_cuda_graph_capture_health_check")


def _no_capture_check() -> None:
    return None


#: ``CHECKPOINTLESS_SPARE_CUDA``: what a waiting spare prepares on the GPU (see
#: :func:`warm_cuda`): ``contexts`` (the default), ``runtime`` or ``off``.
SPARE_CUDA_ENV = "CHECKPOINTLESS_SPARE_CUDA"
SPARE_CUDA_MODES = ("contexts", "runtime", "off")
#: A forked process assigned within this many seconds is a first worker, not a spare
#: (the agent forks first workers and hands them their rank at once): it skips
#: :func:`warm_cuda`, whose contexts on every device it would keep for its whole life.
CUDA_WARM_GRACE_S = 2.0


def warm_cuda(mode: str | None = None) -> list[int]:
    """Prepare the GPU while waiting, so that a replacement pays for none of it; returns
    the devices that got a context. Never raises: a spare that cannot warm the GPU still
    saves the imports, and the script reports the real error.

    A spare does not know which local rank it will replace, and the runtime places a
    rank on ``cuda:(LOCAL_RANK % device_count)`` (:mod:`recovery.process_group.device_placement`),
    so
    each mode prepares every device up to ``LOCAL_WORLD_SIZE``:

    - ``contexts`` (default): initialise torch's CUDA state (the driver, its device
      list), then on each such device create the primary context and a cuBLAS handle
      with its workspace (a 16 x 16 matmul, which also loads one GEMM kernel), and put
      the current device back to 0, as a fresh process has it. GPU memory: per spare
      and per device, one CUDA context (typically a few hundred MiB with lazy module
      loading, torch's default) plus the cuBLAS workspace (tens of MiB); the allocator's
      cached block is released. A replacement keeps the contexts on the other devices
      for its life: torch cannot release a primary context.
    - ``runtime``: torch's CUDA state and the driver only (torch's initialisation
      creates no context): no GPU memory; the replacement still creates its context
      and cuBLAS handle.
    - ``off``: nothing (as before; also right for a script that sets
      ``CUDA_VISIBLE_DEVICES`` itself before its first CUDA call, which an initialised
      runtime no longer reads).
    """
    mode = mode or os.environ.get(SPARE_CUDA_ENV, "contexts").strip().lower()
    if mode not in SPARE_CUDA_MODES or mode == "off":
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        torch.cuda.init()
        if mode == "runtime":
            return []
        count = torch.cuda.device_count()
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local_world.isdigit() and int(local_world) > 0:
            count = min(count, int(local_world))
        warmed = []
        for index in range(count):
            with torch.cuda.device(index):  # restores the previous device (0) after
                x = torch.ones(16, 16, device=torch.device("cuda", index))
                torch.mm(x, x)
                torch.cuda.synchronize(index)
            warmed.append(index)
        torch.cuda.empty_cache()
        return warmed
    except Exception:
        return []


def install_worker_hooks() -> None:
    """Import hooks every worker needs before its script runs (fresh or spare).

    - ``torch.distributed.init_process_group`` builds the runtime's own process group
      (:func:`recovery.process_group.init_hook.install_init_hook`), whatever backend the script
      names, so DDP, FSDP2 and the script's own collectives survive recoveries;
    - ``Trainer(strategy="checkpointless")`` registers itself the moment the script
      imports Lightning (:mod:`recovery.integrations.autoload`), so scripts need no import.
    """
    from recovery.process_group import init_hook

    init_hook.install_init_hook()
    try:
        from recovery.integrations import autoload

        autoload.install()
    except Exception:
        pass  # the script reports its own errors; a missing hook only loses the shortcut


def _importable_name(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def warm_job_modules(stop: threading.Event, poll_s: float = 0.5) -> None:
    """Import the modules this job's workers asked spares to warm, until assigned.

    A worker that uses a heavy framework (Lightning) drops one empty file per module
    under ``<run_dir>/warm/``; a spare imports them in the background, so a replacement
    does not pay that import on the recovery path, while spares of other jobs never do.
    """
    run_dir = os.environ.get(contract.ENV_RUN_DIR)
    if not run_dir:
        return
    seen: set[str] = set()
    while not stop.is_set():
        import_job_modules(seen, stop)
        stop.wait(poll_s)


def import_job_modules(seen: set[str], stop: threading.Event | None = None) -> None:
    """One pass of :func:`warm_job_modules`: import the names not in ``seen`` yet."""
    run_dir = os.environ.get(contract.ENV_RUN_DIR)
    if not run_dir:
        return
    try:
        names = sorted(set(os.listdir(os.path.join(run_dir, "warm"))) - seen)
    except OSError:
        return
    for name in names:
        seen.add(name)
        if (stop is not None and stop.is_set()) or not _importable_name(name):
            continue
        try:
            importlib.import_module(name)
        except Exception:
            continue


def run_fresh(argv: list[str]) -> None:
    """``python -m launcher.spare --run [-m] SCRIPT ARGS``: a fresh worker's bootstrap.

    Installs :func:`install_worker_hooks`, then runs the script exactly as a spare runs
    its assignment (and as ``python -u SCRIPT`` would), so fresh and warm workers start
    the same way.
    """
    module = bool(argv) and argv[0] == "-m"
    argv = argv[1:] if module else argv
    if not argv:
        raise SystemExit("usage: python -m launcher.spare --run [-m] SCRIPT [ARGS...]")
    install_worker_hooks()
    run_assigned({"env": {}, "argv": argv, "module": module})


def wait_for_assignment() -> dict | None:
    """Block until the agent sends the rank's JSON line; None on EOF."""
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return None
    return json.loads(line)


def detach_stdin() -> None:
    """After the assignment, stdin is ``/dev/null`` like any other worker's."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


class WarmUpPriority:
    """A lower CPU priority (nice +10) while the spare warms up and waits.

    A spare's ``import torch`` and warm-up step cost seconds of CPU, and spares start
    with the job and again after every replacement, when the host is busiest. Waiting
    is background work, so it should yield to training. But once assigned, the spare
    is a training rank and must run at the job's priority again. Raising a priority
    needs ``CAP_SYS_NICE`` or a high enough ``RLIMIT_NICE``. Without one, the spare
    keeps its priority: a slow warm-up is better than a slow rank.

    On Linux the nice value is per thread, and threads inherit it (torch's intra-op pool
    starts during the warm-up step), so :meth:`restore` resets every thread.
    """

    def __init__(self, nice: int = SPARE_NICE) -> None:
        self.nice = nice
        self.orig = os.getpriority(os.PRIO_PROCESS, 0)
        self.active = False

    def can_restore(self) -> bool:
        if os.geteuid() == 0:
            return True
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
        # RLIMIT_NICE lets a thread lower its nice value down to 20 - limit.
        return soft == resource.RLIM_INFINITY or 20 - self.orig <= soft

    def lower(self) -> None:
        if self.nice <= 0 or not self.can_restore():
            return
        try:
            os.setpriority(os.PRIO_PROCESS, 0, min(19, self.orig + self.nice))
            self.active = True
        except OSError:
            pass

    def restore(self) -> None:
        """Every thread back to the original priority. Called by the assignment watcher
        and again by the main thread once warm-up has ended, for threads started in
        between."""
        if not self.active:
            return
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, tid, self.orig)


class _AssignmentWatch:
    """Reads the assignment on its own thread while the main thread warms up. It
    restores the priority the moment the line arrives, so a spare that is taken while
    still importing torch finishes at the job's priority."""

    def __init__(self, priority: WarmUpPriority) -> None:
        self._priority = priority
        self._done = threading.Event()
        self._value: dict | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._read, daemon=True, name="spare-assignment").start()

    def _read(self) -> None:
        try:
            self._value = wait_for_assignment()
        except BaseException as exc:  # handed to the main thread
            self._error = exc
        finally:
            self._priority.restore()
            self._done.set()

    def arrived(self, wait_s: float) -> bool:
        """Whether the assignment (or EOF) has come, waiting up to ``wait_s`` (in
        slices, as :meth:`result` waits)."""
        deadline = time.monotonic() + wait_s
        while not self._done.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return False
        return True

    def result(self) -> dict | None:
        while not self._done.wait(0.5):  # slices: Ctrl-C must reach the main thread
            pass
        if self._error is not None:
            raise self._error
        return self._value


#: The conventional exit status of a command-line usage error (argparse, getopt).
USAGE_EXIT = 2


def run_assigned(assignment: dict) -> None:
    """:func:`_run_assigned`, noting the status of a ``SystemExit`` that ends it for the
    runtime's exit guard (:func:`recovery.process_group.training_groups.note_exit`)."""
    try:
        _run_assigned(assignment)
    except SystemExit as exc:
        from recovery.process_group import training_groups

        training_groups.note_exit(exc.code)
        raise


def _run_assigned(assignment: dict) -> None:
    """Run the rank's script as ``python [-m] SCRIPT ARGS`` would. An exception that
    escapes it before this process completed a training step (a bad import, a typo, a
    missing file) stops the whole job with one line (:mod:`recovery.faults.user_errors`): a
    replacement would fail the same way, so it is never retried."""
    os.environ.update({str(k): str(v) for k, v in assignment["env"].items()})
    argv = [str(a) for a in assignment["argv"]]
    sys.argv = argv
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as `python SCRIPT` has it
        release_sigint()
        if os.environ.get(contract.ENV_ON_SIGTERM) == "drain":
            # Slurm signals every process of the step (scancel, preemption); the agent
            # decides and asks for the drain (recovery.runtime.drain). SIG_IGN is inherited by
            # what the script starts (the durable writer's helper, loader workers).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _run_in_current_world(argv, bool(assignment.get("module")))
    except SystemExit as exc:
        from recovery.faults import user_errors

        # A usage error (exit status 2: argparse, getopt) or an exit with a message
        # (sys.exit("bad config")) before the first step would happen again in a
        # replacement. Other codes keep torchrun's meaning: a crashed worker, replaced.
        usage = exc.code == USAGE_EXIT or isinstance(exc.code, str)
        if not usage or user_errors.first_step_done():
            raise
        user_errors.stop_before_first_step(exc)
    except KeyboardInterrupt:
        _interrupted()
    except Exception as exc:
        from recovery.common.causes import FailureCause, classify
        from recovery.common.errors import Fenced, RecoveryImpossible
        from recovery.faults import user_errors

        if isinstance(exc, RecoveryImpossible):
            # The runtime's verdict, recorded as the job's fatal reason: the agents print
            # it in one line, and a repeated bug's traceback was printed once already.
            # Python's report of it escaping the script would repeat both. One raised
            # where the runtime did not record it (a tracked loader's) is recorded here.
            user_errors.record_verdict(exc)
            raise SystemExit(contract.EXIT_FAILED) from None
        # A failure elsewhere (a peer killed while this rank waited in DDP's set-up
        # broadcast) is the job's failure to recover from, not the script's.
        if (user_errors.first_step_done() or isinstance(exc, Fenced)
                or classify(exc, lambda: False) is FailureCause.PEER_FAILURE):
            raise
        user_errors.stop_before_first_step(exc)


def _run_in_current_world(argv: list[str], module: bool) -> None:
    """Run the script at this process's rank in the job's current world, and again
    each time the world changes under it (a shrink: :mod:`recovery.resize.world_resize`)."""
    from recovery.generation import world
    from recovery.resize import world_resize

    while True:
        try:
            world_resize.enter_current_world(os.environ)
        except world.RetiredSlot as exc:  # its node was lost and the job went on without it
            print(f"checkpointless: {exc}", file=sys.stderr, flush=True)
            os._exit(contract.EXIT_FENCED)
        sys.argv = list(argv)
        try:
            if module:
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
                return
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
            return
        except world_resize.WorldResized:
            pass
        world_resize.after_script()  # out of the except block: its traceback is gone


def _interrupted() -> NoReturn:
    """Ctrl-C reached the script (the terminal signals the whole process group) and
    the script did not handle it: leave quietly with 130, as a shell reports it. The
    agent prints the one line for its node; a traceback per rank only repeats it, and a
    second Ctrl-C during interpreter teardown printed "lost sys.stderr" dumps. The exit
    skips teardown (gloo's destructors can block); the user's own ``finally`` blocks and
    ``except KeyboardInterrupt`` handlers have run by now."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(contract.EXIT_INTERRUPTED)


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        try:
            release_sigint()
            run_fresh(sys.argv[2:])
        except KeyboardInterrupt:  # during the bootstrap's imports, before the script
            _interrupted()
        return 0
    return serve()


def serve() -> int:
    """A spare's life: warm up (nearly free in a spare the zygote forked, which
    inherits its imports), prepare the GPU once it is clearly a spare (:func:`warm_cuda`:
    after the fork, never in the zygote) and wait below the job's priority; run the
    rank at it."""
    priority = WarmUpPriority()
    priority.lower()
    stop = threading.Event()
    incoming = _AssignmentWatch(priority)
    try:
        release_sigint()
        install_worker_hooks()
        warm_up()
        threading.Thread(target=warm_job_modules, args=(stop,), daemon=True,
                         name="spare-warm").start()
        if not incoming.arrived(CUDA_WARM_GRACE_S):  # a spare, not a first worker
            warm_cuda()
        assignment = incoming.result()
    except KeyboardInterrupt:
        return contract.EXIT_INTERRUPTED
    finally:
        stop.set()
        priority.restore()
    if assignment is None:
        return 0
    detach_stdin()
    run_assigned(assignment)  # SystemExit and exceptions propagate as in `python script`
    return 0


if __name__ == "__main__":
    sys.exit(main())
