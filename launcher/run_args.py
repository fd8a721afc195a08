"""Command-line arguments of ``checkpointless run``: torchrun's flags plus our own.

Every torchrun flag is accepted with both spellings (``--nproc-per-node`` and
``--nproc_per_node``) so existing launch scripts work by changing the program name.
Recipe overrides (``replication.factor=2``) go between the flags and the script: the
script is the first positional argument that is not ``dotted.key=value``, and
everything after it belongs to the script, untouched.

Parsing ends in one frozen :class:`RunArgs`; every check that can fail before any
process starts (bad endpoint, unknown backend, missing script) happens here and
raises :class:`UsageError`, which the command reports as ``checkpointless: error:``
with exit status 2. :func:`prepare` then adds what depends on this machine: the job
secret (``launcher.job_secret``) and the bind address (``launcher.bind``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from launcher import bind as bind_mod
from launcher import job_secret, kubernetes_env, slurm_env
from replication import contract
from replication.errors import CheckpointlessError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_PORT = 29400  # torchrun's default when --rdzv-endpoint has no port
DEFAULT_JOIN_TIMEOUT_S = 600.0  # torchrun's default rendezvous join timeout
SUPPORTED_BACKENDS = ("c10d", "static", "etcd")
DEFAULT_ETCD_PORT = 2379  # etcd's client port, for --rdzv-endpoint members without one

_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class UsageError(CheckpointlessError, ValueError):
    """A bad flag or value on the ``run`` command line."""


@dataclass(frozen=True)
class RunArgs:
    """Everything ``checkpointless run`` was asked to do, validated."""

    nproc: int
    nnodes: int
    node_rank: int
    host: str
    port: int  # 0 with --standalone: node 0 picks a free port
    rdzv_id: str
    standalone: bool
    module: bool
    script: str  # a path, or a module name with -m
    script_args: tuple[str, ...]
    overrides: tuple[str, ...]
    recipe: str | None
    run_dir: str | None
    spares: int
    max_restarts: int | None  # None: not given on the command line
    join_timeout_s: float
    monitor_interval_s: float
    bind: str | None = None  # --bind as given (None: the default rules of launcher.bind)
    job_secret_file: str | None = None
    #: Fork workers and spares from a zygote that imported torch once (False: each
    #: worker and spare is a new interpreter that imports torch itself).
    zygote: bool = True
    #: Modules the zygote imports besides the script's own (--preload), and modules it
    #: must leave to the workers (--no-preload; "*": none of the script's).
    preload: tuple[str, ...] = ()
    no_preload: tuple[str, ...] = ()
    #: Set by :func:`prepare`: the job secret (None: generate or share one locally).
    job_secret: bytes | None = field(default=None, repr=False, compare=False)
    #: Set by :func:`prepare`: where this node listens.
    bind_plan: bind_mod.BindPlan | None = None
    #: "c10d" (node 0's agent hosts a TCPStore; "static" means the same) or "etcd".
    rdzv_backend: str = "c10d"
    #: With etcd: every member of the etcd cluster (--rdzv-endpoint H1:P1,H2:P2,...).
    etcd_endpoints: tuple[tuple[str, int], ...] = ()
    #: Where a scheduler placed this node, said once by node 0 ("": started by hand).
    placement: str = ""
    #: What a SIGTERM to this agent means: "drain" (the job stops once the newest
    #: committed step is persisted: under Slurm every node gets it at once) or "leave"
    #: (this node leaves; a spare node takes its ranks over).
    on_sigterm: str = "leave"

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc

    @property
    def is_spare_node(self) -> bool:
        """A node rank past ``nnodes`` owns no ranks: it waits to take over a lost node."""
        return self.node_rank >= self.nnodes

    @property
    def hosts_store(self) -> bool:
        """Node 0's agent hosts the job's TCPStore; with etcd nobody hosts anything."""
        return self.node_rank == 0 and self.rdzv_backend != "etcd"

    @property
    def uses_etcd(self) -> bool:
        return self.rdzv_backend == "etcd"


def _flag(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add ``--a-b`` with its ``--a_b`` twin (torchrun documents both)."""
    spellings = [f"--{name}"]
    if "-" in name:
        spellings.append("--" + name.replace("-", "_"))
    parser.add_argument(*spellings, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _flag(parser, "nproc-per-node", dest="nproc_per_node", default="1", metavar="N",
          help="workers per node: an integer, or 'cpu', 'gpu', 'auto' (default 1)")
    _flag(parser, "nnodes", default=None, metavar="N|MIN:MAX",
          help="number of active nodes; torchrun's MIN:MAX is accepted and MIN used "
          "(default 1; in a Slurm step, its nodes less --spare-nodes)")
    _flag(parser, "node-rank", dest="node_rank", type=int, default=None, metavar="R",
          help="this node's rank; ranks >= nnodes are spare nodes (default 0; in a Slurm "
          "step, this node's place in its node list; in a Kubernetes Indexed Job, the "
          "pod's completion index)")
    _flag(parser, "spare-nodes", dest="spare_nodes", type=int, default=None, metavar="S",
          help="in a Slurm step: its last S nodes wait as spare nodes to take over a lost "
          "node's ranks (default 0)")
    _flag(parser, "rdzv-endpoint", dest="rdzv_endpoint", default="", metavar="HOST:PORT",
          help="where node 0 hosts the job's c10d store (default: master addr/port)")
    _flag(parser, "rdzv-id", dest="rdzv_id", default="", metavar="ID",
          help="job id, shared by all nodes (default 'none'; 'standalone' with --standalone)")
    _flag(parser, "rdzv-backend", dest="rdzv_backend", default="static", metavar="NAME",
          help="rendezvous backend: c10d or static (node 0 hosts a TCPStore), or etcd "
          "(an etcd v3 cluster holds the job's records: --rdzv-endpoint H1:2379,H2:2379,...; "
          "any node may then be lost)")
    _flag(parser, "rdzv-conf", dest="rdzv_conf", default="", metavar="K=V,...",
          help="rendezvous settings; join_timeout=SECONDS is honoured (default 600)")
    _flag(parser, "master-addr", dest="master_addr", default=DEFAULT_MASTER_ADDR,
          metavar="HOST", help=f"store host without --rdzv-endpoint ({DEFAULT_MASTER_ADDR})")
    _flag(parser, "master-port", dest="master_port", type=int, default=DEFAULT_MASTER_PORT,
          metavar="PORT", help=f"store port without --rdzv-endpoint ({DEFAULT_MASTER_PORT})")
    _flag(parser, "max-restarts", dest="max_restarts", type=int, default=None, metavar="N",
          help="failures recovered in-process before the job stops (recovery.max_restarts, "
          "unless the recipe, env or an override sets it)")
    _flag(parser, "monitor-interval", dest="monitor_interval", type=float, default=0.05,
          metavar="SECONDS", help="how often the agent polls its workers (default 0.05)")
    _flag(parser, "standalone", action="store_true",
          help="single node: host the store on 127.0.0.1 at a free port")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run SCRIPT as a module (python -m SCRIPT)")
    _flag(parser, "run-dir", dest="run_dir", default=None, metavar="DIR",
          help="events and heartbeats go here (default: the recipe's run_dir, "
          "else ./runs/<rdzv-id>)")
    _flag(parser, "recipe", default=None, metavar="FILE", help="YAML recipe")
    _flag(parser, "spares", type=int, default=0, metavar="N",
          help="warm spare processes per node, started with torch imported (default 0)")
    _flag(parser, "no-zygote", dest="zygote", action="store_false",
          help="start each worker and warm spare as a new interpreter instead of forking "
          "it from a zygote that imported torch once (Linux; see docs/adr/0029-workers-"
          "forked-from-the-zygote.md)")
    _flag(parser, "preload", default="", metavar="MOD[,MOD]",
          help="modules the zygote imports before forking workers and spares, besides "
          "the ones the script imports (each checked first: one that initialises CUDA, "
          "starts threads or fails is left to the workers)")
    _flag(parser, "no-preload", dest="no_preload", default="", metavar="MOD[,MOD]|*",
          help="modules (with their submodules) the zygote leaves to the workers; '*': "
          "import none of the script's modules in the zygote")
    _flag(parser, "no-fork-spares", dest="zygote", action="store_false",
          help=argparse.SUPPRESS)  # its older name, from when only spares were forked
    _flag(parser, "job-secret-file", dest="job_secret_file", default=None, metavar="FILE",
          help=f"the job secret (not readable by other users); or set {contract.ENV_JOB_SECRET}. "
          "Required with several nodes unless all run on this machine")
    _flag(parser, "bind", default=None, metavar="ADDRESS|all",
          help="address the job store and gloo listen on (default: loopback for a loopback "
          "endpoint, else the endpoint's address on node 0 and the route to it elsewhere)")
    _flag(parser, "metrics-port", dest="metrics_port", type=int, default=None, metavar="PORT",
          help="serve Prometheus metrics from this agent on PORT, bound to its own "
          "address (recovery.metrics_port; default off)")
    _flag(parser, "on-sigterm", dest="on_sigterm", choices=("auto", "drain", "leave"),
          default="auto", help="drain: a SIGTERM stops the job once every rank persisted "
          "the newest committed step, exit 75; leave: this node leaves the job and a spare "
          "node takes its ranks over (default auto: drain in a Slurm step, else leave)")
    parser.add_argument("rest", nargs=argparse.REMAINDER, metavar="[KEY=VALUE ...] SCRIPT",
                        help="recipe overrides, then the script (or module) and its args")


def is_override(token: str) -> bool:
    """``dotted.key=value`` before the script is a recipe override, not the script."""
    key, sep, _ = token.partition("=")
    return bool(sep) and bool(_OVERRIDE_KEY.match(key))


def from_namespace(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                   environ: Mapping[str, str] | None = None) -> RunArgs:
    """Split overrides from the script (re-parsing flags that follow an override);
    ``environ`` (default ``os.environ``) is read for a Slurm step's placement."""
    overrides: list[str] = []
    rest = list(ns.rest)
    while rest:
        head = rest[0]
        if head == "--":
            rest.pop(0)
            break
        if is_override(head):
            overrides.append(rest.pop(0))
        elif head.startswith("-") and head != "-":
            # Flags after an override: argparse's REMAINDER swallowed them; parse again.
            ns.rest = []
            parser.parse_args(rest, namespace=ns)
            rest = list(ns.rest)
        else:
            break
    if not rest:
        raise UsageError("no script given (usage: checkpointless run [flags] SCRIPT [args])")
    return _validate(ns, overrides, rest[0], tuple(rest[1:]), environ)


def _validate(
    ns: argparse.Namespace, overrides: list[str], script: str, script_args: tuple[str, ...],
    environ: Mapping[str, str] | None = None,
) -> RunArgs:
    env = os.environ if environ is None else environ
    try:  # where a scheduler placed this node (flags given win)
        placement = slurm_env.fill_in(ns, env)
        under_slurm = bool(placement)
        placement = placement or kubernetes_env.fill_in(ns, env)
    except (slurm_env.SlurmError, kubernetes_env.KubernetesError) as exc:
        raise UsageError(str(exc)) from None
    on_sigterm = getattr(ns, "on_sigterm", "auto")
    if on_sigterm == "auto":
        on_sigterm = "drain" if under_slurm else "leave"
    ns.nnodes = "1" if ns.nnodes is None else ns.nnodes
    ns.node_rank = 0 if ns.node_rank is None else ns.node_rank
    nnodes = parse_nnodes(ns.nnodes)
    nproc = parse_nproc(ns.nproc_per_node)
    if ns.rdzv_backend not in SUPPORTED_BACKENDS:
        raise UsageError(
            f"--rdzv-backend {ns.rdzv_backend!r} is not supported "
            "(use c10d, the default, where node 0 hosts the job's TCPStore, or etcd with "
            "--rdzv-endpoint listing the etcd members)"
        )
    backend = "etcd" if ns.rdzv_backend == "etcd" else "c10d"
    etcd_endpoints: tuple[tuple[str, int], ...] = ()
    _non_negative("--node-rank", ns.node_rank)
    _non_negative("--spares", ns.spares)
    if ns.max_restarts is not None:
        _non_negative("--max-restarts", ns.max_restarts)
    if ns.monitor_interval <= 0:
        raise UsageError("--monitor-interval must be > 0")
    if ns.standalone:
        if nnodes != 1 or ns.node_rank != 0:
            raise UsageError("--standalone runs one node: drop --nnodes/--node-rank")
        host, port = "127.0.0.1", 0
    elif backend == "etcd":
        if not ns.rdzv_endpoint:
            raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint listing the etcd "
                             "members, e.g. h1:2379,h2:2379,h3:2379")
        etcd_endpoints = parse_etcd_endpoints(ns.rdzv_endpoint)
        host, port = etcd_endpoints[0]
    elif ns.rdzv_endpoint:
        host, port = parse_endpoint(ns.rdzv_endpoint)
    else:
        host, port = ns.master_addr, _port("--master-port", ns.master_port)
    rdzv_id = ns.rdzv_id or ("standalone" if ns.standalone else "none")
    if len(rdzv_id) > 200 or any(c in rdzv_id for c in "/\\\0") or rdzv_id in (".", ".."):
        raise UsageError(f"--rdzv-id {rdzv_id[:40]!r}{'...' if len(rdzv_id) > 40 else ''}: "
                         "use at most 200 characters and no '/', '\\' or NUL (it names the "
                         "default run directory)")
    if not ns.module and not os.path.isfile(script):
        raise UsageError(f"script {script!r} not found (use -m to run a module)")
    return RunArgs(
        nproc=nproc,
        nnodes=nnodes,
        node_rank=ns.node_rank,
        host=host,
        port=port,
        rdzv_id=rdzv_id,
        standalone=ns.standalone,
        module=ns.module,
        script=script,
        script_args=script_args,
        overrides=tuple(overrides) + ((f"recovery.metrics_port={port}",) if (
            port := getattr(ns, "metrics_port", None)) is not None else ()),
        recipe=ns.recipe,
        run_dir=ns.run_dir,
        spares=ns.spares,
        max_restarts=ns.max_restarts,
        join_timeout_s=parse_join_timeout(ns.rdzv_conf),
        monitor_interval_s=ns.monitor_interval,
        bind=getattr(ns, "bind", None),
        job_secret_file=getattr(ns, "job_secret_file", None),
        zygote=getattr(ns, "zygote", True),
        preload=_module_list("--preload", getattr(ns, "preload", "")),
        no_preload=_module_list("--no-preload", getattr(ns, "no_preload", ""), star=True),
        rdzv_backend=backend,
        etcd_endpoints=etcd_endpoints,
        placement=placement,
        on_sigterm=on_sigterm,
    )


