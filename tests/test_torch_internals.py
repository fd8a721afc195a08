"""The private torch APIs checkpointless reaches into, one focused test each: used as the
project uses it, each fails (never skips or falls back) where the API moved or changed,
and its docstring names the project module that breaks, and how. Only NCCL/CUDA-build
checks skip. Groups are single-process gloo over a ``HashStore``, destroyed after use."""

from __future__ import annotations

import ast
import contextlib
import datetime
import functools
import inspect
import itertools
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.utils as dist_utils
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from launcher.spare import _CAPTURE_CHECKS
from recovery.loader import loader_position
from recovery.process_group import controller, ddp_layout, nccl_inner
from recovery.process_group.ordered_sum import rank_ordered_sum
from recovery.process_group.owned_group import ElasticProcessGroup, is_owned
from recovery.process_group.training_groups import _reset_fsdp_root
from recovery.process_group.works import _Op, _Work
from recovery.resize import reshard
from replication.durable.format import load_dcp_metadata
from replication.side_channel.abortable_gloo import AbortableGloo
from replication.side_channel.interruptible_store import StoreWaitInterrupted
from tests.helpers.mp import REPO

pytestmark = [pytest.mark.compat, pytest.mark.timeout(240)]

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture
def gloo_world() -> Iterator[None]:
    """A single-process gloo default group, destroyed afterwards."""
    assert not dist.is_initialized(), "a default process group was left by another test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=TIMEOUT)
    try:
        yield
    finally:
        dist.destroy_process_group()

