"""Spares and workers on a GPU host, checked on a CPU build with torch's CUDA entry points
stubbed: what the zygote must never do (initialise CUDA, start the autograd engine's
device threads), what it does when something else did (refuse to fork), what a spare
does after its fork (create its CUDA contexts), NCCL's error-handling mode in the
workers' environment, and which GPU the runtime's start gives a rank.

What only a real card shows (``make test-gpu``): that NVML answers the zygote's
availability check without loading the CUDA driver, that a forked spare's contexts and
cuBLAS handle work, and their memory cost.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import types

import pytest
import torch

from launcher import worker_env, zygote
from launcher.worker_env import JobEnv
from recovery.common.env import WorkerEnv
from recovery.process_group import device_placement
from tests.recovery_harness import REPO, clean_env

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="fork + subreaper: Linux")

#: Installed in every process of the e2e test through ``sitecustomize``: torch reports
#: two CUDA devices, and each CUDA entry point the warm-ups could reach writes one line
#: (its pid, what) to CUDA_STUB_LOG instead of touching a GPU.
CUDA_STUB = '''
import os
if os.environ.get("CUDA_STUB_LOG"):
    import contextlib, json
    import torch

    def _note(what, **fields):
        with open(os.environ["CUDA_STUB_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "what": what, **fields}) + "\\n")

    class _Stream:
        def is_capturing(self):
            return False

    def _stream(*_a, **_k):
        _note("current_stream")  # initialises CUDA in a real build
        return _Stream()

    def _capturing():
        _note("current_stream")
        return False

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 2
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    torch.accelerator.current_stream = _stream
    torch.cuda.current_stream = _stream
    torch.cuda.is_current_stream_capturing = _capturing
    torch.cuda._lazy_init = lambda: _note("cuda_init")
    _backward = torch.autograd.backward

    def _engine(*a, **k):
        _note("autograd_engine")  # counts devices with cudaGetDeviceCount on a GPU build
        return _backward(*a, **k)

    torch.autograd.backward = _engine

    @contextlib.contextmanager
    def _device(index):
        _note("device", index=index)
        yield

    torch.cuda.device = _device
    _ones = torch.ones

    def _cuda_ones(*a, device=None, **k):
        if device is not None and torch.device(device).type == "cuda":
            _note("tensor", index=torch.device(device).index)
            device = None
        return _ones(*a, device=device, **k)

    torch.ones = _cuda_ones
    torch.cuda.synchronize = lambda index=None: _note("synchronize", index=index)
    torch.cuda.empty_cache = lambda: None
'''

REPORT = '''
import json, os
with open(os.environ["OUT"], "w") as f:
    json.dump({"pid": os.getpid(),
               "nvml_check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")}, f)
'''

#: Plays the agent (a subreaper with a zygote): forks a spare and waits until it has
#: warmed CUDA, then forks a first worker and hands it its rank at once, then runs both.
DRIVER = '''
import json, os, sys, time
from launcher import reaper
from launcher.worker_procs import SparePool
from launcher.zygote import Zygote

log, script, out0, out1 = sys.argv[1:5]
events = []
assert reaper.become_subreaper()
z = Zygote(dict(os.environ), lambda event, **f: events.append([event, f]))
z.start()
deadline = time.monotonic() + 120
while not z.ready(wait_s=0.1):
    assert time.monotonic() < deadline, "the zygote never got ready"


def warmed(pid):
    if not os.path.exists(log):
        return False
    notes = [json.loads(line) for line in open(log).read().splitlines()]
    return any(n["pid"] == pid and n["what"] == "synchronize" for n in notes)


spare = z.fork_spare()
deadline = time.monotonic() + 45
while not warmed(spare.pid) and spare.poll() is None and time.monotonic() < deadline:
    time.sleep(0.1)
first = z.fork_spare()
assert SparePool.assign(first, {"RANK": "1", "OUT": out1}, [script], False)
assert SparePool.assign(spare, {"RANK": "0", "OUT": out0}, [script], False)
codes = [p.wait(timeout=120) for p in (spare, first)]
errs = [p.stderr.read().decode(errors="replace")[-2000:] for p in (spare, first)]
zpid = z.proc.pid
z.stop()
print(json.dumps({"zygote": zpid, "spare": spare.pid, "first": first.pid, "codes": codes,
                  "stderr": errs, "events": [e for e, _ in events]}))
'''


@linux_only
def test_a_fork_after_the_warm_up_with_cuda_reported_as_available(tmp_path):
    """The zygote warms up on a build that reports two CUDA devices: nothing in it
    initialises CUDA or starts the autograd engine, so it forks; the spare then creates
    a context on each device while it waits; a first worker, assigned at once, does not;
    both run their ranks with the job's own availability check back."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "sitecustomize.py").write_text(CUDA_STUB)
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    log, outs = tmp_path / "cuda.log", [tmp_path / "r0.json", tmp_path / "r1.json"]
    env = clean_env()
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    env.pop("LOCAL_WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(stubs), env["PYTHONPATH"]])
    env["CUDA_STUB_LOG"] = str(log)
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(log), str(script),
                           *map(str, outs)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    notes = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by_pid: dict[int, list] = {}
    for note in notes:
        by_pid.setdefault(note["pid"], []).append((note["what"], note.get("index")))
    assert by_pid.get(out["zygote"]) is None, by_pid  # no CUDA call, no autograd engine
    assert "zygote_failed" not in out["events"]  # so the fork was allowed
    assert out["codes"] == [0, 0], out["stderr"]
    spare_calls = by_pid.get(out["spare"], [])
    assert ("cuda_init", None) in spare_calls, by_pid
    for index in (0, 1):  # a context and a cuBLAS handle on each device it may take
        assert ("device", index) in spare_calls and ("synchronize", index) in spare_calls
    assert not [c for c in by_pid.get(out["first"], []) if c[0] == "synchronize"]
    assert set(by_pid) <= {out["spare"], out["first"]}, by_pid
    for path, pid in zip(outs, (out["spare"], out["first"])):
        report = json.loads(path.read_text())
        assert report["pid"] == pid and report["nvml_check"] is None


@linux_only
def test_a_zygote_with_cuda_initialised_refuses_to_fork_and_says_so_once(monkeypatch):
    """If something the zygote imported initialised CUDA, a fork could not use the GPU:
    the zygote answers with an error instead of forking, the agent records one
    ``zygote_failed`` (the pool then starts new interpreters)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)

    def no_fork() -> int:
        raise AssertionError("forked with CUDA initialised")

    monkeypatch.setattr(os, "fork", no_fork)
    events: list[tuple[str, dict]] = []
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent_side = zygote.Zygote({}, lambda event, **f: events.append((event, f)))
    agent_side._sock, agent_side._ready = ours, True
    served: list[object] = []

    def serve_one() -> None:
        _data, fds, _flags, _addr = socket.recv_fds(theirs, 4096, 3)
        try:
            served.append(zygote._fork_spare(theirs, fds))
        except BaseException as exc:  # reported by the assertion below
            served.append(exc)
        finally:
            for fd in fds:
                os.close(fd)

    thread = threading.Thread(target=serve_one)
    thread.start()
    with pytest.raises(zygote.ZygoteError, match="CUDA is initialised"):
        agent_side.fork_spare()
    thread.join(10)
    assert served == [None]  # no fork
    assert [e for e, _ in events] == ["zygote_failed"] and not agent_side.usable
    assert "new interpreters" in events[0][1]["reason"]
    theirs.close()
    agent_side.stop()


# --- NCCL's watchdog ---------------------------------------------------------------------
#: torch's name for the watchdog's mode, and its older one (still read).
NCCL_ERROR_HANDLING_VARS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


def _job() -> JobEnv:
    return JobEnv(store_host="127.0.0.1", store_port=29500, nproc=2, nnodes=1, node=0,
                  run_id="job", max_restarts=3, run_dir="/tmp/run", config_json="{}")


def test_workers_get_an_nccl_error_mode_that_never_kills_a_survivor(monkeypatch, capsys):
    monkeypatch.setattr(worker_env, "_warned_tear_down", False, raising=False)
    env = _job().base(environ={})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort the communicator only
    assert "NCCL_ASYNC_ERROR_HANDLING" not in env
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", NCCL_ERROR_HANDLING_VARS)
def test_a_users_nccl_error_mode_is_kept_and_tear_down_warned_once(monkeypatch, capsys, name):
    monkeypatch.setattr(worker_env, "_warned_tear_down", False, raising=False)
    for _ in range(2):
        env = _job().base(environ={name: "1"})
        assert env[name] == "1"
        assert set(NCCL_ERROR_HANDLING_VARS) & set(env) == {name}
    err = capsys.readouterr().err
    assert err.count(f"{name}=1") == 1 and "recover" in err
    env = _job().base(environ={name: "0"})  # no handling at all: kept, kills nobody
    assert env[name] == "0"
    assert capsys.readouterr().err == ""


# --- which GPU a rank gets -----------------------------------------------------------------
class _Cuda:
    """torch.cuda's answers on a host with ``count`` GPUs, and the calls made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 4,
                 initialised: bool = False, current: int = 0) -> None:
        self.set: list[int] = []
        self.deferred: list = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set.append)
        monkeypatch.setattr(torch.cuda, "_lazy_call", self.deferred.append)

    def initialise(self) -> None:
        """What CUDA's initialisation does with the calls queued before it."""
        for call in self.deferred:
            call()