def _module_list(flag: str, value: str, star: bool = False) -> tuple[str, ...]:
    """``a,b.c`` as module names; :class:`UsageError` naming the first that is not."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    for name in names:
        if not (star and name == "*") and not all(p.isidentifier() for p in name.split(".")):
            raise UsageError(f"{flag}: {name!r} is not a module name (give MOD[,MOD], "
                             "e.g. transformers,datasets)")
    return names


def prepare(args: RunArgs, environ: Mapping[str, str] | None = None) -> RunArgs:
    """``args`` with the job secret and the bind plan resolved (:class:`UsageError` if not).

    Kept apart from parsing because both look at this machine (files, interfaces, DNS).
    """
    env = os.environ if environ is None else environ
    try:
        secret = job_secret.from_sources(env, args.job_secret_file)
    except job_secret.SecretError as exc:
        raise UsageError(str(exc)) from None
    single = args.nnodes == 1 and args.node_rank == 0
    if secret is None and args.uses_etcd:
        # No agent hosts anything, so none can hand a generated secret to the others.
        raise UsageError("--rdzv-backend etcd needs a job secret shared by every node: "
                         f"set {contract.ENV_JOB_SECRET} or pass --job-secret-file FILE "
                         f"on every node, e.g. {job_secret.HOW_TO_MAKE_ONE}")
    if secret is None and not single and not bind_mod.is_local_only(args.host):
        raise UsageError(job_secret.missing_secret_message(args.nnodes, args.node_rank,
                                                           args.host))
    try:
        plan = bind_mod.choose(args.bind, args.host, args.port, args.hosts_store,
                               multi_node=not single)
    except bind_mod.BindError as exc:
        raise UsageError(str(exc)) from None
    return dataclasses.replace(args, job_secret=secret, bind_plan=plan)


def parse_etcd_endpoints(text: str) -> tuple[tuple[str, int], ...]:
    """``H1:P1,H2:P2,...``: the etcd members (a member without a port gets 2379)."""
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UsageError(f"--rdzv-endpoint {text!r}: an empty member in the list")
    out = []
    for item in items:
        has_port = "]:" in item if item.startswith("[") else item.count(":") == 1
        host, port = parse_endpoint(item)
        out.append((host, port if has_port else DEFAULT_ETCD_PORT))
    if len(set(out)) != len(out):
        raise UsageError(f"--rdzv-endpoint {text!r}: a member is listed twice")
    return tuple(out)


def parse_nnodes(text: str) -> int:
    """``N`` or torchrun's elastic ``MIN:MAX``; the active node count is MIN."""
    first = text.split(":", 1)[0] if ":" in text else text
    try:
        value = int(first)
        if ":" in text:
            int(text.split(":", 1)[1])
    except ValueError:
        raise UsageError(f"--nnodes expects N or MIN:MAX, got {text!r}") from None
    if value < 1:
        raise UsageError(f"--nnodes must be >= 1, got {text!r}")
    return value