class _Recording(ElasticProcessGroup):
    """The owned group, noting each collective reaching its dispatch (``_run``); with
    ``hang``, one stays pending (a dead peer) until a failure is declared 50 ms later."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []
        self.hang = False

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(sys._getframe(1).f_code.co_name)  # the collective's method
        if not self.hang:
            return super()._run(*args, **kwargs)
        op = _Op()
        with self._lock:
            self._pending.add(op)
        threading.Timer(0.05, self._controller.fail, ("probe failure",)).start()
        return _Work(op)

_backend_names = itertools.count()

@contextlib.contextmanager
def owned_world() -> Iterator[tuple[controller.Controller, list[dict[str, Any]]]]:
    """The default group as recovery/process_group/training_groups.py makes it
    (``Controller.create``
    as an extended-API backend; generation 0 over gloo), with a fresh Controller. Yields
    it and, per creator call, the ``_DistributedBackendOptions`` fields torch passed."""
    assert not dist.is_initialized(), "a default process group was left by another test"
    ctl = controller.Controller()
    ctl.configure(dist.HashStore(), TIMEOUT.total_seconds(), {"cpu": "gloo"})
    seen: list[dict[str, Any]] = []

    def create(opts: Any, backend_options: Any = None) -> ElasticProcessGroup:
        seen.append({"rank": opts.group_rank, "size": opts.group_size, "id": opts.group_id,
                     "ranks": list(opts.global_ranks_in_group), "timeout": opts.timeout})
        return ctl.create(opts, backend_options)

    name = f"clcompat{next(_backend_names)}"
    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu", "cuda"])
    real, controller.ElasticProcessGroup = (
        controller.ElasticProcessGroup, _Recording)
    try:
        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=TIMEOUT)
        ctl.activate(0)
        yield ctl, seen
    finally:
        controller.ElasticProcessGroup = real
        if dist.is_initialized():
            dist.destroy_process_group()

def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter at the repository root."""
    return subprocess.run([sys.executable, "-u", "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))

def _same_grads(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))

def test_owned_backend_plugin_options_world_and_new_group() -> None:
    """recovery/process_group/controller.py, elastic_init.py: ``Backend.register_backend(extended_
    api=)``, ``_plugins``, ``_DistributedBackendOptions``, a Python group kept as WORLD,
    ``new_group(backend=None, pg_options=)`` inheriting it. Else no owned group at all."""
    assert dist.new_group is dist.distributed_c10d.new_group
    assert dist.init_process_group is dist.distributed_c10d.init_process_group
    params = inspect.signature(dist.distributed_c10d.new_group).parameters
    assert {"backend", "pg_options", "ranks"} <= set(params)
    with owned_world() as (_ctl, seen):
        plugin = dist.Backend._plugins[dist.get_backend().upper()]
        assert plugin.extended_api is True and callable(plugin.creator_fn)
        world = dist.group.WORLD
        assert isinstance(world, _Recording) and is_owned(world)
        assert dist.distributed_c10d._get_default_group() is world
        assert (seen[0]["rank"], seen[0]["size"], seen[0]["timeout"]) == (0, 1, TIMEOUT)
        assert isinstance(seen[0]["id"], str) and seen[0]["ranks"] in ([], [0])
        group = dist.new_group(ranks=[0], backend=None)
        assert is_owned(group) and group is not world and seen[-1]["ranks"] == [0]
        dist.all_reduce(torch.ones(3), group=group)
        assert group.calls == ["allreduce"]

def test_public_collectives_reach_the_owned_groups_python_methods() -> None:
    """recovery/process_group/owned_group.py: ``dist.*`` collectives (and ``_coalescing_manager``)
    call the Python group's methods by its names, with options it reads (``reduceOp``:
    AVG on gloo). Else they fail ("not implemented") or escape the failure handling."""
    problems = []
    with owned_world():
        world, t, six = dist.group.WORLD, torch.arange(4.0), torch.tensor([6.0])
        out, outs, objs, a, b = torch.empty(4), [torch.empty(4)], [None], *torch.empty(2, 4)

        def coalesced() -> None:
            with dist._coalescing_manager(async_ops=True) as cm:
                dist.all_gather_into_tensor(a, t)
                dist.all_gather_into_tensor(b, t * 2)
            cm.wait()
        cases: dict[str, Callable[[], Any]] = {
            "all_reduce": lambda: dist.all_reduce(t),
            "all_reduce AVG": lambda: dist.all_reduce(six, op=dist.ReduceOp.AVG),
            "broadcast": lambda: dist.broadcast(t, 0),
            "all_gather": lambda: dist.all_gather(outs, t),
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, t * 2),
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out, t * 3),
            "all_to_all_single": lambda: dist.all_to_all_single(out, t * 4),
            "all_to_all": lambda: dist.all_to_all(outs, [t * 5]),
            "reduce": lambda: dist.reduce(t, 0),
            "gather": lambda: dist.gather(t * 6, outs, 0),
            "scatter": lambda: dist.scatter(out, [t * 7], 0),
            "barrier": dist.barrier,
            "all_gather_object": lambda: dist.all_gather_object(objs, 3),
            "coalesced": coalesced}
        gathered = torch.empty(4)
        if hasattr(dist, "gather_single"):  # torch >= 2.15
            cases["gather_single"] = lambda: dist.gather_single(t * 8, gathered, dst=0)
        for what, call in cases.items():
            world.calls.clear()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)  # renamed aliases
                    call()
            except Exception as exc:  # collected: every collective reported at once
                problems.append(f"{what}: {type(exc).__name__}: {exc}"[:300])
            if not world.calls:
                problems.append(f"{what}: reached none of the group's Python methods")
        got = [t, six, outs[0], out, torch.tensor(objs), torch.cat([a, b])]
        want = [torch.arange(4.0), torch.tensor([6.0]), t * 6, t * 7, torch.tensor([3]),
                torch.cat([t, t * 2])]
        if "gather_single" in cases:
            got, want = [*got, gathered], [*want, t * 8]
        problems += [f"got {g}, not {w}" for g, w in zip(got, want) if not torch.equal(g, w)]
    assert not problems, "\n".join(problems)