class _Placed(Exception):
    pass


def test_the_runtimes_start_puts_a_rank_on_its_local_ranks_gpu(monkeypatch, tmp_path):
    """A replacement gets the dead rank's LOCAL_RANK: the runtime's start, before
    anything else, makes ``cuda:(LOCAL_RANK % device_count)`` the current device (when
    CUDA initialises, so that nothing before it ran on another GPU)."""
    from recovery.runtime.checkpointless import Checkpointless

    cuda = _Cuda(monkeypatch, count=4)

    def deferred(call) -> None:
        cuda.deferred.append(call)
        raise _Placed  # stop the start here: the placement is all this test needs

    monkeypatch.setattr(torch.cuda, "_lazy_call", deferred)
    env = WorkerEnv(rank=7, world_size=8, local_rank=7, local_world_size=4, node=1,
                    store_addr=None, run_dir=str(tmp_path), heartbeat_file=None, job_id="j",
                    replacement=True, config_json=None)
    with pytest.raises(_Placed):
        Checkpointless(model=torch.nn.Linear(2, 2), env=env, start=False)
    cuda.initialise()
    assert cuda.set == [3]


def test_placement_is_immediate_where_cuda_is_initialised_at_the_default_device(monkeypatch):
    cuda = _Cuda(monkeypatch, count=2, initialised=True, current=0)  # e.g. a warm spare
    assert device_placement.place(3) == 1
    assert cuda.set == [1] and not cuda.deferred


