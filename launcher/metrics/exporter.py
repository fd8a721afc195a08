"""The agent's ``/metrics``: a collector built at each scrape, and its HTTP server.

The agent's loop hands over what only it may read (the job store's facts, its workers
and spares) through :meth:`AgentMetrics.tick`; the scrape thread reads the progress
files and the events file itself. A scrape never touches the store and never blocks
the loop: the loop's part is a few plain assignments and, every 5 s, the store
reads of :class:`~launcher.metrics.job_facts.JobFacts`.

Every metric carries ``job_id`` (``job`` is Prometheus's own label, the scrape job);
the node's own figures carry ``node``, each rank's ``rank`` too. Job-wide figures
(generation, committed step, failures) are the same on every agent: aggregate them
with ``max``, not ``sum``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from launcher.metrics.job_facts import JobFacts, is_failure_cause
from launcher.metrics.node_progress import NodeProgress
from launcher.metrics.recovery_events import RecoveryEvents
from launcher.stragglers import StragglerWatch

PREFIX = "checkpointless_"


class AgentMetrics(Collector):
    """Everything one agent exports; :meth:`serve` starts its HTTP server."""

    def __init__(self, job_id: str, node: int, events_path: str, progress: NodeProgress,
                 stragglers: StragglerWatch | None = None) -> None:
        self.job_id, self.node = job_id, str(node)
        self.facts = JobFacts()
        self.progress = progress
        self.events = RecoveryEvents(events_path, lambda: list(progress.paths()))
        self.stragglers = stragglers
        self.role = "starting"
        self.spares_idle = 0
        self.server: Any = None
        self.scrape_s = 0.0  # the newest scrape's own time, exported for its cost

    # -- the agent's loop ------------------------------------------------------------
    def tick(self, store: Any, gen: int, role: str, spares_idle: int) -> None:
        self.role, self.spares_idle = role, spares_idle
        self.facts.refresh(store, gen)

    # -- the server ------------------------------------------------------------------
    def serve(self, port: int, address: str) -> tuple[str, int]:
        """Serve ``/metrics`` on ``address:port``; returns where (port 0: any free)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self.server, _thread = start_http_server(port, addr=address, registry=registry)
        host, bound = self.server.server_address[:2]
        return str(host), int(bound)

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    # -- one scrape ------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        t0 = time.perf_counter()
        records = self.progress.read()
        self.events.read()
        yield from self._job()
        yield from self._node(records)
        yield from self._ranks(records)
        yield from self._recoveries()
        scrape = GaugeMetricFamily(PREFIX + "metrics_scrape_seconds",
                                   "How long the previous scrape of this agent took",
                                   labels=["job_id", "node"])
        scrape.add_metric([self.job_id, self.node], self.scrape_s)
        yield scrape
        self.scrape_s = time.perf_counter() - t0

    def _job(self) -> Iterator[Any]:
        f = self.facts.figures()
        ids = [self.job_id]
        yield _gauge("generation", "The job's generation (0 before any failure)",
                     f["generation"], ["job_id"], ids)
        yield _gauge("committed_step", "The newest step every copy holds (-1: none)",
                     f["committed_step"], ["job_id"], ids)
        yield _counter("failures", "Distinct failures so far (each counted once however "
                       "many declared it)", f["failures"], ["job_id"], ids)
        yield _counter("recoveries", "Generations after the first: in-process recoveries "
                       "(one failure can take several)", f["generation"], ["job_id"], ids)
        by_cause = CounterMetricFamily(
            PREFIX + "generations_by_cause", "Generations by the cause that made them "
            "(peer_failure and the like are consequences of another failure)",
            labels=["job_id", "cause", "failure"])
        for cause, n in sorted(f["generations_by_cause"].items()):
            by_cause.add_metric([*ids, cause, str(is_failure_cause(cause)).lower()], n)
        yield by_cause
        failures = CounterMetricFamily(
            PREFIX + "failures_by_cause", "Distinct failures by what failed (worker_exit, "
            "worker_hung, node_lost, exception, straggler)", labels=["job_id", "cause"])
        for cause, n in sorted(f["failures_by_cause"].items()):
            failures.add_metric([*ids, cause], n)
        yield failures
        yield _gauge("job_fatal", "1 once the job recorded why it must stop",
                     1 if f["fatal"] else 0, ["job_id"], ids)

    def _node(self, records: Mapping[int, Mapping[str, Any]]) -> Iterator[Any]:
        labels = ["job_id", "node"]
        values = [self.job_id, self.node]
        info = GaugeMetricFamily(PREFIX + "agent_info", "This agent and its role",
                                 labels=[*labels, "role"])
        info.add_metric([*values, self.role], 1)
        yield info
        goodput = self.progress.goodput(records)
        if goodput is not None:
            yield _gauge("goodput", "Productive step time over wall time since this node's "
                         "first step (steps gained at the failure-free pace)", goodput,
                         labels, values)
        steps = [int(r.get("highest_step") or 0) for r in records.values()]
        if steps:
            yield _gauge("step", "The newest step this node's ranks completed", max(steps),
                         labels, values)
        yield _counter("steps_replayed", "Steps this node's ranks ran again after a "
                       "rollback", self.progress.steps_replayed(), labels, values)
        yield _gauge("spares_idle", "Warm spares this agent can hand a failed rank to now",
                     self.spares_idle, labels, values)
        if self.stragglers is not None:
            found = CounterMetricFamily(PREFIX + "stragglers", "Windows in which this "
                                        "rank was a straggler", labels=[*labels, "rank"])
            counts = {rank: 0 for rank in records} | self.stragglers.counts
            for rank, n in sorted(counts.items()):
                found.add_metric([*values, str(rank)], n)
            yield found

    def _ranks(self, records: Mapping[int, Mapping[str, Any]]) -> Iterator[Any]:
        labels = ["job_id", "node", "rank"]
        now = time.time()
        fams = {name: GaugeMetricFamily(PREFIX + name, doc, labels=labels) for name, doc in (
            ("step_seconds", "Median wall time of a step over the last hundred"),
            ("own_step_seconds", "Median own share of a step (not waiting in a "
             "collective) over the newest straggler window"),
            ("straggler_factor", "Own step time over the job's median, newest window judged"),
            ("replication_lag_steps", "Steps since the newest step this rank knows committed"),
            ("replica_bytes_sent", "Bytes this rank sent to its replica holders, newest round"),
            ("replica_bytes_received", "Bytes this rank received as a replica holder, "
             "newest round"),
            ("state_bytes", "The size of this rank's training state"),
            ("durable_save_age_seconds", "Since this rank's newest good durable save finished"),
            ("durable_last_save_ok", "1 when this rank's newest durable save succeeded"),
            ("durable_save_throughput_bytes_per_second", "Throughput of this rank's newest "
             "durable save"),
        )}
        memory = GaugeMetricFamily(PREFIX + "memory_bytes", "Host memory this rank holds for "
                                   "recovery, per tier", labels=[*labels, "tier"])
        saves = CounterMetricFamily(PREFIX + "durable_saves", "This rank's durable saves by "
                                    "outcome", labels=[*labels, "status"])
        factors = self.stragglers.factors if self.stragglers is not None else {}
        for rank, rec in sorted(records.items()):
            v = [self.job_id, self.node, str(rank)]
            _add(fams["step_seconds"], v, rec.get("step_s"))
            windows = rec.get("windows") or []
            _add(fams["own_step_seconds"], v, windows[-1]["own_s"] if windows else None)
            _add(fams["straggler_factor"], v, factors.get(rank))
            _add(fams["replication_lag_steps"], v, rec.get("replication_lag_steps"))
            _add(fams["replica_bytes_sent"], v, rec.get("replica_bytes_sent"))
            _add(fams["replica_bytes_received"], v, rec.get("replica_bytes_received"))
            _add(fams["state_bytes"], v, rec.get("state_bytes"))
            for tier, n in (rec.get("memory_bytes") or {}).items():
                memory.add_metric([*v, tier], float(n))
            durable = rec.get("durable")
            if durable:
                if durable.get("newest_ok_ts"):
                    _add(fams["durable_save_age_seconds"], v, now - durable["newest_ok_ts"])
                _add(fams["durable_last_save_ok"], v, 1 if durable["status"] == "ok" else 0)
                if durable.get("duration_s"):
                    _add(fams["durable_save_throughput_bytes_per_second"], v,
                         durable["bytes"] / durable["duration_s"])
                saves.add_metric([*v, "ok"], durable.get("saves_ok", 0))
                saves.add_metric([*v, "failed"], durable.get("saves_failed", 0))
        yield from fams.values()
        yield memory
        yield saves

    def _recoveries(self) -> Iterator[Any]:
        labels = ["job_id", "node"]
        values = [self.job_id, self.node]
        phases = HistogramMetricFamily(
            PREFIX + "recovery_phase_seconds", "Recovery seconds by phase, one observation "
            "per rank and recovery (detect, abort, rendezvous, transfer add up to the "
            "recovery)", labels=[*labels, "phase"])
        for phase, hist in self.events.phases.items():
            phases.add_metric([*values, phase], hist.cumulative(), hist.total)
        yield phases
        total = HistogramMetricFamily(
            PREFIX + "recovery_seconds", "From the fault to the recovered state, one "
            "observation per rank and recovery", labels=labels)
        total.add_metric(values, self.events.total.cumulative(), self.events.total.total)
        yield total


def _gauge(name: str, doc: str, value: float, labels: list[str],
           values: list[str]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
    fam.add_metric(values, float(value))
    return fam


def _counter(name: str, doc: str, value: float, labels: list[str],
             values: list[str]) -> CounterMetricFamily:
    fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    fam.add_metric(values, float(value))
    return fam


def _add(fam: GaugeMetricFamily, values: list[str], value: Any) -> None:
    if value is not None:
        fam.add_metric(values, float(value))


def start(job_id: str, node: int, events_path: str, port: int, address: str,
          progress: NodeProgress, stragglers: StragglerWatch | None,
          log: Callable[[str], None]) -> AgentMetrics | None:
    """The agent's metrics, served; None (and one line) when the port cannot be bound."""
    metrics = AgentMetrics(job_id, node, events_path, progress, stragglers)
    try:
        host, bound = metrics.serve(port, address)
    except OSError as exc:
        log(f"cannot serve metrics on {address}:{port} ({exc}); the job runs without them")
        return None
    shown = f"[{host}]" if ":" in host else host
    log(f"metrics on http://{shown}:{bound}/metrics (bound to this agent's address; "
        "put it behind the cluster's network policy, see docs/guide/operations.md)")
    return metrics