def _ddp_probe() -> None:
    """For the test below (a subprocess: a regression may segfault). Prints outcomes."""
    with owned_world():
        world, ddp, ref, x = dist.group.WORLD, DDP(_mlp()), _mlp(), torch.randn(5, 8)
        print("BUILT", {"allgather", "broadcast"} <= set(world.calls), world.calls)
        world.calls.clear()
        ddp(x).sum().backward()
        ref(x).sum().backward()
        print("REDUCED", "allreduce" in world.calls and _same_grads(ddp.module, ref))
        world.hang = True
        for what, call in (("DDP", lambda: ddp(x).sum().backward()),
                           ("BLOCKING", lambda: dist.all_reduce(torch.ones(4)))):
            try:
                call()
            except Exception as exc:  # the outcome is what the parent checks
                print(what, type(exc).__name__, str(exc)[:200])
        world.hang = False
        try:
            dist.broadcast(torch.ones(4), 0)
        except Exception as exc:  # raised in the group's own method, under torch's
            print("DIRECT", type(exc).__name__)

def test_ddp_and_blocking_collectives_reduce_and_fail_through_python() -> None:
    """recovery/process_group/owned_group.py, elastic_work.py: DDP's C++ side calls the Python group
    and Work (``get_future()``), takes a failed future (``_Op``) as an error; blocking
    callers get CollectiveAborted unwrapped. Else DDP hangs or crashes, failures hide."""
    proc = _python("from tests.test_torch_internals import _ddp_probe\n_ddp_probe()\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for line in ("BUILT True", "REDUCED True", "BLOCKING CollectiveAborted",
                 "DIRECT CollectiveAborted"):
        assert line in proc.stdout, proc.stdout
    assert "DDP " in proc.stdout and "probe failure" in proc.stdout, proc.stdout

class _RecordingStore(dist.Store):
    """A Python store over a HashStore noting which of its methods C++ called; it has
    the C++ names EtcdStore aliases (``deleteKey``, ``getNumKeys``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.calls = dist.HashStore(), []

    def has_extended_api(self) -> bool:
        return True

def _forward(name: str) -> Callable[..., Any]:
    def method(self: _RecordingStore, *args: Any) -> Any:
        self.calls.append(name)
        return getattr(self.inner, name)(*args)
    return method

for _name, _inner in (("deleteKey", "delete_key"), ("getNumKeys", "num_keys"), *(
        (n, n) for n in ("set", "get", "add", "check", "wait", "compare_set", "multi_get",
                         "multi_set", "append"))):
    setattr(_RecordingStore, _name, _forward(_inner))

def test_a_python_store_behind_a_prefix_store_gets_every_call() -> None:
    """replication/side_channel/interruptible_store.py, recovery/job_store/etcd_store.py: a Python
    ``dist.Store`` in a ``PrefixStore`` gets every call, ``delete_key``/``num_keys`` by
    C++ names, multi-key ones if ``has_extended_api``. Else "pure virtual" errors."""
    inner = _RecordingStore()
    store = dist.PrefixStore("p", inner)
    store.set("a", "1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.check(["a"])
    store.wait(["a"])
    store.wait(["a"], datetime.timedelta(seconds=1))
    assert store.compare_set("a", "1", "2") == b"2"
    store.multi_set(["b", "c"], ["3", "4"])
    assert store.multi_get(["b", "c"]) == [b"3", b"4"]
    store.append("b", "5")
    assert store.num_keys() >= 3 and store.delete_key("a")
    assert inner.calls == ["set", "get", "add", "check", "wait", "wait", "compare_set",
                           "multi_set", "multi_get", "append", "num_keys", "delete_key"]

def test_an_interrupted_store_wait_ends_gloos_constructor_with_its_own_type() -> None:
    """replication/side_channel/interruptible_store.py, abortable_gloo.py: StoreWaitInterrupted from
    the Python store leaves ``ProcessGroupGloo(...)`` unwrapped (``make_inner`` catches
    it). Else a rendezvous no longer ends when a newer generation is declared."""
    with pytest.raises(StoreWaitInterrupted, match="a newer generation"):
        AbortableGloo.create(dist.PrefixStore("g", dist.HashStore()), 0, 2, 20.0,
                             interrupted=lambda: "a newer generation")

def test_gloo_private_options_pin_the_interface_and_timeout() -> None:
    """replication/side_channel/abortable_gloo.py (``--bind``): ``ProcessGroupGloo._Options`` with
    ``_timeout``/``_devices``, ``ProcessGroupGloo.create_device(hostname=)``, and the
    constructor taking them (or a timedelta). Else ``--bind`` jobs get no gloo group."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = TIMEOUT
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    assert opts._timeout == TIMEOUT and len(opts._devices) == 1
    for hostname in ("127.0.0.1", None):
        g = AbortableGloo.create(dist.PrefixStore(str(hostname), dist.HashStore()), 0, 1,
                                 30.0, hostname=hostname)
        t = torch.ones(3)
        g.backend.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(3))

