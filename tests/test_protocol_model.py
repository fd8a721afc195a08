"""The generation, declaration and join protocol, checked over interleavings (ADR 0016).

A hypothesis state machine drives the real protocol code on a real c10d store
(``HashStore``, sealed records as the agents and workers write them):
``protocol.declare_failure``, ``protocol.current_generation``,
``protocol.generation_of_process``, ``rendezvous.publish_join`` (the sealed record and
the join count that elects the planner) / ``rendezvous.joined_records``, and
``replication.replica_protocol.commit.CommitLedger``. What it models
is only who calls them when: 3 ranks, up to 3 SIGKILLs at any moment, agents that
notice a death late and declare from a stale view (any generation from the one the
process started in to the newest one it took part in), survivors that declare when
their generation loses a member, replacements that join whatever generation is
newest when they get there, and ranks that acknowledge steps at their own pace
(a slow rank of an old generation may acknowledge after a newer one began).

Properties:
- **every failure leads to a recovery**: after a declaration, the job's generation is
  newer than every generation the dead process took part in;
- **no rank waits on a generation that will never complete**: once every pending
  action has been taken (:meth:`ProtocolModel.settle`), the newest generation is
  complete, with every rank's live process in it;
- **a generation that completes has a live planner** (ADR 0024): the process whose join
  brought the count to the world size is one of the processes the generation completes
  with, so no completed generation waits on a planner takeover;
- **the committed step never runs ahead of what every copy holds**: whenever the
  committed step is ``s``, every rank has a process that acknowledged ``s`` (a process
  acknowledges a step once it holds its own snapshot and its neighbour's replica).

``test_the_model_finds_the_soak_bug`` runs the same machine with the old declaration
(from the agent's possibly stale view): it must fail, or the model checks nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from recovery.generation import protocol
from recovery.generation.rendezvous import joined_records, publish_join
from replication.replica_protocol.commit import CommitLedger, committed_step
from replication.side_channel import signing
from replication.side_channel.signing import Signer

WORLD = 3
MAX_FAILURES = 3
COMMITTED = "model/committed_step"


@dataclass
class Proc:
    """One process (incarnation) of a rank."""

    pid: int
    start_gen: int  # the generation current when its agent started it
    alive: bool = True
    joined: set[int] = field(default_factory=set)  # generations whose rendezvous it joined
    training_in: int | None = None  # the completed generation it trains in; None: waiting
    acked: int = -1  # the newest step it acknowledged
    declared: bool = False  # its agent declared its death (and started a replacement)

    @property
    def newest_joined(self) -> int:
        return max(self.joined, default=self.start_gen)


class ProtocolModel(RuleBasedStateMachine):
    #: The agent's declaration: the real one, or the pre-fix one for the mutation test.
    stale_declaration = False

    def __init__(self) -> None:
        super().__init__()
        self.store = dist.HashStore()
        self.procs: dict[int, Proc] = {}
        self.completed: set[int] = set()
        self.next_pid = 1000
        self.failures = 0
        self.acks: dict[int, set[int]] = {r: set() for r in range(WORLD)}  # any incarnation
        self.graveyard: list[Proc] = []  # dead processes already replaced
        self.planners: dict[int, int] = {}  # generation -> pid whose join completed the count

    # -- helpers ----------------------------------------------------------------------
    def gen(self) -> int:
        return protocol.current_generation(self.store)

    def _new_proc(self) -> Proc:
        self.next_pid += 1
        return Proc(self.next_pid, self.gen())

    def _ledger(self, gen: int) -> CommitLedger:
        return CommitLedger(self.store, WORLD, ack_prefix=f"{protocol.gen_prefix(gen)}/acks",
                            committed_key=COMMITTED)

    def _members(self, gen: int) -> list[Proc]:
        return [p for p in self.procs.values() if p.training_in == gen]

    # -- the start: generation 0 ------------------------------------------------------
    @initialize()
    def start(self) -> None:
        signing.install(Signer(os.urandom(32)))
        for rank in range(WORLD):
            self.procs[rank] = self._new_proc()
            self._join(rank)
        self._complete()
        assert self.completed == {0}

    # -- actions ------------------------------------------------------------------------
    @precondition(lambda self: self.failures < MAX_FAILURES)
    @rule(rank=st.integers(0, WORLD - 1))
    def kill(self, rank: int) -> None:
        p = self.procs[rank]
        if p.alive:
            p.alive = False
            self.failures += 1

    @rule(rank=st.integers(0, WORLD - 1), data=st.data())
    def agent_notices_death(self, rank: int, data: st.DataObject) -> None:
        """The agent reaps the dead process (at any later moment) and declares from its
        view of the process's generation, which may be stale by any number of
        recoveries; then it starts a replacement."""
        p = self.procs[rank]
        if p.alive or p.declared:
            return
        seen = data.draw(st.integers(p.start_gen, p.newest_joined), label="agent's view")
        belongs = seen if self.stale_declaration else protocol.generation_of_process(
            self.store, rank, p.pid, seen)
        gen = protocol.declare_failure(self.store, belongs, {"rank": rank, "pid": p.pid},
                                       timeout_s=1)
        assert gen > belongs
        self._replace(rank)

    @rule(rank=st.integers(0, WORLD - 1), collective_fails=st.booleans())
    def survivor_notices(self, rank: int, collective_fails: bool = False) -> None:
        """A training process leaves its generation when the watchdog sees a newer one,
        or (sometimes: gloo may also just hang) when a collective with a dead member
        fails, and then declares from its own generation. It goes to the newest
        rendezvous."""
        p = self.procs[rank]
        if not p.alive or p.training_in is None:
            return
        if collective_fails and any(not q.alive and q.training_in == p.training_in
                                    for q in self._all_procs()):
            protocol.declare_failure(self.store, p.training_in, {"rank": rank}, timeout_s=1)
            p.training_in = None
        elif self.gen() > p.training_in:
            p.training_in = None

    @rule(rank=st.integers(0, WORLD - 1))
    def join(self, rank: int) -> None:
        p = self.procs[rank]
        if p.alive and p.training_in is None:
            self._join(rank)

    @rule()
    def complete(self) -> None:
        self._complete()

    @rule(rank=st.integers(0, WORLD - 1))
    def acknowledge_next_step(self, rank: int) -> None:
        """A member acknowledges its next step, once the previous one is committed (a
        rank waits for each commit before its next round). A slow member of an old
        generation may still do this after a newer generation began."""
        p = self.procs[rank]
        if not p.alive or p.training_in is None:
            return
        if p.acked != committed_step(self.store, COMMITTED):
            return
        p.acked += 1
        self.acks[rank].add(p.acked)
        self._ledger(p.training_in).ack(p.acked)

    @rule()
    def settle(self) -> None:
        """Take every pending action, in a fixed order, until nothing changes: no more
        failures happen. The newest generation must then be complete, with every
        rank's live process in it."""
        for _ in range(20):
            before = self._snapshot()
            for rank in range(WORLD):
                p = self.procs[rank]
                if not p.alive and not p.declared:  # the agent, from its stalest view
                    belongs = p.start_gen if self.stale_declaration else (
                        protocol.generation_of_process(self.store, rank, p.pid, p.start_gen))
                    protocol.declare_failure(self.store, belongs, {"rank": rank}, timeout_s=1)
                    self._replace(rank)
            for rank in range(WORLD):
                self.survivor_notices(rank)  # the watchdog only: a collective may hang
            for rank in range(WORLD):
                self.join(rank)
            self._complete()
            if self._snapshot() == before:
                break
        newest = self.gen()
        stuck = {r: (p.training_in, sorted(p.joined)) for r, p in self.procs.items()
                 if p.training_in != newest}
        assert newest in self.completed and not stuck, (
            f"ranks wait on a generation that will never complete: generation {newest} "
            f"completed={newest in self.completed}; rank -> (training in, joined): {stuck}")

    # -- properties ---------------------------------------------------------------------
    @invariant()
    def every_declared_failure_leads_past_its_generations(self) -> None:
        newest = self.gen()
        for p in self._all_procs():
            if p.declared:
                assert newest > p.newest_joined, (
                    f"pid {p.pid} died in generation {p.newest_joined} and its declaration "
                    f"left the job in generation {newest}")

    @invariant()
    def committed_step_is_held_by_every_rank(self) -> None:
        step = committed_step(self.store, COMMITTED)
        if step >= 0:
            short = [r for r in range(WORLD) if step not in self.acks[r]]
            assert not short, f"step {step} committed, never acknowledged by ranks {short}"

    # -- internals --------------------------------------------------------------------
    def _join(self, rank: int) -> None:
        p, gen = self.procs[rank], self.gen()
        if gen not in p.joined:
            _, count = publish_join(self.store, gen, protocol.JoinRecord(rank, 0, p.pid, False))
            p.joined.add(gen)
            if count == WORLD:
                self.planners[gen] = p.pid

    def _complete(self) -> None:
        """The newest generation completes when every rank's current process joined it
        (what the planner waits for, ``rendezvous.agree``); only once: a process that
        joins a completed generation later finds its plan."""
        gen = self.gen()
        if gen in self.completed:
            return
        records = joined_records(self.store, gen, WORLD)
        procs = self.procs
        if len(records) == WORLD and all(
                procs[r].alive and records[r].pid == procs[r].pid and procs[r].training_in
                is None for r in range(WORLD)):
            self.completed.add(gen)
            members = {procs[r].pid for r in range(WORLD)}
            assert self.planners.get(gen) in members, (
                f"generation {gen} completed with processes {sorted(members)}, but the join "
                f"count elected {self.planners.get(gen)} to plan it")
            target = committed_step(self.store, COMMITTED)
            for p in procs.values():
                p.training_in, p.acked = gen, target  # every rank resumes after the target

    def _replace(self, rank: int) -> None:
        """The agent starts a new process for ``rank`` (its old one declared dead)."""
        self.procs[rank].declared = True
        self.graveyard.append(self.procs[rank])
        self.procs[rank] = self._new_proc()

    def _all_procs(self) -> list[Proc]:
        return [*self.procs.values(), *self.graveyard]

    def _snapshot(self) -> tuple:
        return (self.gen(), tuple(sorted(self.completed)),
                tuple((p.pid, p.alive, p.training_in, tuple(sorted(p.joined)))
                      for p in self.procs.values()))

    def teardown(self) -> None:
        signing.install(None)


MODEL_SETTINGS = settings(max_examples=300, stateful_step_count=40, deadline=None,
                          suppress_health_check=list(HealthCheck))


def test_the_protocol_survives_every_interleaving_tried():
    run_state_machine_as_test(ProtocolModel, settings=MODEL_SETTINGS)


class _PreFixModel(ProtocolModel):
    stale_declaration = True


def test_the_model_finds_the_soak_bug():
    """Declaring from the agent's stale view (the earlier code) folds a failure right
    after a recovery into the generation that just ended; the model must say so."""
    with pytest.raises(Exception) as caught:  # one AssertionError, or a group of them
        run_state_machine_as_test(_PreFixModel, settings=MODEL_SETTINGS)
    errors = getattr(caught.value, "exceptions", [caught.value])
    assert all(isinstance(e, AssertionError) for e in errors), errors
    assert any("will never complete" in str(e) or "left the job in generation" in str(e)
               for e in errors), errors
