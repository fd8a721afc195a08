"""The recovery target when the store's committed-step record lags (ADR 0022, addendum 2).

Rank 0 writes the committed step to the store off the training path, so that a store
without quorum no longer stalls training. The planner therefore also reads what each
rank's join record says it learned is committed. These tests pin down the choice on
hand-made records (pure computation), and the recorder against a real etcd member that
is stopped and started again.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import pytest

from recovery.common.errors import RecoveryImpossible
from recovery.generation.protocol import JoinRecord
from recovery.generation.rendezvous import FRESH_START, choose_plan, make_plan
from recovery.job_store.etcd_store import EtcdStore
from replication.replica_protocol.commit import committed_step
from replication.replica_protocol.commit_record import CommittedRecorder
from replication.side_channel import signing
from tests.etcd_cluster import EtcdCluster, etcd_missing_reason


def rec(rank: int, committed: int, local: list[int], replicas: dict[int, list[int]] | None = None,
        newcomer: bool = False) -> JoinRecord:
    return JoinRecord(rank=rank, node=rank, pid=1000 + rank, newcomer=newcomer,
                      local_steps=local if not newcomer else [],
                      replicas={str(k): v for k, v in (replicas or {}).items()},
                      committed=committed)


def test_a_lagging_record_is_overtaken_by_what_the_ranks_learned():
    # The store still says 5; every rank learned 7 and has dropped 5's slot since.
    records = {0: rec(0, 7, [7, 8], {1: [7]}), 1: rec(1, 7, [7, 8], {0: [7]})}
    plan = choose_plan(1, 5, records)
    assert plan.target_step == 7 and plan.providers == {}


def test_a_rank_that_learned_less_still_holds_the_newer_step():
    # Rank 1's "committed" message was in flight: it knows 6 but holds 7 (its round for 7
    # had not ended, so nothing overwrote it); rank 2 is a newcomer served from rank 0.
    records = {0: rec(0, 7, [6, 7], {2: [6, 7]}), 1: rec(1, 6, [6, 7]),
               2: rec(2, -1, [], newcomer=True)}
    plan = choose_plan(3, 6, records)
    assert plan.target_step == 7 and plan.providers == {2: 0}


def test_a_record_newer_than_every_rank_knows_is_not_trusted():
    # A round abandoned before a rollback wrote 9 late; the ranks rolled back to 5 and
    # still hold their old timeline's 9 (stale): the target is 5.
    records = {0: rec(0, 5, [5, 9], {1: [5, 9]}), 1: rec(1, 5, [5, 9], {0: [5, 9]})}
    assert choose_plan(2, 9, records).target_step == 5


def test_an_older_candidate_is_used_when_the_newest_lost_its_copy():
    # Rank 1 died; the only replica of its step 7 died with rank 2, step 6's survives.
    records = {0: rec(0, 7, [6, 7], {1: [6]}), 1: rec(1, -1, [], newcomer=True),
               2: rec(2, -1, [], newcomer=True), 3: rec(3, 6, [6, 7], {2: [6, 7]})}
    with pytest.raises(RecoveryImpossible, match="rank 1"):  # 7 alone: rank 1's is gone
        make_plan(4, 7, records)
    plan = choose_plan(4, 6, records)
    assert plan.target_step == 6 and plan.providers == {1: 0, 2: 3}


def test_nothing_committed_anywhere_names_the_first_step():
    # A survivor holds an uncommitted initial snapshot: no consistent target exists.
    records = {0: rec(0, -1, [0]), 1: rec(1, -1, [], newcomer=True)}
    with pytest.raises(RecoveryImpossible, match="before the first step was committed"):
        choose_plan(1, -1, records)


def test_all_new_and_nothing_committed_starts_afresh():
    # A process was killed in the script's set-up and the others left it too: every
    # process is new, as in generation 0, so they all start from the script's state.
    records = {r: rec(r, -1, [], newcomer=True) for r in range(3)}
    plan = choose_plan(2, -1, records)
    assert plan.target_step == FRESH_START and plan.providers == {}


def test_all_new_after_training_is_not_a_fresh_start():
    # Every process is new but step 5 was committed: the state is lost, not unborn; the
    # verdict sends the job to the durable tier (or stops it), never back to step 0.
    records = {r: rec(r, -1, [], newcomer=True) for r in range(2)}
    with pytest.raises(RecoveryImpossible, match="no surviving copy"):
        choose_plan(3, 5, records)


# -- the recorder, on a real etcd member -------------------------------------------------
@pytest.fixture
def member():
    if (why := etcd_missing_reason()) is not None:
        if os.environ.get("TESTS_REQUIRE_ETCD") == "1":
            pytest.fail(f"{why}, and TESTS_REQUIRE_ETCD=1", pytrace=False)
        pytest.skip(why)
    with EtcdCluster(1) as cluster:
        yield cluster


def test_the_record_never_blocks_and_lands_when_the_store_is_back(member):
    key = "cl/committed_step"
    store = EtcdStore(member.endpoints, f"/test/{uuid.uuid4().hex}/",
                      datetime.timedelta(seconds=5), request_timeout=1.0, unavailable_after=2.0)
    recorder = CommittedRecorder(store, key)
    try:
        recorder.record(3)
        assert recorder.flush(10.0) and committed_step(store, key) == 3
        member.stop(0)
        t0 = time.monotonic()
        for step in range(4, 40):  # training goes on: each hand-in returns at once
            recorder.record(step)
        assert time.monotonic() - t0 < 0.05
        assert not recorder.flush(1.5) and recorder.written == 3
        member.start(0)
        member.wait_healthy()
        assert recorder.flush(20.0), "the newest step was not written once etcd was back"
        assert recorder.written == 39 and committed_step(store, key) == 39
        recorder.record(12)  # steps only grow
        assert recorder.flush(1.0) and committed_step(store, key) == 39
        raw = store.get(key)
        assert signing.open_sealed(key, raw) == b"39"  # sealed with the job key
    finally:
        recorder.stop()


def test_a_stopped_recorder_drops_what_it_was_not_yet_writing(member):
    key = "cl/committed_step"
    store = EtcdStore(member.endpoints, f"/test/{uuid.uuid4().hex}/",
                      datetime.timedelta(seconds=5), request_timeout=1.0, unavailable_after=2.0)
    recorder = CommittedRecorder(store, key)
    recorder.record(1)
    assert recorder.flush(10.0)
    member.stop(0)
    recorder.record(2)  # cannot land while the member is down
    recorder.stop()  # a rollback follows: step 2 must never land after it
    member.start(0)
    member.wait_healthy()
    time.sleep(1.0)
    assert committed_step(store, key) == 1