def test_gloo_sockets_and_private_collectives_of_a_two_rank_group() -> None:
    """replication/side_channel/abortable_gloo.py: gloo connects in its constructor (abort shuts the
    sockets it opened: else survivors wait out the timeout); recovery/process_group/ordered_sum.py,
    elastic_group.py: ``_allgather_base``/``alltoall_base``, ``AllreduceOptions``."""
    opts = torch._C._distributed_c10d.AllreduceOptions()
    opts.reduceOp, opts.timeout = dist.ReduceOp.SUM, TIMEOUT
    assert opts.reduceOp == dist.ReduceOp.SUM and opts.timeout == TIMEOUT
    store, groups = dist.HashStore(), {}
    tensors = {r: torch.arange(5.0) * (r + 1) for r in (0, 1)}

    def run(r: int) -> None:
        if r == 0:
            groups[0] = AbortableGloo.create(dist.PrefixStore("g", store), 0, 2, 30.0)
        else:
            groups[1] = dist.ProcessGroupGloo(dist.PrefixStore("g", store), 1, 2, TIMEOUT)
        backend = groups[0].backend if r == 0 else groups[1]
        rank_ordered_sum(backend, tensors[r], 2, lambda call: call())
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert all(torch.equal(tensors[r], torch.arange(5.0) * 3) for r in (0, 1)), tensors
    assert groups[0].sockets, "gloo opened no connected socket while it was constructed"
    work = groups[1].allreduce([torch.ones(2)])  # rank 0 never joins it
    assert groups[0].abort() >= 1
    with pytest.raises(RuntimeError):
        work.wait()

@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch is built without NCCL")
def test_nccl_options_expose_the_timeout_and_a_non_blocking_config() -> None:
    """recovery/process_group/nccl_inner.py (option objects only, no GPU):
    ``ProcessGroupNCCL.Options``
    ``._timeout``, ``.config.blocking``, ``abort``/``supports_shrinking``. Without
    ``config`` an init stuck on a dead peer silently ends only at its timeout."""
    opts = nccl_inner.nccl_options(dist.ProcessGroupNCCL.Options, 5.0)
    assert opts._timeout == datetime.timedelta(seconds=5.0)
    assert hasattr(opts, "config") and opts.config.blocking == nccl_inner.NON_BLOCKING
    assert callable(getattr(dist.ProcessGroupNCCL, "abort", None))
    assert hasattr(dist.ProcessGroupNCCL, "supports_shrinking")

def test_cuda_lazy_call_defers_until_cuda_initialises() -> None:
    """recovery/process_group/device_placement.py: ``torch.cuda._lazy_call(fn)`` runs ``fn`` when
    CUDA
    initialises, so placing a rank never initialises CUDA in the zygote (``set_device``,
    the fallback, does, before a fork)."""
    assert next(iter(inspect.signature(torch.cuda._lazy_call).parameters)) == "callable"
    ran: list[int] = []
    queued = len(torch.cuda._queued_calls)
    torch.cuda._lazy_call(lambda: ran.append(1))
    if torch.cuda.is_initialized():
        assert ran == [1]
    else:
        assert ran == [] and len(torch.cuda._queued_calls) == queued + 1

