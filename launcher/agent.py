"""The per-node agent: join the job, run this node's ranks, keep them running.

One poll loop (every ``--monitor-interval``, 50 ms by default) does, in order: react to
a signal; read the generation and the fatal flag; look at each worker (exit code,
heartbeat file); keep the spare pool full; every heartbeat interval, look at the other
agents' heartbeats; settle lost groups; stop when every rank has finished.

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
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch.distributed as dist

from launcher import reaper, worker_output
from launcher import rendezvous as rdzv
from launcher.report.record import recorded_config
from launcher.run_args import RunArgs
from launcher.worker_env import JobEnv
from launcher.worker_procs import (
    SparePool,
    Worker,
    exit_signal,
    launch,
    make_heartbeat_file,
    stop_processes,
)
from launcher.zygote import Zygote
from recovery import auth, protocol
from recovery.recipe import CheckpointlessConfig, config_to_json

LINGER_S = 30.0  # how long the store host waits for the other agents to see the end
EXIT_FENCED = 4  # this node was declared lost and its ranks taken over: it left the job
#: How many heartbeat timeouts a lost group waits for a spare node, or for its own node
#: to come back, before the job stops. A spare node notices the loss on its own clock,
#: one timeout after it last saw the node alive, and one that just started gives every
#: peer a full timeout of grace. The chaos soak saw agents on an overloaded host stall
#: for 6-15 s and come back: waiting longer only delays a stop that is due anyway.
TAKEOVER_PATIENCE = 4.0
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


class JoinError(RuntimeError):
    """This agent cannot take part in the job (its node rank is already taken)."""


@dataclass
class _LostGroup:
    lost_node: int
    detected_at: float  # monotonic
    gen: int  # the generation the lost node was last seen alive in


class Agent:
    """Supervises one node's workers; see the module docstring for the loop."""

    def __init__(self, args: RunArgs, cfg: CheckpointlessConfig, run_dir: str) -> None:
        self.args, self.cfg, self.run_dir = args, cfg, run_dir
        self._started_at = time.time()  # this run's rows in the durable history are newer
        self.node = args.node_rank
        self.rcfg = cfg.recovery
        events_file = cfg.recovery.events_file or os.path.join(run_dir, "events.jsonl")
        self.events = protocol.EventLog(events_file, source=f"agent{self.node}")
        self.group: int | None = None  # the node-group this agent runs; None while idle
        self.workers: dict[int, Worker] = {}
        self.lost_groups: dict[int, _LostGroup] = {}
        self.watch = rdzv.PeerWatch(self.node, cfg.recovery.heartbeat_timeout_s)
        self.store: dist.Store | None = None
        self.spares: SparePool | None = None
        self.heartbeat: rdzv.Heartbeat | None = None
        self.job_store: rdzv.JobStore | None = None
        self.done = rdzv.DoneWatch(args.world_size)
        self._signal: int | None = None
        self._wake = threading.Event()
        self._seq = itertools.count()
        self._next_peer_check = 0.0
        self._next_reap = 0.0
        self._subreaper = False  # orphans below this agent come to it (see _start_zygote)
        self._fence_check = False  # look at this node's group ownership on the next pass
        self._fenced_out = False  # this node lost its ranks; it never takes any over

    # --- entry ----------------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal_received)
        try:
            self._connect()
            if not self._check_storage() or not self._join():
                if self._signal is not None:
                    return self._stop()
                failure = protocol.fatal(self.store) or {}
                return self._failed(str(failure.get("reason", failure)))
            if self.group is not None:
                for local in range(self.args.nproc):
                    self._start_rank(self.group, local, replacement=False, restart_count=0)
            return self._loop()
        except (rdzv.StoreUnavailable, JoinError) as exc:
            return self._stop() if self._signal is not None else self._failed(str(exc))
        except dist.DistError as exc:
            where = f"{self.args.host}:{self.args.port}"
            return self._failed(f"lost the job store at {where} ({rdzv.brief(exc)})")
        except TimeoutError as exc:  # a declarer died half-way through declare_failure
            with contextlib.suppress(dist.DistError, RuntimeError):
                protocol.set_fatal(self.store, f"the generation is stuck: {exc}")
            return self._failed(f"the generation is stuck: {exc}")
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self._stop_local()
            worker_output.drain()  # the workers' last lines, before we exit
            if self.job_store is not None:
                self.job_store.release()

    def _on_signal_received(self, signum: int, _frame: Any) -> None:
        if self._signal is None:
            self._signal = signum
        self._wake.set()

    # --- joining --------------------------------------------------------------------
    def _connect(self) -> None:
        a = self.args
        auth.set_reporter(self._on_auth_rejected)  # values that fail the job-key check
        self.job_store = rdzv.open_job_store(a, self.run_dir, lambda: self._signal is not None,
                                             self._log)
        self.store, port = self.job_store.store, self.job_store.port
        self.cfg.run_dir = self.run_dir
        self.cfg.recovery.events_file = self.events.path
        self.job = JobEnv(
            store_host=a.host, store_port=port, nproc=a.nproc, nnodes=a.nnodes,
            node=self.node, run_id=a.rdzv_id, max_restarts=self.rcfg.max_restarts,
            run_dir=self.run_dir, config_json=config_to_json(self.cfg),
            job_key=self.job_store.signer.key_hex(), gloo_ifname=self.job_store.plan.gloo_ifname,
        )
        self.base_env = self.job.base()
        self.spares = SparePool(a.spares, self.base_env, self._emit, self._start_zygote())
        self.spares.fill()  # the zygote (or each spare) imports while the other nodes join
        if not a.is_spare_node and not rdzv.own_group(self.store, self.node, self.node):
            raise JoinError(
                f"node rank {self.node} already joined job {a.rdzv_id!r}; start a "
                f"replacement node with --node-rank >= {a.nnodes} to make it a spare node"
            )
        self.group = None if a.is_spare_node else self.node
        rdzv.register(self.store, self.node, a.nproc, spare=a.is_spare_node)
        self.heartbeat = rdzv.Heartbeat(a.host, port, self.node, self.rcfg.heartbeat_interval_s,
                                        group_of=lambda: self.group)
        self.heartbeat.start()
        role = "spare node" if a.is_spare_node else f"ranks {self._ranks(self.node)}"
        # world size, cwd and the resolved recipe let `checkpointless report` read the run
        self._emit("agent_start", pid=os.getpid(), role=role, store=f"{a.host}:{port}",
                   world_size=a.world_size, cwd=os.getcwd(), config=recorded_config(self.cfg))
        self._log(f"joined job {a.rdzv_id!r} ({role}, store {a.host}:{port}, "
                  f"run dir {self.run_dir})")
        self._log(f"listening on {self.job_store.plan.describe}")

    def _start_zygote(self) -> Zygote | None:
        """The process that spares are forked from (ADR 0011), where this node keeps
        spares, the user did not turn it off, and the agent can adopt the forks."""
        if self.args.spares <= 0 or not self.args.fork_spares:
            return None
        if not reaper.become_subreaper():
            self._log("cannot adopt forked spares here (no PR_SET_CHILD_SUBREAPER): "
                      "each spare imports torch itself")
            return None
        self._subreaper = True
        zygote = Zygote(self.base_env, self._emit)
        zygote.start()
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
        ends the job with one line on every node. False to stop."""
        p = self.cfg.persistence
        if not p.path:
            return True
        from replication.durable.probe import probe_storage  # fsspec: only when used

        problem = probe_storage(p.path, dict(p.storage_options),
                                should_stop=lambda: self._signal is not None)
        if problem is not None:
            protocol.set_fatal(self.store, problem, node=self.node)
            return False
        return True

    def _join(self) -> bool:
        """Wait until every group has its agent, like torchrun's rendezvous; False to stop."""
        problem = rdzv.wait_for_groups(self.store, self.args.nnodes, self.args.nproc,
                                       self.args.join_timeout_s, lambda: self._signal is not None)
        if problem:
            protocol.set_fatal(self.store, problem)
        return problem is None and self._signal is None and protocol.fatal(self.store) is None

    # --- the loop -------------------------------------------------------------------
    def _loop(self) -> int:
        timer = _PassTimer()
        while True:
            timer.start()
            if self._signal is not None:
                return self._stop()
            gen = protocol.current_generation(self.store)  # before looking at anyone
            failure = protocol.fatal(self.store)
            if failure is not None:
                return self._failed(str(failure.get("reason", failure)))
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
            if self._fence_check:
                self._fence_check = False
                if (taker := self._taken_over_by()) is not None:
                    self._fenced(taker)
                    if not self.args.hosts_store:  # the store host stays, idle, to the end
                        return EXIT_FENCED
            self._settle_lost_groups(gen)
            timer.lap("peers")
            if self.done.all_done(self.store, idle=not self.workers):
                return self._done()
            timer.lap("done")
            if (stall := timer.stalled(STALL_REPORT_S)) is not None:
                self._emit("agent_stalled", **stall)
            self._wake.wait(self.args.monitor_interval_s)

    def _poll_workers(self, gen: int) -> None:
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None:
                if w.observe(gen, self.rcfg.heartbeat_timeout_s):
                    self._on_hung(w)
                continue
            detected = time.monotonic()
            del self.workers[w.rank]
            sig = exit_signal(code)
            self._emit("worker_exit", rank=w.rank, pid=w.pid, exitcode=code, signal=sig)
            self._publish_process(w.rank, w.pid, "exited", exitcode=code, signal=sig)
            if code == 0:
                self._record_done(w.rank)
            elif protocol.is_trained(self.store, w.rank):
                # Its last step was committed everywhere; a crash on the way out loses
                # nothing and must not start a recovery the finished ranks cannot join.
                self._log(f"rank {w.rank} exited with {sig or code} after training finished")
                self._record_done(w.rank)
            elif code == protocol.EXIT_FENCED:  # its node lost its ranks: see _fenced
                self._fence_check = True
            elif code == protocol.EXIT_FATAL:
                if protocol.fatal(self.store) is None:
                    protocol.set_fatal(self.store, f"rank {w.rank} exited with EXIT_FATAL "
                                       f"({code}) without recording a reason")
            else:
                cause = {"kind": "worker_exit", "rank": w.rank, "node": self.node,
                         "exitcode": code, "signal": sig}
                self._on_failure(w, cause, detected)

    def _on_hung(self, w: Worker) -> None:
        detected = time.monotonic()
        silent = detected - w.beat_seen_at
        self._emit("worker_hung", rank=w.rank, pid=w.pid, silent_s=round(silent, 3))
        self._log(f"rank {w.rank} (pid {w.pid}) sent no heartbeat for {silent:.1f}s: killing it")
        w.kill()
        del self.workers[w.rank]
        if protocol.is_trained(self.store, w.rank):
            self._log(f"rank {w.rank} stalled on its way out after training finished")
            self._record_done(w.rank)
            return
        self._emit("worker_exit", rank=w.rank, pid=w.pid, exitcode=w.proc.returncode,
                   signal=exit_signal(w.proc.returncode))
        self._publish_process(w.rank, w.pid, "exited", exitcode=w.proc.returncode,
                              signal="SIGKILL", hung=True)
        cause = {"kind": "worker_hung", "rank": w.rank, "node": self.node,
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
        self._emit("failure_declared", gen=gen, observed_gen=observed_gen, cause=cause,
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
        pool = self.spares if replacement else None  # the first launch starts fresh processes
        proc, spare = launch(a.script, a.script_args, a.module, self.base_env, rank_vars, pool)
        gen = protocol.current_generation(self.store)
        self.workers[rank] = Worker(rank, local, group, proc, hb, restart_count, gen, spare)
        self._emit("worker_start", rank=rank, local_rank=local, group_rank=group, pid=proc.pid,
                   replacement=replacement, spare=spare, restart_count=restart_count)
        self._publish_process(rank, proc.pid, "running", replacement=replacement)
        if replacement:
            took = time.monotonic() - detected_at if detected_at is not None else None
            self._emit("replacement_assigned", rank=rank, pid=proc.pid, spare=spare, gen=gen,
                       seconds_since_detection=took)
            self._log(f"rank {rank} handed to {'a warm spare' if spare else 'a new process'} "
                      f"(pid {proc.pid})")

    def _record_done(self, rank: int) -> None:
        protocol.record_done(self.store, rank)

    # --- other nodes ----------------------------------------------------------------
    def _check_peers(self, gen: int) -> None:
        for lost in self.watch.check(self.store, gen):
            owners = rdzv.owners(self.store, self.args.nnodes)
            groups = [g for g, owner in owners.items() if owner == lost]
            ranks = [r for g in groups for r in self._ranks(g)]
            silent = self.watch.silent_for(lost)
            self._emit("node_lost", lost_node=lost, groups=groups, ranks=ranks,
                       silent_s=round(silent, 3))
            held = f"ranks {ranks}" if ranks else "its ranks already run on another node"
            self._log(f"node {lost} lost (no heartbeat for {silent:.1f}s; {held})")
            observed = protocol.generation_of_node(self.store, ranks, lost,
                                                   self.watch.gen_alive(lost, gen))
            for g in groups:
                self.lost_groups[g] = _LostGroup(lost, time.monotonic(), observed)
                if self.group is not None:  # active agents declare too; it dedupes
                    cause = self._node_lost_cause(lost, g)
                    self._declare(observed, cause)

    def _node_lost_cause(self, node: int, group: int) -> dict[str, Any]:
        """The cause of a node loss; its agent's pid makes every declarer of the same
        loss (its watchers, the spare node taking over) count one failure."""
        info = rdzv.agent_info(self.store, node) or {}
        return {"kind": "node_lost", "node": node, "group": group,
                "ranks": self._ranks(group), "agent_pid": info.get("pid")}

    def _settle_lost_groups(self, gen: int) -> None:
        """Take over a lost group if idle; keep it where its node came back before
        anyone took it; give up on it when nobody does either in time."""
        for g, lost in list(self.lost_groups.items()):
            owner = rdzv.owner(self.store, g)
            if owner is not None and owner != lost.lost_node:
                del self.lost_groups[g]  # someone (maybe this agent) took it
            elif owner == lost.lost_node and self._returned(lost.lost_node, gen):
                # Only slow (a starved agent): its workers join the generation its loss
                # started, as survivors. Better than stopping the job for want of a
                # spare node, and no fencing is needed: the owner record is unchanged.
                del self.lost_groups[g]
                self._emit("node_returned", lost_node=lost.lost_node, group=g,
                           after_s=round(time.monotonic() - lost.detected_at, 3))
                self._log(f"node {lost.lost_node} is back (its heartbeat resumed) and "
                          f"nobody took ranks {self._ranks(g)} over: they stay there")
            elif (self.group is None and not self._fenced_out
                  and rdzv.take_over(self.store, g, lost.lost_node, self.node)):
                del self.lost_groups[g]
                self._adopt(g, lost)
            elif (time.monotonic() - lost.detected_at
                  > TAKEOVER_PATIENCE * self.rcfg.heartbeat_timeout_s):
                del self.lost_groups[g]
                protocol.set_fatal(self.store, f"node {lost.lost_node} lost (ranks "
                                   f"{self._ranks(g)}) and no spare node took them over")

    def _returned(self, node: int, gen: int) -> bool:
        """The lost ``node`` heartbeats again (checked once per node: its other groups
        see it watched again)."""
        return node not in self.watch.lost or self.watch.returned(self.store, node, gen)

    def _adopt(self, group: int, lost: _LostGroup) -> None:
        self.group = group
        ranks = self._ranks(group)
        self._emit("node_takeover", lost_node=lost.lost_node, group=group, ranks=ranks)
        self._log(f"taking over ranks {ranks} of lost node {lost.lost_node}")
        cause = self._node_lost_cause(lost.lost_node, group)
        # A fresh generation, never a dedupe into the one the loss started: a node that
        # was only slow may have had its workers join that one already. They fence
        # themselves in the new one (the owner record changed first), which the
        # replacements started below join.
        if not self._declare(protocol.current_generation(self.store), cause):
            return
        restart = protocol.recoveries(self.store)
        for local in range(self.args.nproc):
            self._start_rank(group, local, replacement=True, restart_count=restart,
                             detected_at=lost.detected_at)

    # --- fencing --------------------------------------------------------------------
    def _taken_over_by(self) -> int | None:
        """The node that took this agent's ranks over, if one did.

        A node is declared lost when its heartbeat is late, which a merely slow node can
        be (a starved agent on an overloaded host); a spare node then owns its group.
        """
        if self.group is None:
            return None
        owner = rdzv.owner(self.store, self.group)
        return owner if owner is not None and owner != self.node else None

    def _fenced(self, taker: int) -> None:
        """Stop this node's workers and spares: its ranks run on ``taker`` now, so none of
        its processes may take part (their runtime also refuses to rejoin on its own).

        The other agents count this node as lost for good, so it must never take ranks
        over again: it leaves the job, or, hosting the job's store, stays idle to the end.
        """
        ranks = self._ranks(self.group) if self.group is not None else []
        self._emit("node_fenced", group=self.group, ranks=ranks, taken_over_by=taker)
        leaving = "staying idle: it hosts the job's store" if self.args.hosts_store else (
            f"leaving the job (exit {EXIT_FENCED})")
        self._log(f"this node was declared lost and node {taker} took ranks {ranks} over; "
                  f"stopping this node's workers and {leaving}")
        stop_processes([w.proc for w in self.workers.values()], grace_s=0.0)
        self.workers.clear()
        self.group, self._fenced_out = None, True
        if self.spares is not None:
            self.spares.size = 0
        self._stop_local()
        if not self.args.hosts_store:
            self._mark_finished()

    # --- endings --------------------------------------------------------------------
    def _done(self) -> int:
        self._stop_local()
        recoveries = protocol.recoveries(self.store)
        failures = protocol.failures(self.store)
        step = rdzv.committed_step(self.store)
        self._emit("job_done", recoveries=recoveries, failures=failures, committed_step=step)
        self._mark_finished()
        step_text = f", committed step {step}" if step is not None else ""
        gens = f" in {recoveries} generations" if recoveries != failures else ""
        durable, persisted = self._durable_outcome()
        self._log(f"job done: {self.args.world_size} ranks finished, failures recovered: "
                  f"{failures}{gens}{step_text}{durable}; run dir {self.run_dir}")
        self._linger(LINGER_S)
        if not persisted:
            print(f"checkpointless: job done but NOTHING WAS PERSISTED: persistence.path "
                  f"{self.cfg.persistence.path!r} holds no complete checkpoint (see the "
                  "'DURABLE CHECKPOINT FAILED' lines above); exit status 1",
                  file=sys.stderr, flush=True)
            return 1
        return 0

    def _durable_outcome(self) -> tuple[str, bool]:
        """For the last line: the newest complete checkpoint at ``persistence.path``
        (read back from storage, not taken from the writers' word), and whether a run
        that asked for persistence got any. A run that persisted nothing exits 1."""
        p = self.cfg.persistence
        if not p.path:
            return "", True
        from replication.durable import DurableError, latest_checkpoint

        try:
            newest = latest_checkpoint(p.path, dict(p.storage_options))
        except (DurableError, OSError) as exc:
            return f", durable: cannot list {p.path!r} ({exc})", False
        saves = self._durable_saves(p.path, dict(p.storage_options))
        if newest is None:
            return f", durable: nothing persisted{saves}", False
        return f", durable: newest complete checkpoint step {newest.step}{saves}", True

    def _durable_saves(self, url: str, options: dict) -> str:
        """This run's saves by outcome, from the checkpoint history on storage (each
        rank appends a row per save), e.g. " (38 rank saves: 36 ok, 2 failed)"."""
        from replication.durable import read_history

        def when(row: dict[str, str]) -> float:  # ISO 8601 with a Z
            return datetime.fromisoformat(row["timestamp"].replace("Z", "+00:00")).timestamp()

        try:
            rows = [r for r in read_history(url, options) if when(r) >= self._started_at]
        except Exception:  # the summary is a courtesy: never fail the ending on it
            return ""
        if not rows:
            return ""
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.get("status") or "?"] = counts.get(r.get("status") or "?", 0) + 1
        parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        return f" ({len(rows)} rank saves: {parts})"

    def _failed(self, reason: str) -> int:
        print(f"checkpointless: job failed: {reason}", file=sys.stderr, flush=True)
        self._stop_local()
        self._emit("job_failed", reason=reason)
        self._mark_finished()
        self._linger(LINGER_S)
        return 1

    def _stop(self) -> int:
        """Stopped by a signal: end this node's part and exit 128 + signal.

        SIGINT (an operator) and any stop of the store host end the job; a SIGTERM of
        another node (say, a preemption) is left to look like a lost node, so a spare
        node can take its ranks over.
        """
        sig = self._signal or signal.SIGTERM
        name = signal.Signals(sig).name
        self._log(f"{name}: stopping this node's workers")
        if self.store is not None and (sig == signal.SIGINT or self.args.hosts_store):
            with contextlib.suppress(dist.DistError, RuntimeError):
                protocol.set_fatal(self.store, f"node {self.node} stopped by {name}")
        self._stop_local()
        self._emit("agent_exit", signal=name)
        self._mark_finished()
        self._linger(5.0)
        return 128 + sig

    def _stop_local(self) -> None:
        stop_processes([w.proc for w in self.workers.values()])
        self.workers.clear()
        if self.spares is not None:
            self.spares.stop()

    def _mark_finished(self) -> None:
        if self.store is not None:
            with contextlib.suppress(dist.DistError, RuntimeError):
                protocol.mark_agent_finished(self.store, self.node)

    def _linger(self, bound_s: float) -> None:
        """The store host waits until the other agents have seen the end (bounded)."""
        if not self.args.hosts_store or self.store is None:
            return
        deadline = time.monotonic() + bound_s
        with contextlib.suppress(dist.DistError, RuntimeError):
            while time.monotonic() < deadline:
                others = [n for n in rdzv.registered_nodes(self.store) if n != self.node]
                self.watch.check(self.store, protocol.current_generation(self.store))
                pending = [n for n in others if n not in self.watch.lost
                           and not protocol.agent_finished(self.store, n)]
                if not pending:
                    return
                time.sleep(0.05)

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
        self._emit("auth_rejected", **fields)
        self._log(f"ignored a value of {fields['key']!r} that is not sealed with the job's "
                  f"key ({fields['reason']})")

    def _log(self, message: str) -> None:
        print(f"[checkpointless node {self.node}] {message}", file=sys.stderr, flush=True)


def describe(cause: dict[str, Any]) -> str:
    """A failure cause in words, for logs and fatal reasons."""
    kind = cause.get("kind")
    if kind == "node_lost":
        return f"node {cause.get('node')} lost (ranks {cause.get('ranks')})"
    where = f"rank {cause.get('rank')} on node {cause.get('node')}"
    if kind == "worker_hung":
        return f"{where} hung (no heartbeat for {cause.get('silent_s')}s)"
    if cause.get("signal"):
        return f"{where} was killed by {cause['signal']}"
    return f"{where} exited with code {cause.get('exitcode')}"

