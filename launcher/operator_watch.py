"""The agent's duties to the people watching the job: metrics, status, stragglers.

Driven by the agent's loop (:meth:`OperatorWatch.tick`, every pass; the work itself at
most once a heartbeat interval):

- it reads this node's ranks' progress files (``recovery.runtime.progress_report``);
- every :data:`PUBLISH_S` it puts the node's newest step and goodput in the job store,
  for ``checkpointless status`` (``launcher.job_status``);
- unless ``recovery.stragglers: off``, it publishes and judges straggler windows
  (:mod:`launcher.stragglers`): events and console lines need no port;
- with ``recovery.metrics_port`` (``--metrics-port``) it hands the loop's figures to
  the metrics server (:mod:`launcher.metrics`).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from launcher import bind, stragglers
from launcher.metrics.node_progress import NodeProgress
from recovery.common.causes import FailureCause
from recovery.common.events import Event
from recovery.generation import status_records
from recovery.job_store import auth
from recovery.runtime.progress_report import SUFFIX

if TYPE_CHECKING:
    from launcher.agent import Agent
    from launcher.metrics.exporter import AgentMetrics

#: How often an agent puts its node's progress in the job store (seconds).
PUBLISH_S = 5.0


class OperatorWatch:
    """Metrics, status records and straggler detection for one agent; see the module doc."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        rcfg = agent.rcfg
        self.mode = rcfg.stragglers
        self.stragglers = None if self.mode == "off" else stragglers.StragglerWatch(
            world_size=lambda: agent.args.world_size, factor=rcfg.straggler_factor)
        self._paths: dict[int, str] = {}  # rank -> progress file, replaced whole each tick
        self.progress = NodeProgress(lambda: self._paths)
        self.metrics: AgentMetrics | None = None
        self._next = self._next_publish = 0.0
        self._last_error = ""
        self._published: tuple[int, float] | None = None  # (step, time) put last
        if rcfg.metrics_port:
            from launcher.metrics import exporter  # prometheus_client: only when asked for

            self.metrics = exporter.start(
                agent.args.rdzv_id, agent.node, agent.events.path, rcfg.metrics_port,
                self._address(), self.progress, self.stragglers, agent._log)

    def _address(self) -> str:
        """The agent's own address, as the job binds it (``launcher.bind``)."""
        plan = self.agent.job_store.plan
        if plan.address is not None:
            return plan.address
        host, port = self.agent.job_store.address.endpoints[0]
        return bind.route_source(host, port) or "127.0.0.1"

    def tick(self, gen: int) -> None:
        """The agent's loop, each pass: cheap unless a heartbeat interval has passed."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.agent.rcfg.heartbeat_interval_s
        a = self.agent
        self._paths = {rank: w.heartbeat + SUFFIX for rank, w in a.workers.items()}
        spares = a.spares.idle_count() if a.spares is not None else 0
        role = "spare node" if a.group is None else "training"
        if self.metrics is not None:
            self.metrics.tick(a.store, gen, role, spares)
        records = self.progress.read()
        if now >= self._next_publish:
            self._next_publish = now + PUBLISH_S
            self._publish(records, role, spares)
        if self.stragglers is None:
            return
        try:
            verdicts = self.stragglers.tick(a.store, records)
        except Exception as exc:  # the store is the loop's to judge; report once, go on
            if str(exc) != self._last_error:
                a._log(f"straggler detection skipped a window: {exc}")
            self._last_error = str(exc)
            return
        for v in verdicts:
            self._on_straggler(v)

    def _publish(self, records: dict[int, dict[str, Any]], role: str, spares: int) -> None:
        steps = [int(r.get("highest_step") or 0) for r in records.values()]
        step, now = max(steps, default=None), time.time()
        rate = None
        if step is not None and self._published is not None and now > self._published[1]:
            rate = round(max(0, step - self._published[0]) / (now - self._published[1]), 3)
        if step is not None:
            self._published = (step, now)
        record = {"ts": now, "role": role, "ranks": sorted(records), "step": step,
                  "steps_per_s": rate, "goodput": self.progress.goodput(records),
                  "spares_idle": spares,
                  "stragglers": dict(self.stragglers.counts) if self.stragglers else {}}
        try:
            auth.put(self.agent.store, status_records.node_progress_key(self.agent.node),
                     json.dumps(record))
        except Exception:
            pass  # the loop notices a store that does not answer on its own

    def _on_straggler(self, v: stragglers.Verdict) -> None:
        a = self.agent
        w = a.workers.get(v.rank)
        free = a.spares.idle_count() if a.spares is not None else 0
        replace = self.mode == "replace" and free > 0 and w is not None
        a._emit(Event.STRAGGLER, **v.fields(), action="replace" if replace else "report")
        a._log(f"rank {v.rank} on node {a.node} is a straggler: its own share of the step "
               f"took {v.factor:.1f}x the job's median over steps up to {v.end_step} "
               f"({v.own_s * 1000:.0f} ms against {v.median_s * 1000:.0f} ms)"
               + ("; handing it to a warm spare" if replace else
                  "; no warm spare is free, so it goes on" if self.mode == "replace" else ""))
        if not replace:
            return
        detected = time.monotonic()
        w.kill()
        del a.workers[w.rank]
        a._emit(Event.WORKER_EXIT, rank=w.rank, pid=w.pid, exitcode=w.proc.returncode,
                signal="SIGKILL", straggler=True)
        a._publish_process(w.rank, w.pid, "exited", exitcode=w.proc.returncode,
                           signal="SIGKILL", straggler=True)
        cause = {"kind": FailureCause.STRAGGLER, "rank": w.rank, "node": a.node,
                 "factor": round(v.factor, 2), "window": v.window}
        a._on_failure(w, cause, detected)

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