@pytest.mark.skipif(torch.version.cuda is None, reason="this torch is built without CUDA")
def test_cudart_bindings_for_page_locking() -> None:
    """replication/snapshots/slots.py: ``torch.cuda.cudart()`` returns ``torch._C._cudart``, whose
    ``cudaHostRegister``/``cudaHostUnregister``/``cudaGetErrorString``/``cudaError`` lock
    snapshot buffers (bindings only, no GPU). Missing, host copies go synchronous."""
    for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString", "cudaError"):
        assert callable(getattr(torch._C._cudart, name, None)), name
    assert "_cudart" in inspect.getsource(torch.cuda.cudart)

def test_ddp_bucket_layout_is_read_settled_and_rebuilt(gloo_world: None) -> None:
    """recovery/process_group/ddp_layout.py: ``_build_params_for_reducer``, ``_lazy_init_ran``,
    reducer
    ``_get_zeros_like_grad_buckets``/``_rebuild_buckets``, ``_has_rebuilt_buckets``, and
    ``dist._compute_bucket_assignment_by_size``. Else 3+ ranks lose bit-identity."""
    ddp = DDP(_mlp(), bucket_cap_mb=1)
    params, expect_sparse = ddp._build_params_for_reducer()
    assert len(params) == 6 and len(expect_sparse) == 6
    assert ddp._lazy_init_ran is False and ddp._has_rebuilt_buckets is False
    construction = ddp_layout._read_layout(ddp)
    assert sorted(i for b in construction for i in b) == list(range(6))
    ddp(torch.randn(5, 8)).sum().backward()
    assert ddp._lazy_init_ran is True
    ddp_layout.settle(ddp)  # the rebuild DDP would run at the next forward
    assert ddp._has_rebuilt_buckets is True and ddp.reducer._rebuild_buckets() is False
    layout, original = [[5, 4], [1, 0, 3, 2]], dist._compute_bucket_assignment_by_size
    ddp_layout.rebuild_reducer(ddp, layout)
    assert dist._compute_bucket_assignment_by_size is original
    assert ddp_layout._read_layout(ddp) == layout and ddp._has_rebuilt_buckets is False
    assert ddp_layout.current_layout(ddp) == layout
    ref, x = _mlp(), torch.randn(5, 8)
    ddp.zero_grad()
    ddp(x).sum().backward()
    ref(x).sum().backward()
    assert _same_grads(ddp.module, ref)

def test_ddp_rebuild_keeps_static_graph_and_comm_hooks(gloo_world: None) -> None:
    """recovery/process_group/ddp_layout.py: ``_set_static_graph``, ``_comm_hooks``,
    ``_register_comm_
    hook``; a new static-graph reducer reduces its first backward only if DDP's
    ``_static_graph_delay_allreduce_enqueued`` is False. Else no gradient is reduced."""
    calls: list[bool] = []

    def hook(state, bucket):  # unannotated: DDP refuses string annotations
        calls.append(state)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    for static in (False, True):
        ddp = DDP(_mlp(), static_graph=static)
        ddp.register_comm_hook(static, hook)
        assert ddp._comm_hooks == [(hook, static)]
        assert hasattr(ddp, "_static_graph_delay_allreduce_enqueued") is static
        for _ in range(2):
            ddp(torch.randn(5, 8)).sum().backward()
        ddp_layout.rebuild_reducer(ddp, None)
        calls.clear()
        for _ in range(2):
            ddp(torch.randn(5, 8)).sum().backward()
        assert len(calls) == 2, (f"static_graph={static}: the rebuilt reducer reduced "
                                 f"{len(calls)} of 2 backwards through the comm hook")

