"""The per-node agent: join the job, run this node's ranks, keep them running.

One poll loop (every ``--monitor-interval``, 50 ms by default) does, in order: react to
a signal; read the generation and the fatal flag; look at each worker (exit code,
heartbeat file); keep the spare pool full; every heartbeat interval, look at the watched
agents' heartbeats and at the losses others published (:class:`liveness.PeerWatch`);
settle lost groups; stop when every rank has finished.

Generations. A failure belongs to the generation that was current while the failed
process (or node) was last seen alive, not to whatever generation is current when the
agent gets round to acting: the surviving workers may already have declared the same
failure, and declaring from the newer generation would count one failure twice. So
each poll reads the generation *before* looking at the workers and each worker keeps
the generation of its last sign of life (see :meth:`Worker.observe`). That view can be
stale by a whole recovery, so a failure is declared from the newest generation the
failed process is known to belong to: the newer of that and the newest rendezvous its
join record is in (``protocol.generation_of_process``). That dedupes with the workers'
own declaration (``protocol.declare_failure``) and never folds a failure into a
generation the process already took part in.

Surviving workers are never restarted or signalled; only the failed rank gets a new
process (a warm spare when one is idle), with ``CHECKPOINTLESS_INTERNAL_REPLACEMENT=1``.
A job with ranks that already finished cannot recover in-process (the finished ranks
cannot take part), so a failure after the first clean exit is fatal.

Elsewhere: the job store (:mod:`launcher.job_store`), registration and group owners
(:mod:`launcher.membership`), heartbeats and the watch over the other agents
(:mod:`launcher.liveness`), what the agent does about a lost node or about being taken
over itself (:mod:`launcher.node_loss`), the end's line and status (:mod:`launcher.job_outcome`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import time
from typing import Any

import torch.distributed as dist

from launcher import (
    bind,
    health_check,
    job_store,
    liveness,
    membership,
    peer_link,
    reaper,
    worker_output,
    zygote_start,
)
from launcher.agent_endings import Endings
from launcher.loop_wakeup import LoopWakeup
from launcher.node_loss import LostGroup, NodeLossHandling
from launcher.operator_watch import OperatorWatch
from launcher.report.record import recorded_config
from launcher.run_args import RunArgs
from launcher.worker_env import JobEnv
from launcher.worker_procs import (
    HUNG,
    LATE,
    SparePool,
    Worker,
    exit_signal,
    launch,
    make_heartbeat_file,
    stop_processes,
)
from launcher.zygote import Zygote
from recovery.common.causes import FailureCause, describe
from recovery.common.events import Event
from recovery.generation import protocol, world
from recovery.generation.rendezvous import finished_while_training
from recovery.job_store import auth
from recovery.recipe import CheckpointlessConfig, config_to_json
from replication import contract
from replication.errors import CheckpointlessError

#: A pass of the agent's loop longer than this is reported (``agent_stalled``).
STALL_REPORT_S = 2.0


class _PassTimer:
    """Times the parts of one pass of the agent's loop, to name the part that stalled
    when a pass takes seconds (an agent starved on an overloaded host misses its
    heartbeats and is declared lost; the event says where its time went)."""

    def __init__(self) -> None:
        self._t0 = self._last = time.monotonic()
        self._parts: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = self._last = time.monotonic()
        self._parts.clear()

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self._parts[part] = now - self._last
        self._last = now

    def stalled(self, over_s: float) -> dict[str, Any] | None:
        total = time.monotonic() - self._t0
        if total <= over_s:
            return None
        return {"pass_s": round(total, 3),
                "parts_s": {k: round(v, 3) for k, v in self._parts.items()}}


class JoinError(CheckpointlessError, RuntimeError):
    """This agent cannot take part in the job (its node rank is already taken)."""


class Agent(NodeLossHandling, Endings):
    """Supervises one node's workers; see the module docstring for the loop."""

    def __init__(self, args: RunArgs, cfg: CheckpointlessConfig, run_dir: str,
                 zygote: Zygote | None = None) -> None:
        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        self._early_zygote = zygote  # forked before this agent started (ADR 0029)
        self._started_at = time.time()  # this run's rows in the durable history are newer
        self.node = args.node_rank
        self.rcfg = cfg.recovery
        events_file = cfg.recovery.events_file or os.path.join(run_dir, "events.jsonl")
        self.events = protocol.EventLog(events_file, source=f"agent{self.node}")
        self.group: int | None = None  # the node-group this agent runs; None while idle
        self.workers: dict[int, Worker] = {}
        self.lost_groups: dict[int, LostGroup] = {}
        self.watch = liveness.PeerWatch(self.node, cfg.recovery.heartbeat_timeout_s)
        self.store: dist.Store | None = None
        self.spares: SparePool | None = None
        self.heartbeat: liveness.Heartbeat | None = None
        self.lease: liveness.StoreLease | None = None
        self._isolated_s: float | None = None  # set when the lease stopped our workers
        self.job_store: job_store.JobStore | None = None
        self.done = liveness.DoneWatch(args.world_size)
        self._signal: int | None = None
        self._signals_seen = 0  # a count, not an Event: a handler must take no lock
        self._wakeup: LoopWakeup | None = None  # the loop's sleep, ended by SIGCHLD too
        self._seq = itertools.count()
        self._next_peer_check = 0.0
        self._next_reap = 0.0
        self._subreaper = False  # orphans below this agent come to it (see _start_zygote)
        self._fence_check = False  # look at this node's group ownership on the next pass
        self._fenced_out = False  # this node lost its ranks; it never takes any over
        self.watch_ops: OperatorWatch | None = None

    # --- entry ----------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal_received)
        self._wakeup = LoopWakeup()  # a worker's death ends the loop's sleep at once
        try:
            self._connect()
            if not self._check_storage() or not self._join():
                if self._signal is not None:
                    return self._stop()
                return self._fatal_exit(protocol.fatal(self.store) or {})
            if self.group is not None:
                for local in range(self.args.nproc):
                    self._start_rank(self.group, local, replacement=False, restart_count=0)
            return self._loop()
        except health_check.Unhealthy as exc:  # a spare node: it leaves, the job goes on
            self._mark_finished()
            self._emit(Event.AGENT_EXIT, code=exc.exit_code, why=str(exc))
            return exc.exit_code
        except (job_store.StoreUnavailable, JoinError) as exc:
            return self._stop() if self._signal is not None else self._failed(str(exc))
        except dist.DistError as exc:
            where = (str(self.job_store.address) if self.job_store is not None
                     else f"{self.args.host}:{self.args.port}")
            if self._isolated_s is not None:  # cut off: the others have taken over
                self._log(f"the job store at {where} stayed unreachable "
                          f"({job_store.brief(exc)}); leaving the job fenced "
                          f"(exit {contract.EXIT_FENCED})")
                self._stop_local()
                return contract.EXIT_FENCED
            return self._failed(f"lost the job store at {where} ({job_store.brief(exc)})",
                                contract.EXIT_RETRY)
        except TimeoutError as exc:  # a declarer died half-way through declare_failure
            with contextlib.suppress(dist.DistError, RuntimeError):
                protocol.set_fatal(self.store, f"the generation is stuck: {exc}")
            return self._failed(f"the generation is stuck: {exc}", contract.EXIT_RETRY)
        finally:
            if self.watch_ops is not None:
                self.watch_ops.stop()
            if self.lease is not None:
                self.lease.stop()
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self._stop_local()
            worker_output.drain()  # the workers' last lines, before we exit
            if self.job_store is not None:
                self.job_store.release()
            self._wakeup.close()

    def _on_signal_received(self, signum: int, _frame: Any) -> None:
        if self._signal is None:
            self._signal = signum
        self._signals_seen += 1  # the loop's sleep ends on its own (loop_wakeup)

    # --- joining --------------------------------------------------------------------
    def _connect(self) -> None:
        a = self.args
        auth.set_reporter(self._on_auth_rejected)  # values that fail the job-key check
        self.job_store = job_store.open_job_store(
            a, self.run_dir, lambda: self._signal is not None, self._log,
            store_outage_s=self.rcfg.store_outage_s)
        self.store, port = self.job_store.store, self.job_store.port
        self._check_health("at start")  # before it registers: an unfit node takes nothing
        self.cfg.run_dir = self.run_dir
        self.cfg.recovery.events_file = self.events.path
        self.job = JobEnv(
            store_host=a.host, store_port=port, nproc=a.nproc, nnodes=a.nnodes,
            node=self.node, run_id=a.rdzv_id, max_restarts=self.rcfg.max_restarts,
            run_dir=self.run_dir, config_json=config_to_json(self.cfg),
            job_key=self.job_store.signer.key_hex(), gloo_ifname=self.job_store.plan.gloo_ifname,
            store_address=str(self.job_store.address), on_sigterm=a.on_sigterm,
        )
        self.base_env = self.job.base()
        self.spares = SparePool(a.spares, self.base_env, self._emit, self._start_zygote())
        self.spares.fill()  # the zygote (or each spare) imports while the other nodes join
        if not a.is_spare_node and not membership.own_group(self.store, self.node, self.node):
            raise JoinError(
                f"node rank {self.node} already joined job {a.rdzv_id!r}; start a "
                f"replacement node with --node-rank >= {a.nnodes} to make it a spare node"
            )
        self.group = None if a.is_spare_node else self.node
        membership.register(self.store, self.node, a.nproc, spare=a.is_spare_node,
                            link=self._open_link())
        etcd = self.job_store.address.is_etcd
        self.heartbeat = liveness.Heartbeat(
            self.job_store.address, self.node, self.rcfg.heartbeat_interval_s,
            group_of=lambda: self.group,
            lease_ttl_s=self.rcfg.heartbeat_timeout_s if etcd else 0.0)
        if etcd:  # the lease's expiry detects a lost node; see launcher.liveness
            self.watch.lease_confirm_s = 2 * self.rcfg.heartbeat_interval_s
        self.heartbeat.start()
        self.lease = liveness.StoreLease(
            self.heartbeat, self.rcfg.heartbeat_timeout_s, self._on_isolated,
            reachable=lambda: any(job_store.accepts(h, p, timeout_s=1.0)
                                  for h, p in self.job_store.address.endpoints))
        self.lease.start()
        role = "spare node" if a.is_spare_node else f"ranks {self._ranks(self.node)}"
        # world size, cwd and the resolved recipe let `checkpointless report` read the run
        where = str(self.job_store.address)
        self._emit(Event.AGENT_START, pid=os.getpid(), role=role, store=where,
                   world_size=a.world_size, cwd=os.getcwd(), config=recorded_config(self.cfg))
        self._log(f"joined job {a.rdzv_id!r} ({role}, store {where}, "
                  f"run dir {self.run_dir})")
        self._log(f"listening on {self.job_store.plan.describe}")
        self.watch_ops = OperatorWatch(self)  # metrics and stragglers

    def _open_link(self) -> str | None:
        """Listen for the watchers' connections (:mod:`launcher.peer_link`) on the
        address the job listens on; returns ``host:port`` as peers reach it."""
        plan = self.job_store.plan
        host = plan.address
        if host is None:
            h, p = self.job_store.address.endpoints[0]
            host = bind.route_source(h, p) or socket.gethostname()
        try:
            self._link_listener = peer_link.LinkListener(plan.address)
        except OSError as exc:  # the heartbeat timeout still detects losses
            self._log(f"cannot listen for peer links ({exc}); node losses are detected by "
                      "the heartbeat timeout only")
            return None
        self.watch.links = peer_link.PeerLinks()
        self.watch.link_confirm_s = 2 * self.rcfg.heartbeat_interval_s
        return f"[{host}]:{self._link_listener.port}" if ":" in host else \
            f"{host}:{self._link_listener.port}"

    def _on_isolated(self, stuck_s: float) -> None:
        """Called from the :class:`liveness.StoreLease` thread: this agent's heartbeat
        has not reached the store for a heartbeat timeout, so the other agents count
        this node as lost. Its workers are stopped now, while the main loop is still
        blocked in the store; when the store answers again, the loop finds them gone
        and either sees the takeover (``_fenced``, exit 4) or, if nobody took the
        ranks, declares their loss and replaces them like any other failure."""
        if self._signal is not None:
            return
        self._isolated_s = stuck_s
        ranks = sorted(self.workers)
        self._emit(Event.NODE_ISOLATED, stuck_s=round(stuck_s, 3), ranks=ranks)
        self._log(f"cannot reach the job store for {stuck_s:.1f}s (heartbeat timeout "
                  f"{self.rcfg.heartbeat_timeout_s:g}s): the other nodes count this one "
                  f"as lost; stopping its workers (ranks {ranks})")
        stop_processes([w.proc for w in list(self.workers.values())], grace_s=0.0)

    def _start_zygote(self) -> Zygote | None:
        """The zygote the forks come from, if any (:mod:`launcher.zygote_start`)."""
        early, self._early_zygote = self._early_zygote, None
        zygote = zygote_start.start_zygote(self.args, early, self.base_env, self._emit, self._log)
        self._subreaper = zygote is not None
        return zygote

    def _reap_orphans(self) -> None:
        """Being a subreaper, collect orphans that ended up ours (a killed worker's
        durable helper): the status of our own workers and spares stays theirs."""
        if not self._subreaper or time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + 1.0
        known = {w.proc.pid for w in self.workers.values()}
        if self.spares is not None:
            known |= self.spares.pids()
        reaper.reap_orphans(known)

    def _check_storage(self) -> bool:
        """Write, read and delete a probe at ``persistence.path`` before any worker
        starts (every agent: each node has its own mounts and credentials); a failure
        ends the job with one line on every node. False to stop.

        Only before the job has begun, though. An agent that joins a running job (a
        spare or a replacement node after a node loss) may well meet a storage outage:
        the durable tier is the fallback and rides such outages out with its own
        retries, while the job's replicas carry on. Ending a job that has trained for
        hours on that probe would turn a passing outage into a total loss (the chaos
        soak did exactly that when its spare node started during an outage), so the
        failure is logged and the agent joins."""
        p = self.cfg.persistence
        if not p.path:
            return True
        from replication.durable.probe import probe_storage  # fsspec: only when used

        problem = probe_storage(p.path, dict(p.storage_options),
                                should_stop=lambda: self._signal is not None)
        if problem is None:
            return True
        if self._job_has_begun():
            self._emit(Event.STORAGE_CHECK_FAILED, problem=problem)
            self._log(f"warning: {problem}; the job is already running, so this node joins "
                      f"it (the durable tier retries its saves)")
            return True
        protocol.set_fatal(self.store, problem, node=self.node)
        return False

    def _check_health(self, when: str) -> None:
        """``recovery.health_check`` (:mod:`launcher.health_check`): an unfit spare node
        raises :class:`health_check.Unhealthy`; an unfit training node stops the job."""
        why = health_check.problem(self.rcfg.health_check)
        if why is None:
            return
        line = f"node {self.node} failed its health check {when}: {why}"
        self._emit(Event.HEALTH_CHECK_FAILED, when=when, problem=why)
        self._log(line)
        if self.args.is_spare_node:
            self._fenced_out = True
            raise health_check.Unhealthy(line)
        protocol.set_fatal(self.store, f"{line}; replace the node, or start it as a "
                           "spare node once it is fixed", node=self.node)

    def _job_has_begun(self) -> bool:
        """A generation after the first, or a committed step: workers have trained."""
        from replication.replica_protocol.commit import committed_step

        return protocol.current_generation(self.store) > 0 or committed_step(self.store) >= 0

    def _join(self) -> bool:
        """Wait until every group has its agent, like torchrun's rendezvous; False to stop."""
        problem = membership.wait_for_groups(
            self.store, self.args.nnodes, self.args.nproc, self.args.join_timeout_s,
            lambda: self._signal is not None)
        if problem:
            protocol.set_fatal(self.store, problem)
        return problem is None and self._signal is None and protocol.fatal(self.store) is None

    # --- the loop -------------------------------------------------------------------
    def _loop(self) -> int:
        timer = _PassTimer()
        while True:
            timer.start()
            assert self._wakeup is not None
            self._wakeup.clear()  # a child exiting from here on ends the next sleep
            if self._signal is not None:
                return self._stop()
            gen = protocol.current_generation(self.store)  # before looking at anyone
            if self._isolated_s is not None and self.heartbeat.blocked_since is None:
                self._isolated_s = None  # in touch with the store again (see _on_isolated)
            failure = protocol.fatal(self.store)
            if failure is not None:
                return self._fatal_exit(failure)
            timer.lap("store")
            self._poll_workers(gen)
            timer.lap("workers")
            self.spares.maintain()
            self._reap_orphans()
            timer.lap("spares")
            if time.monotonic() >= self._next_peer_check:
                self._next_peer_check = time.monotonic() + self.rcfg.heartbeat_interval_s
                self._fence_check = True
                self._check_peers(gen)
                self._claim_retired()  # an idle node takes retired ranks back
            if self._fence_check:
                self._fence_check = False
                if (taker := self._taken_over_by()) is not None:
                    self._fenced(taker)
                    if not self.args.hosts_store:  # the store host stays, idle, to the end
                        return contract.EXIT_FENCED
            self._settle_lost_groups(gen)
            self.watch_ops.tick(gen)
            timer.lap("peers")
            if self.done.all_done(self.store, idle=not self.workers):
                return self._done()
            timer.lap("done")
            if (stall := timer.stalled(STALL_REPORT_S)) is not None:
                self._emit(Event.AGENT_STALLED, **stall)
            self._wakeup.sleep(self.args.monitor_interval_s)

    def _poll_workers(self, gen: int) -> None:
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None:
                seen = w.observe(gen, self.rcfg.heartbeat_timeout_s)
                if seen == HUNG:
                    self._on_hung(w)
                elif seen == LATE:
                    silent = time.monotonic() - w.beat_seen_at
                    self._log(f"rank {w.rank} (pid {w.pid}) sent no heartbeat for "
                              f"{silent:.1f}s but is still at work (the kernel shows it "
                              f"using CPU or runnable): a busy host, not a hang")
                    self._emit(Event.WORKER_LATE, rank=w.rank, pid=w.pid,
                               silent_s=round(silent, 3))
                continue
            detected = time.monotonic()
            del self.workers[w.rank]
            sig = exit_signal(code)
            self._emit(Event.WORKER_EXIT, rank=w.rank, pid=w.pid, exitcode=code, signal=sig)
            if code != 0 and self._taken_over_by() is not None:
                # Its rank runs on another node now (this one was declared lost, say while
                # cut off): what became of this process is no news to the job.
                self._fence_check = True
                continue
            self._publish_process(w.rank, w.pid, "exited", exitcode=code, signal=sig)
            if code == 0:
                self._record_done(w.rank)
                self._stop_if_left_behind(w)
            elif protocol.is_trained(self.store, w.rank):
                # Its last step was committed everywhere; a crash on the way out loses
                # nothing and must not start a recovery the finished ranks cannot join.
                self._log(f"rank {w.rank} exited with {sig or code} after training finished")
                self._record_done(w.rank)
            elif code == contract.EXIT_FENCED:  # its node lost its ranks: see _fenced
                self._fence_check = True
            elif code == contract.EXIT_FATAL:
                if protocol.fatal(self.store) is None:
                    protocol.set_fatal(self.store, f"rank {w.rank} exited with EXIT_FATAL "
                                       f"({code}) without recording a reason")
            else:
                cause = {"kind": FailureCause.WORKER_EXIT, "rank": w.rank, "node": self.node,
                         "exitcode": code, "signal": sig}
                self._on_failure(w, cause, detected)

    def _on_hung(self, w: Worker) -> None:
        detected = time.monotonic()
        silent = detected - w.beat_seen_at
        self._emit(Event.WORKER_HUNG, rank=w.rank, pid=w.pid, silent_s=round(silent, 3),
                   because=w.hung_because)
        self._log(f"rank {w.rank} (pid {w.pid}) sent no heartbeat for {silent:.1f}s "
                  f"({w.hung_because}): killing it")
        w.kill()
        del self.workers[w.rank]
        if protocol.is_trained(self.store, w.rank):
            self._log(f"rank {w.rank} stalled on its way out after training finished")
            self._record_done(w.rank)
            return
        self._emit(Event.WORKER_EXIT, rank=w.rank, pid=w.pid, exitcode=w.proc.returncode,
                   signal=exit_signal(w.proc.returncode))
        self._publish_process(w.rank, w.pid, "exited", exitcode=w.proc.returncode,
                              signal="SIGKILL", hung=True)
        cause = {"kind": FailureCause.WORKER_HUNG, "rank": w.rank, "node": self.node,
                 "exitcode": w.proc.returncode, "signal": "SIGKILL", "silent_s": round(silent, 3)}
        self._on_failure(w, cause, detected)

    def _on_failure(self, w: Worker, cause: dict[str, Any], detected: float) -> None:
        if self._signal is not None or protocol.fatal(self.store) is not None:
            return  # the job or this node is ending (a Ctrl-C reaches workers too)
        if self._taken_over_by() is not None:
            self._fence_check = True  # the rank belongs to another node now: no failure
            return
        what = describe(cause)
        self._log(what)
        finished = self.done.finished(self.store)
        if finished:
            protocol.set_fatal(self.store, f"{what} after {finished} of {self.args.world_size} "
                               "ranks had finished; the finished ranks cannot join a recovery")
            return
        belongs = protocol.generation_of_process(self.store, w.rank, w.pid, w.gen_seen)
        if not self._declare(belongs, {**cause, "pid": w.pid, "gen_of_process": belongs}):
            return
        restart = max(w.restart_count + 1, protocol.recoveries(self.store))
        self._start_rank(w.group_rank, w.local_rank, replacement=True, restart_count=restart,
                         detected_at=detected)

    def _declare(self, observed_gen: int, cause: dict[str, Any]) -> bool:
        """Declare the failure (deduped); False when the job must stop instead."""
        what = describe(cause)
        if not self.rcfg.enabled:
            protocol.set_fatal(self.store, f"{what} and recovery.enabled is false")
            return False
        cause = {**cause, "ts": cause.get("ts", time.time())}  # workers time detect from it
        gen = protocol.declare_failure(self.store, observed_gen, cause)
        self._emit(Event.FAILURE_DECLARED, gen=gen, observed_gen=observed_gen, cause=cause,
                   recoveries=protocol.recoveries(self.store),
                   failures=protocol.failures(self.store))
        over = protocol.restart_budget_exceeded(self.store, self.rcfg.max_restarts)
        if over is not None:
            protocol.set_fatal(self.store, f"{over}; last: {what}")
            return False
        return True

    def _start_rank(self, group: int, local: int, *, replacement: bool, restart_count: int,
                    detected_at: float | None = None) -> None:
        rank = group * self.args.nproc + local
        hb = os.path.join(self.run_dir, "heartbeats", f"node{self.node}-rank{rank}-"
                          f"{next(self._seq)}.hb")
        make_heartbeat_file(hb)
        rank_vars = self.job.rank_vars(group_rank=group, local_rank=local,
                                       restart_count=restart_count, heartbeat=hb,
                                       replacement=replacement)
        a = self.args
        proc, how = launch(a.script, a.script_args, a.module, self.base_env, rank_vars,
                           self.spares, replacement=replacement,
                           should_stop=lambda: self._signal is not None)
        spare = how == "spare"
        gen = protocol.current_generation(self.store)
        self.workers[rank] = Worker(rank, local, group, proc, hb, restart_count, gen, spare)
        self._emit(Event.WORKER_START, rank=rank, local_rank=local, group_rank=group, pid=proc.pid,
                   replacement=replacement, spare=spare, started=how,
                   restart_count=restart_count)
        self._publish_process(rank, proc.pid, "running", replacement=replacement)
        if replacement:
            took = time.monotonic() - detected_at if detected_at is not None else None
            self._emit(Event.REPLACEMENT_ASSIGNED, rank=rank, pid=proc.pid, spare=spare, gen=gen,
                       started=how, seconds_since_detection=took)
            self._log(f"rank {rank} handed to {'a warm spare' if spare else 'a new process'} "
                      f"(pid {proc.pid})")

    def _record_done(self, rank: int) -> None:
        protocol.record_done(self.store, rank)

    def _stop_if_left_behind(self, w: Worker) -> None:
        """``w`` finished training while the job is in a generation it never joined:
        the other ranks recover without it and would wait for it until their rendezvous
        timed out. Stop the job at once, with the line that says why (read after the
        "done" record, so a generation declared before it is seen here and one declared
        after it sees the record: ``recovery.generation.rendezvous.finished_while_training``)."""
        try:
            if protocol.fatal(self.store) is not None:
                return
            belongs = protocol.generation_of_process(self.store, w.rank, w.pid, w.gen_seen)
            gen = protocol.current_generation(self.store)
            if gen <= belongs:
                return
            slots = world.current(self.store, gen, self.args.world_size).slots
            if (why := finished_while_training(self.store, gen, slots)) is not None:
                protocol.set_fatal(self.store, why)
        except Exception:  # the store may be going away with the job: nothing to stop
            pass

    # --- small helpers --------------------------------------------------------------
    def _ranks(self, group: int) -> list[int]:
        return [group * self.args.nproc + i for i in range(self.args.nproc)]

    def _publish_process(self, rank: int, pid: int, state: str, **extra: Any) -> None:
        """Tell the job what became of ``rank``'s process (read by a rendezvous that
        waits for it); best effort: the store may be going away with the job."""
        try:
            protocol.publish_rank_process(self.store, rank, self.node, pid, state, **extra)
        except Exception:  # never let bookkeeping stop supervision
            pass

    def _emit(self, event: str, **fields: Any) -> None:
        self.events.emit(event, node=self.node, **fields)

    def _on_auth_rejected(self, **fields: Any) -> None:
        """A store value failed the job-key check (forged, or from another job's secret)."""
        self._emit(Event.AUTH_REJECTED, **fields)
        self._log(f"ignored a value of {fields['key']!r} that is not sealed with the job's "
                  f"key ({fields['reason']})")

    def _log(self, message: str) -> None:
        worker_output.say(f"[checkpointless node {self.node}] {message}")

