"""How an agent ends its node's part of the job: done, failed, stopped by a signal, or
drained for the scheduler.

Each ending stops this node's workers and spares, records what the job needs to know
(the ``job_done`` or ``job_failed`` event, this agent finished), says it in one line,
and returns the agent's exit status (``replication.contract``: 75 and 93 tell a
scheduler whether a new run can go on). The store host lingers until the other agents
have seen the end. A mixin of :class:`launcher.agent.Agent`, like
:class:`launcher.node_loss.NodeLossHandling`: it reads the agent's state (its store,
workers, spares, events) and uses its ``_emit`` and ``_log``.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any

import torch.distributed as dist

from launcher import job_outcome, membership, worker_output
from launcher.liveness import PeerWatch
from launcher.run_args import RunArgs
from launcher.worker_procs import SparePool, Worker, stop_processes
from recovery.common.events import Event
from recovery.generation import protocol
from recovery.recipe import CheckpointlessConfig
from recovery.runtime import drain
from replication import contract

LINGER_S = 30.0  # how long the store host waits for the other agents to see the end
#: How long an agent that reads "stopped by SIGINT" from another node waits for its own.
SIGINT_GRACE_S = 0.5


class Endings:
    """The agent's endings; the annotations name the agent state they use."""

    args: RunArgs
    cfg: CheckpointlessConfig
    node: int
    run_dir: str
    store: dist.Store | None
    workers: dict[int, Worker]
    spares: SparePool | None
    watch: PeerWatch
    _signal: int | None
    _signals_seen: int
    _started_at: float

    def _emit(self, event: str, **fields: Any) -> None: ...
    def _log(self, message: str) -> None: ...

    def _done(self) -> int:
        self._stop_local()
        recoveries = protocol.recoveries(self.store)
        failures = protocol.failures(self.store)
        step = job_outcome.committed_step(self.store)
        self._emit(Event.JOB_DONE, recoveries=recoveries, failures=failures, committed_step=step)
        self._mark_finished()
        step_text = f", committed step {step}" if step is not None else ""
        gens = f" in {recoveries} generations" if recoveries != failures else ""
        durable, persisted = job_outcome.durable_outcome(self.cfg.persistence,
                                                         self._started_at)
        self._log(f"job done: {self.args.world_size} ranks finished, failures recovered: "
                  f"{failures}{gens}{step_text}{durable}; run dir {self.run_dir}")
        self._linger(LINGER_S)
        if persisted is None:
            worker_output.say(
                f"checkpointless: job done but its durable checkpoints CANNOT BE CHECKED: "
                f"persistence.path {self.cfg.persistence.path!r} cannot be read now (see "
                "the line above); the saves each rank made are its 'durable_save' events "
                "in the run dir; exit status 1")
            return 1
        if not persisted:
            worker_output.say(
                f"checkpointless: job done but NOTHING WAS PERSISTED: persistence.path "
                f"{self.cfg.persistence.path!r} holds no complete checkpoint (see the "
                "'DURABLE CHECKPOINT FAILED' lines above); exit status 1")
            return 1
        return 0

    def _drain(self) -> int:
        """The job stops for its scheduler (:mod:`recovery.runtime.drain`): ask this node's
        workers to persist the newest committed step, wait for them, exit 75 (a new run
        resumes from that step). Their exits are no failures: the fatal record says so."""
        self._log("stopping for the scheduler: the workers persist the newest committed "
                  "step, then exit")
        for w in self.workers.values():
            with contextlib.suppress(OSError):
                open(w.heartbeat + drain.STOP_SUFFIX, "a").close()
        patience = self.cfg.replication.timeout_s + 30.0  # a round, then a save
        deadline = time.monotonic() + patience
        seen = self._signals_seen  # a second signal (an operator's Ctrl-C) ends the wait
        while (time.monotonic() < deadline and self._signals_seen == seen
               and any(w.proc.poll() is None for w in self.workers.values())):
            time.sleep(0.05)
        codes = {w.rank: w.proc.poll() for w in self.workers.values()}
        self._stop_local()  # what did not end in time
        self._emit(Event.AGENT_EXIT, signal=None, drained=codes)
        self._mark_finished()
        self._linger(patience)  # the store host: until every node has persisted and left
        return contract.EXIT_RETRY

    def _fatal_exit(self, failure: dict[str, Any]) -> int:
        """End this node's part of a job that has a fatal record.

        An operator's Ctrl-C reaches every agent of the terminal, one a moment after
        another: the first to handle it records "stopped by SIGINT", and the others may
        read that record before their own signal arrives. They stop as if they had been
        interrupted (exit 130), not as a failed job: they wait a moment for their own
        SIGINT and then say in one line that the job was stopped.
        """
        reason = str(failure.get("reason", failure))
        if drain.is_drain(failure):
            return self._drain()
        if failure.get("signal") != "SIGINT":
            return self._failed(reason, job_outcome.exit_status(failure))
        deadline = time.monotonic() + SIGINT_GRACE_S
        while self._signal is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._signal is not None:
            return self._stop()
        worker_output.say(f"checkpointless: job stopped: {reason}")
        self._stop_local()
        self._emit(Event.AGENT_EXIT, signal=None, reason=reason)
        self._mark_finished()
        return contract.EXIT_INTERRUPTED

    def _failed(self, reason: str, code: int = contract.EXIT_FAILED) -> int:
        worker_output.say(f"checkpointless: job failed: {reason}{job_outcome.meaning(code)}")
        self._stop_local()
        self._emit(Event.JOB_FAILED, reason=reason)
        self._mark_finished()
        self._linger(LINGER_S)
        return code

    def _stop(self) -> int:
        """Stopped by a signal: end this node's part and exit 128 + signal.

        SIGINT (an operator) and any stop of the store host end the job; a SIGTERM of
        another node (say, a preemption) is left to look like a lost node, so a spare
        node can take its ranks over. With ``--on-sigterm drain`` (the default in a
        Slurm step, where every node gets the signal at once) a SIGTERM stops the job
        after the newest committed step is persisted instead (:meth:`_drain`).
        """
        sig = self._signal or signal.SIGTERM
        name = signal.Signals(sig).name
        if sig == signal.SIGTERM and self.args.on_sigterm == "drain" and self.store is not None:
            with contextlib.suppress(dist.DistError, RuntimeError):
                drain.request(self.store, self.node, name)
            return self._drain()
        self._log(f"{name}: stopping this node's workers")
        if self.store is not None and (sig == signal.SIGINT or self.args.hosts_store):
            with contextlib.suppress(dist.DistError, RuntimeError):
                protocol.set_fatal(self.store, f"node {self.node} stopped by {name}",
                                   signal=name)
        self._stop_local()
        self._emit(Event.AGENT_EXIT, signal=name)
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
                others = [n for n in membership.registered_nodes(self.store) if n != self.node]
                # not published: the others stop beating as they leave, which is no loss
                self.watch.check(self.store, protocol.current_generation(self.store),
                                 publish=False)
                pending = [n for n in others if n not in self.watch.lost
                           and not protocol.agent_finished(self.store, n)]
                if not pending:
                    return
                time.sleep(0.05)