def parse_nproc(text: str) -> int:
    """An integer, or torchrun's 'cpu' / 'gpu' / 'auto' (GPUs if any, else CPUs)."""
    if text in ("cpu", "gpu", "auto"):
        gpus = 0
        if text != "cpu":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu" and gpus == 0:
            raise UsageError("--nproc-per-node gpu: no CUDA device is visible")
        return gpus or (os.cpu_count() or 1)
    try:
        value = int(text)
    except ValueError:
        raise UsageError(
            f"--nproc-per-node expects an integer, 'cpu', 'gpu' or 'auto', got {text!r}"
        ) from None
    if value < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {value}")
    return value


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST`` (port 29400 like torchrun) or ``[IPv6]:PORT``."""
    if text.startswith("["):
        host, _, tail = text[1:].partition("]")
        port_text = tail.removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, ""
    if not host:
        raise UsageError(f"--rdzv-endpoint {text!r} has no host")
    if not port_text:
        return host, DEFAULT_RDZV_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise UsageError(f"--rdzv-endpoint {text!r}: port {port_text!r} is not an "
                         "integer") from None
    # _port's UsageError is a ValueError too: checked outside the int() guard
    return host, _port(f"--rdzv-endpoint {text!r}", port)


def parse_join_timeout(conf: str) -> float:
    """torchrun's ``--rdzv-conf k=v,...``: only join_timeout matters to us."""
    timeout = DEFAULT_JOIN_TIMEOUT_S
    for item in filter(None, (part.strip() for part in conf.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--rdzv-conf expects key=value pairs, got {item!r}")
        if key.strip() == "join_timeout":
            try:
                timeout = float(value)
            except ValueError:
                raise UsageError(f"--rdzv-conf join_timeout={value!r} is not a number") from None
            if timeout <= 0:
                raise UsageError("--rdzv-conf join_timeout must be > 0")
    return timeout


def _port(flag: str, port: int) -> int:
    if not 1 <= port <= 65535:
        raise UsageError(f"{flag}: port must be in 1..65535, got {port}")
    return port


def _non_negative(flag: str, value: int) -> None:
    if value < 0:
        raise UsageError(f"{flag} must be >= 0, got {value}")