def test_ddp_setstate_builds_a_reducer_as_rebuild_reducer_does() -> None:
    """recovery/process_group/ddp_layout.py: ``rebuild_reducer`` mirrors ``DDP.__setstate__``: the
    same
    ``_ddp_init_helper`` arguments, then only the static-graph calls. A torch restoring
    more there leaves a recovered reducer unlike the old: extend both, then this list."""
    helper = inspect.signature(DDP._ddp_init_helper).parameters
    assert list(helper) == ["self", "parameters", "expect_sparse_gradient",
                            "param_to_name_mapping", "static_graph"]
    body = ast.parse(textwrap.dedent(inspect.getsource(DDP.__setstate__))).body[0].body
    at = next(i for i, s in enumerate(body) if "_ddp_init_helper" in ast.unparse(s))
    effects = set()
    for node in ast.walk(ast.Module(body=body[at + 1:], type_ignores=[])):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            effects.add(ast.unparse(node.func) + "()")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in getattr(node, "targets", None) or [node.target]:
                effects.add(ast.unparse(target) + " =")
    # rebuild_reducer does each of these (the manual-finalization mode: torch >= 2.15).
    mirrored = {"self.reducer._set_static_graph()", "self.logger._set_static_graph()",
                "self.require_manual_backward_finalization ="}
    assert effects <= mirrored, (
        f"DDP.__setstate__ now does {sorted(effects - mirrored)} after building its reducer")