@pytest.mark.parametrize("local_rank", [0, 2])
def test_device_zero_needs_no_call(monkeypatch, local_rank):
    cuda = _Cuda(monkeypatch, count=2)
    assert device_placement.place(local_rank) == 0
    assert not cuda.set and not cuda.deferred  # CUDA stays uninitialised


def test_a_scripts_own_choice_stands(monkeypatch):
    cuda = _Cuda(monkeypatch, count=4, initialised=True, current=2)  # set_device(2)
    assert device_placement.place(1) is None
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    model = types.SimpleNamespace(parameters=lambda: iter([on_gpu]), buffers=lambda: iter([]))
    cuda = _Cuda(monkeypatch, count=4)
    assert device_placement.place(1, model) is None  # its model already lives on a GPU
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("cuda", 3))
    assert device_placement.place(1) is None
    assert not cuda.set and not cuda.deferred


@pytest.mark.parametrize("count", [0, 1])
def test_nothing_to_choose_without_cuda_or_with_one_visible_device(monkeypatch, count):
    cuda = _Cuda(monkeypatch, count=count)
    assert device_placement.place(5) is None
    assert not cuda.set and not cuda.deferred


def test_init_process_group_under_the_launcher_places_the_rank_before_the_model_moves(
        monkeypatch):
    """Scripts call ``init_process_group`` and then move their model to ``cuda``: the
    wrapped call chooses LOCAL_RANK's GPU first, or the ``device_id`` the script names."""
    from recovery.process_group import init_hook

    cuda = _Cuda(monkeypatch, count=4)
    placed: list[int] = []

    def stop(local_rank: int, model=None) -> None:
        placed.append(local_rank)
        raise _Placed

    monkeypatch.setattr(device_placement, "place", stop)
    env = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    with pytest.raises(_Placed):
        init_hook.join_default_group(6, 8, {"cpu": "gloo"}, None, env=env)
    assert placed == [2]

    def stop_at_set(index) -> None:
        cuda.set.append(index)
        raise _Placed

    monkeypatch.setattr(torch.cuda, "set_device", stop_at_set)
    with pytest.raises(_Placed):
        init_hook.join_default_group(6, 8, {"cpu": "gloo"}, None, env=env,
                                        device_id=torch.device("cuda", 1))
    assert cuda.set == [torch.device("cuda", 1)] and placed == [2]


def test_a_frameworks_own_placement_stands_even_on_device_zero(monkeypatch):
    """Lightning's ``Trainer(devices=[1, 0])`` puts local rank 1 on ``cuda:0``: the
    strategy says so (``device_placement.chosen``) and the runtime's start keeps it."""
    cuda = _Cuda(monkeypatch, count=2, initialised=True, current=0)
    monkeypatch.setattr(device_placement, "_framework_choice", None)
    assert device_placement.place(1) == 1  # nobody chose: LOCAL_RANK's GPU
    cuda.set.clear()
    device_placement.chosen(0)
    assert device_placement.place(1) is None
    assert not cuda.set
