"""What an agent does about lost nodes: take their ranks over, keep them, or step aside.

Seeing a loss is :mod:`launcher.liveness`'s job (a peer's heartbeat stops growing) and
the exclusive claim of a lost node's group is :mod:`launcher.membership`'s (a
compare-and-set on the owner record). What the agent then does is a protocol of its own
with its own failure modes (ADR 0010), so it lives here rather than in the poll loop of
:mod:`launcher.agent`:

- every agent that sees a node lost (it watches that node, or learns the loss from the
  record its detector published: :class:`~launcher.liveness.PeerWatch`, ADR 0023)
  records that node's groups and, if it runs workers, declares the failure from the
  generation the detector last saw the node alive in (the declarations dedupe);
- an idle agent (a spare node) takes a lost group over and starts its ranks in a fresh
  generation;
- a lost node whose heartbeat resumes before anyone took its ranks keeps them
  (``node_returned``);
- a lost group that no spare node takes (at once when the job has none, else within
  ``recovery.spare_wait_s``) is retired, and the job shrinks to go on without it, if
  ``recovery.on_no_spare`` is ``shrink`` and rank 0 said the job can (ADR 0035); an
  idle agent later claims a retired group back and the job grows;
- a lost group that nobody takes or retires within :data:`TAKEOVER_PATIENCE` heartbeat
  timeouts stops the job;
- a node that finds its own ranks taken over (it was only slow) is fenced: it stops its
  workers and spares and leaves the job (the store host stays, idle, to the end).

:class:`NodeLossHandling` is a mixin of :class:`launcher.agent.Agent`: these steps read
and change the agent's own state (its group, workers, spares) and use its helpers
(``_declare``, ``_start_rank``, ``_stop_local``, ``_mark_finished``, ``_emit``,
``_log``, ``_ranks``); the annotations below name the state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from launcher import membership
from launcher.liveness import PeerWatch
from launcher.run_args import RunArgs
from launcher.worker_procs import SparePool, Worker, stop_processes
from recovery.common.causes import FailureCause
from recovery.common.config import RecoveryConfig
from recovery.common.events import Event
from recovery.generation import protocol, world
from replication.contract import EXIT_FENCED

#: How many heartbeat timeouts a lost group waits for a spare node, or for its own node
#: to come back, before the job stops. A spare node learns the loss within a check of
#: its publication (ADR 0023), but the loss of a node whose watchers were lost with it is
#: found a timeout later (the watch moves on, and a node entering a watch gets a full
#: timeout of grace). The chaos soak saw agents on an overloaded host stall
#: for 6-15 s and come back: waiting longer only delays a stop that is due anyway.
TAKEOVER_PATIENCE = 4.0


@dataclass
class LostGroup:
    lost_node: int
    detected_at: float  # monotonic
    gen: int  # the generation the lost node was last seen alive in


class NodeLossHandling:
    """The agent's steps about lost nodes and about being taken over itself."""

    # What these steps use of the agent (set in ``Agent.__init__`` and ``_connect``).
    args: RunArgs
    rcfg: RecoveryConfig
    node: int
    store: dist.Store | None
    group: int | None
    workers: dict[int, Worker]
    spares: SparePool | None
    watch: PeerWatch
    lost_groups: dict[int, LostGroup]
    _fenced_out: bool
    _check_health: Callable[[str], None]  # raises when this spare node is not fit

    # --- other nodes ----------------------------------------------------------------
    def _check_peers(self, gen: int) -> None:
        """Act on each node newly lost: detected by this agent's own watch or learned
        from another watcher's published record; each agent emits ``node_lost`` once per
        loss either way (``detected_by`` names the watcher that saw it)."""
        for lost in self.watch.check(self.store, gen):
            owners = membership.owners(self.store, self.args.nnodes)
            groups = [g for g, owner in owners.items() if owner == lost]
            ranks = [r for g in groups for r in self._ranks(g)]
            silent = self.watch.silent_for(lost)
            by = self.watch.detected_by(lost)
            self._emit(Event.NODE_LOST, lost_node=lost, groups=groups, ranks=ranks,
                       silent_s=round(silent, 3), detected_by=by)
            held = f"ranks {ranks}" if ranks else "its ranks already run on another node"
            seen = "" if by == self.node else f", as node {by} published"
            closed = "its agent's connection closed, " if lost in self.watch.link_ended else ""
            self._log(f"node {lost} lost ({closed}no heartbeat for {silent:.1f}s{seen}; "
                      f"{held})")
            observed = protocol.generation_of_node(self.store, ranks, lost,
                                                   self.watch.gen_alive(lost, gen))
            for g in groups:
                self.lost_groups[g] = LostGroup(lost, time.monotonic(), observed)
                if self.group is not None:  # active agents declare too; it dedupes
                    cause = self._node_lost_cause(lost, g)
                    self._declare(observed, cause)

    def _node_lost_cause(self, node: int, group: int) -> dict[str, Any]:
        """The cause of a node loss; its agent's pid makes every declarer of the same
        loss (its watchers, the spare node taking over) count one failure."""
        info = membership.agent_info(self.store, node) or {}
        return {"kind": FailureCause.NODE_LOST, "node": node, "group": group,
                "ranks": self._ranks(group), "agent_pid": info.get("pid"),
                # the node's last sign of life: its silence counts as detection
                "silent_s": round(self.watch.silent_for(node), 3)}

    def _settle_lost_groups(self, gen: int) -> None:
        """Take over a lost group if idle; keep it where its node came back before
        anyone took it; give up on it when nobody does either in time."""
        for g, lost in list(self.lost_groups.items()):
            owner = membership.owner(self.store, g)
            if owner is not None and owner != lost.lost_node:
                del self.lost_groups[g]  # someone (maybe this agent) took it
            elif owner == lost.lost_node and self._returned(lost.lost_node, gen):
                # Only slow (a starved agent): its workers join the generation its loss
                # started, as survivors. Better than stopping the job for want of a
                # spare node, and no fencing is needed: the owner record is unchanged.
                del self.lost_groups[g]
                self._emit(Event.NODE_RETURNED, lost_node=lost.lost_node, group=g,
                           after_s=round(time.monotonic() - lost.detected_at, 3))
                self._log(f"node {lost.lost_node} is back (its heartbeat resumed) and "
                          f"nobody took ranks {self._ranks(g)} over: they stay there")
            elif (self.group is None and not self._fenced_out
                  and self._fit_to_take_over(g)
                  and membership.take_over(self.store, g, lost.lost_node, self.node)):
                del self.lost_groups[g]
                self._adopt(g, lost)
            elif (self.group is not None and self._spare_wait_over(lost)
                  and self._why_not_shrink() is None
                  and membership.take_over(self.store, g, lost.lost_node, world.RETIRED)):
                del self.lost_groups[g]
                self._shrink(g, lost)
            elif (time.monotonic() - lost.detected_at
                  > TAKEOVER_PATIENCE * self.rcfg.heartbeat_timeout_s):
                del self.lost_groups[g]
                why = self._why_not_shrink()
                protocol.set_fatal(self.store, f"node {lost.lost_node} lost (ranks "
                                   f"{self._ranks(g)}) and no spare node took them over" + (
                                       f"; the job cannot shrink instead: {why}"
                                       if self.rcfg.on_no_spare == "shrink" else ""))

    def _fit_to_take_over(self, group: int) -> bool:
        """The health check, again, just before this spare node takes ``group`` over: a
        node idle for hours may have gone bad. Raises when it is not fit (it leaves)."""
        self._check_health(f"before taking over ranks {self._ranks(group)}")
        return True

    def _spare_wait_over(self, lost: LostGroup) -> bool:
        """Whether a lost group has waited long enough for a spare node: at once when the
        job has none (no idle agent registered, lost ones aside), else
        ``recovery.spare_wait_s``. A node only slow has had the heartbeat timeout
        already before it was declared lost."""
        if time.monotonic() - lost.detected_at > self.rcfg.spare_wait_s:
            return True
        owners = set(membership.owners(self.store, self.args.nnodes).values())
        return not [n for n in membership.registered_nodes(self.store)
                    if n not in owners and n not in self.watch.lost]

    def _why_not_shrink(self) -> str | None:
        """Why the job may not shrink (None: it may): ``recovery.on_no_spare``, or what
        rank 0 found about its state and loader (:mod:`recovery.resize.world_resize`)."""
        if self.rcfg.on_no_spare != "shrink":
            return "recovery.on_no_spare is stop"
        known, why = world.resizability(self.store)
        return why if known else "its ranks have not said yet whether they can"

    def _shrink(self, group: int, lost: LostGroup) -> None:
        """Retire the lost ``group`` (this agent won its owner record) and publish the
        smaller world, then declare the generation that trains in it (ADR 0035).

        The world is read from the owner records after the retirement, and published
        again if they changed meanwhile (another agent retiring another group at once).
        The generation is declared from the one current after the record is written, so
        every rank of the generation that applies it reads the same world.
        """
        configured = self.args.world_size
        new = self._publish_world()
        if new is None:
            protocol.set_fatal(self.store, f"node {lost.lost_node} lost and no node is left "
                               "to train on")
            return
        slots, ranks = new.slots, self._ranks(group)
        self._emit(Event.WORLD_SHRUNK, lost_node=lost.lost_node, group=group, ranks=ranks,
                   world=list(slots), configured=configured, version=new.version,
                   waited_s=round(time.monotonic() - lost.detected_at, 3))
        waited = time.monotonic() - lost.detected_at
        why = (f"no spare node took ranks {ranks} of lost node {lost.lost_node} within "
               f"{waited:.1f}s" if waited >= self.rcfg.spare_wait_s else
               f"the job has no spare node to take ranks {ranks} of lost node {lost.lost_node}")
        self._log(f"{why}: the job shrinks to {new.describe()}; the global batch is kept, so "
                  f"expect about {len(slots) / configured:.0%} of the throughput")
        cause = {**self._node_lost_cause(lost.lost_node, group),
                 "kind": FailureCause.WORLD_SHRUNK, "world": list(slots)}
        self._declare(protocol.current_generation(self.store), cause)

    def _publish_world(self) -> world.World | None:
        """Publish the world the owner records make (the groups not retired), again if
        they changed meanwhile (another agent retiring or claiming a group at once);
        None when every group is retired."""
        while True:
            gen = protocol.current_generation(self.store)
            owners = membership.owners(self.store, self.args.nnodes)
            slots = tuple(r for g, owner in sorted(owners.items()) if owner != world.RETIRED
                          for r in self._ranks(g))
            if not slots:
                return None
            new = world.publish(self.store, world.World(self.args.world_size, slots,
                                                        after_gen=gen))
            if membership.owners(self.store, self.args.nnodes) == owners:
                return new

    def _claim_retired(self) -> None:
        """An idle agent (a spare node, a node added to the job) takes a retired group
        back, and the job grows to include it at its next generation (ADR 0035)."""
        if self.group is not None or self._fenced_out or world.versions(self.store) == 0:
            return
        owners = membership.owners(self.store, self.args.nnodes)
        retired = sorted(g for g, owner in owners.items() if owner == world.RETIRED)
        _, why_not = world.resizability(self.store)
        if retired and why_not is not None:
            if not getattr(self, "_said_no_grow", False):
                self._said_no_grow = True
                self._log(f"not taking retired ranks back: {why_not}")
            return
        for g in retired:
            if membership.take_over(self.store, g, world.RETIRED, self.node):
                self._grow(g)
                return

    def _grow(self, group: int) -> None:
        self.group = group
        ranks = self._ranks(group)
        new = self._publish_world()
        assert new is not None  # this agent's group is not retired
        self._emit(Event.WORLD_GROWN, group=group, ranks=ranks, world=list(new.slots),
                   configured=self.args.world_size, version=new.version)
        self._log(f"taking retired ranks {ranks} back: the job grows to {new.describe()}"
                  if new.resized else f"taking retired ranks {ranks} back: the job is "
                  f"at its full size again ({new.size} ranks)")
        cause = {"kind": FailureCause.WORLD_GROWN, "node": self.node, "group": group,
                 "ranks": ranks, "world": list(new.slots)}
        if not self._declare(protocol.current_generation(self.store), cause):
            return
        restart = protocol.recoveries(self.store)
        for local in range(self.args.nproc):
            self._start_rank(group, local, replacement=True, restart_count=restart)

    def _returned(self, node: int, gen: int) -> bool:
        """The lost ``node`` heartbeats again (checked once per node: its other groups
        see it watched again)."""
        return node not in self.watch.lost or self.watch.returned(self.store, node, gen)

    def _adopt(self, group: int, lost: LostGroup) -> None:
        self.group = group
        ranks = self._ranks(group)
        self._emit(Event.NODE_TAKEOVER, lost_node=lost.lost_node, group=group, ranks=ranks)
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
        owner = membership.owner(self.store, self.group)
        return owner if owner is not None and owner != self.node else None

    def _fenced(self, taker: int) -> None:
        """Stop this node's workers and spares: its ranks run on ``taker`` now, so none of
        its processes may take part (their runtime also refuses to rejoin on its own).

        The other agents count this node as lost for good, so it must never take ranks
        over again: it leaves the job, or, hosting the job's store, stays idle to the end.
        """
        ranks = self._ranks(self.group) if self.group is not None else []
        self._emit(Event.NODE_FENCED, group=self.group, ranks=ranks, taken_over_by=taker)
        leaving = "staying idle: it hosts the job's store" if self.args.hosts_store else (
            f"leaving the job (exit {EXIT_FENCED})")
        what = ("the job shrank without its ranks" if taker == world.RETIRED
                else f"node {taker} took ranks {ranks} over")
        self._log(f"this node was declared lost and {what}; "
                  f"stopping this node's workers and {leaving}")
        stop_processes([w.proc for w in self.workers.values()], grace_s=0.0)
        self.workers.clear()
        self.group, self._fenced_out = None, True
        if self.spares is not None:
            self.spares.size = 0
        self._stop_local()
        if not self.args.hosts_store:
            self._mark_finished()