def test_ddp_construction_syncs_through_the_module_attribute(gloo_world: None,
                                                             monkeypatch) -> None:
    """recovery/process_group/init_hook.py: DDP's constructor calls ``torch.distributed.utils.
    _sync_params_and_buffers`` via the module. Bound at import, the hook that skips a
    replacement's broadcast silently does nothing (0.07 s per 67 MB, on recovery)."""
    seen, original = [], dist_utils._sync_params_and_buffers
    assert list(inspect.signature(original).parameters) == [
        "process_group", "module_states", "broadcast_bucket_size", "src"]

    def recording(process_group: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append((process_group, *args))
        return original(process_group, *args, **kwargs)
    monkeypatch.setattr(dist_utils, "_sync_params_and_buffers", recording)
    DDP(_mlp())
    assert len(seen) == 1 and seen[0][0] is dist.group.WORLD and len(seen[0][1]) == 6

class _Tripwire(nn.Module):
    """Identity whose backward raises while ``armed``: a failure inside FSDP2's backward."""

    armed = False

    @staticmethod
    def _trip(grad: torch.Tensor) -> torch.Tensor:
        if _Tripwire.armed:
            raise RuntimeError("interrupted backward")
        return grad

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t = t.view_as(t)
        t.register_hook(self._trip)
        return t

def _sharded_net(mesh: Any) -> nn.Module:
    """Three FSDP2 groups under a root; a backward breaks inside the middle one, after
    its linear layer's gradients reached the unsharded parameters."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(_Tripwire(),
                        nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))
    for layer in (net[0], net[2], net[4], net):
        fully_shard(layer, mesh=mesh)
    return net

def test_fsdp2_state_internals_reset_after_an_interrupted_backward(gloo_world: None) -> None:
    """recovery/process_group/training_groups.py (``_reset_fsdp_root``):
    ``_get_fsdp_state()._is_root``,
    ``_comm_ctx``, ``_state_ctx.all_states``, ``_fsdp_param_groups``, ``_all_gather_result``,
    ``fsdp_params``, ``unsharded_accumulated_grad`` =. Else survivors cannot reset FSDP2."""
    mesh = dist.init_device_mesh("cpu", (1,))
    net, x = _sharded_net(mesh), torch.randn(3, 4)
    state = net._get_fsdp_state()
    assert state._is_root is None  # before the first forward
    _Tripwire.armed = True
    try:
        with pytest.raises(RuntimeError, match="interrupted backward"):
            net(x).sum().backward()
    finally:
        _Tripwire.armed = False
    assert state._is_root is True and net[2]._get_fsdp_state()._is_root is False
    assert hasattr(state._comm_ctx, "all_gather_state")
    groups = [g for s in state._state_ctx.all_states for g in s._fsdp_param_groups]
    assert len(groups) == 3 and all(hasattr(g, "_all_gather_result") for g in groups)
    fsdp_params = [p for g in groups for p in g.fsdp_params]
    assert len(fsdp_params) == 6 and all(hasattr(p, "_unsharded_param") for p in fsdp_params)
    for p in net.parameters():
        p.grad = None  # what the state restore does to the sharded gradients
    _reset_fsdp_root(net)
    net(x).sum().backward()
    ref = _sharded_net(mesh)
    ref(x).sum().backward()
    for got, want in zip(net.parameters(), ref.parameters()):
        assert torch.equal(got.grad.to_local(), want.grad.to_local())

def test_fsdp2_parameters_are_dtensors_named_as_the_resharding_expects(
        gloo_world: None) -> None:
    """recovery/resize/reshard.py, world_resize.py, replication/training_state/state.py: class names
    (``DTensor``, ``Shard``/``Replicate``), mesh ``get_local_rank``/``size``, and
    ``DTensor.from_local(shape=, stride=)``. Renamed, FSDP2/HSDP state looks replicated."""
    for names, kind in ((("shard",), "fsdp"), (("replicate", "shard"), "hsdp")):
        model = nn.Linear(4, 4)
        fully_shard(model, mesh=dist.init_device_mesh("cpu", (1,) * len(names),
                                                      mesh_dim_names=names))
        p = model.weight
        assert reshard.layout_of(model) == kind, p.placements
        assert reshard.shard_coordinates(p) == (0, 1)
        again = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh,
                                   p.placements, run_check=False, shape=p.shape,
                                   stride=p.stride())
        assert type(again).__name__ == "DTensor" and again.shape == p.shape

def test_dcp_fsspec_filesystem_imports_without_a_deprecation() -> None:
    """replication/durable/dcp_io.py: DCP's fsspec ``FileSystem`` is TrackedFS's base,
    from ``checkpoint.fsspec_filesystem._FileSystem`` where that exists (torch 2.15) and
    the private ``_fsspec_filesystem.FileSystem`` before (2.15 keeps that as a shim that
    warns). Deprecated or moved, the durable writer warns at every start, then breaks
    when it goes. (A fresh interpreter: the import under test runs there.)"""
    proc = _python("""
        import warnings
        warnings.simplefilter("always")
        from replication.durable import dcp_io
        base = dcp_io._DcpFsspecFileSystem
        assert {"create_stream", "concat_path", "rename", "mkdir", "exists"} <= set(dir(base))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "deprecated" not in proc.stderr, proc.stderr

def test_dcp_writes_and_reads_through_the_projects_storage_classes(tmp_path) -> None:
    """replication/durable/dcp_io.py, saver.py, format.py: DCP's I/O goes via ``self.fs``
    (TrackedFS), ``.metadata`` pickles only ``_StorageInfo``/``_get_layout``/dataclasses,
    ``_nested_dict.flatten_state_dict`` keys are DCP's. Else checkpoints break."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from replication.durable import dcp_io  # DCP's fsspec FileSystem is its base
    fs, path, tracker = fsspec.filesystem("file"), str(tmp_path / "flat"), dcp_io.Tracker()
    fs.makedirs(path, exist_ok=True)
    flat = {"model.w": torch.arange(12.0).view(3, 4), "model.b": torch.ones(3).long()}
    dcp.save(dict(flat), storage_writer=dcp_io.RankWriter(fs, path, tracker),
             planner=dcp_io.StagedSavePlanner(None, {}), no_dist=True)
    assert any(p.endswith(".distcp") for p in tracker.files), tracker.files
    md = load_dcp_metadata((tmp_path / "flat" / ".metadata").read_bytes())
    assert set(md.state_dict_metadata) == set(flat)
    back = {k: torch.zeros_like(v) for k, v in flat.items()}
    dcp.load(back, storage_reader=dcp_io.RankReader(fs, path, md),
             planner=dcp_io.TensorOnlyLoadPlanner(), no_dist=True)
    assert all(torch.equal(back[k], flat[k]) for k in flat)
    model = nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    nested = {"optim": opt.state_dict()}
    keys, mappings = flatten_state_dict(nested)
    assert keys["optim.param_groups.0.lr"] == 0.5 and set(mappings) == set(keys)
    dcp.save(nested, storage_writer=dcp_io.RankWriter(fs, str(tmp_path), dcp_io.Tracker()),
             no_dist=True)
    md = load_dcp_metadata((tmp_path / ".metadata").read_bytes())
    assert set(md.state_dict_metadata) == set(keys)

def test_flatten_unflatten_and_foreach_copy() -> None:
    """recovery/runtime/gradient_average.py, launcher/chaos/workload.py: ``torch._utils._flatten_
    dense_tensors``/``_unflatten_dense_tensors``; replication/snapshots/streamcopy.py: ``torch.
    _foreach_copy_``. Else ``all_reduce_gradients`` or every snapshot capture raises."""
    grads = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.ones(2, 2)]
    flat = torch._utils._flatten_dense_tensors(grads)
    back = torch._utils._unflatten_dense_tensors(flat * 2, grads)
    assert torch.equal(flat, torch.cat([g.reshape(-1) for g in grads]))
    assert all(torch.equal(b, g * 2) for b, g in zip(back, grads, strict=True))
    dsts = [torch.zeros(3), torch.zeros(2, 2, dtype=torch.float64)]
    srcs = [torch.arange(3.0), torch.arange(4.0).view(2, 2).t()]
    torch._foreach_copy_(dsts, srcs)
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[1], srcs[1].double())

class _Counted(list):
    """A map-style dataset noting each item loaded."""

    def __getitem__(self, i: Any) -> Any:
        self.loaded.append(i)
        return super().__getitem__(i)

def test_single_process_loader_iterator_skips_by_its_sampler() -> None:
    """recovery/loader/loader_position.py (``skip``): a ``_SingleProcessDataLoaderIter`` with
    ``_sampler_iter``/``_num_yielded`` skips batches unloaded. Renamed, the project
    silently loads and drops each skipped batch (a late resume reloads the epoch)."""
    data = _Counted(range(20))
    data.loaded = []
    loader = DataLoader(data, batch_size=4)
    it = iter(loader)
    assert isinstance(it, torch.utils.data.dataloader._SingleProcessDataLoaderIter)
    assert hasattr(it, "_sampler_iter") and it._num_yielded == 0
    loader_position.skip(loader, it, 3)
    assert data.loaded == [] and it._num_yielded == 3
    assert next(it).tolist() == [12, 13, 14, 15]

def test_optimizer_step_calls_a_capture_check_the_spare_can_replace() -> None:
    """launcher/spare.py (``_one_step``): Adam's/AdamW's ``step()`` call the CUDA-graph
    capture check via the instance, by a ``_CAPTURE_CHECKS`` name. Renamed, GPU spares
    initialise CUDA before the zygote forks: its workers cannot run autograd."""
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        model = nn.Linear(2, 2)
        opt = cls(model.parameters(), lr=0.1)
        hits: list[str] = []
        names = [n for n in _CAPTURE_CHECKS if hasattr(opt, n)]
        assert names, f"{cls.__name__} has none of {_CAPTURE_CHECKS}"
        for n in names:
            setattr(opt, n, functools.partial(hits.append, n))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert hits, f"{cls.__name__}.step() called none of {names} on the instance"
