"""The typed failure contract: causes by exception type, event names from one registry."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from recovery.causes import CONSEQUENTIAL, FailureCause, classify, describe
from recovery.errors import CollectiveAborted, FailureDetected, InjectedFault
from recovery.events import Event
from recovery.protocol import EventLog, failure_identity
from replication.replicator import ReplicationError
from replication.transport import TransportError

ROOT = Path(__file__).resolve().parent.parent


def never() -> bool:
    return False


@pytest.mark.parametrize("exc, expected", [
    (ValueError("loss is nan"), FailureCause.EXCEPTION),
    (RuntimeError("Connection reset by peer in my own socket code"), FailureCause.EXCEPTION),
    (FailureDetected("a failure was declared"), FailureCause.PEER_FAILURE),
    (CollectiveAborted("checkpointless: collective aborted"), FailureCause.PEER_FAILURE),
    (TransportError("replication send failed"), FailureCause.PEER_FAILURE),
    (ReplicationError("snapshot torn by an in-place change"), FailureCause.EXCEPTION),
    (dist.DistBackendError("a backend error"), FailureCause.PEER_FAILURE),
    (InjectedFault("injected exception"), FailureCause.EXCEPTION),
])
def test_a_cause_is_told_by_the_exception_type(exc, expected) -> None:
    """The message never decides: a user's RuntimeError that mentions a connection is
    the user's, and the runtime's typed errors are peer failures whatever they say."""
    assert classify(exc, never) is expected


def test_a_peer_failure_is_found_in_the_exception_chain() -> None:
    try:
        raise ReplicationError("replication send failed") from TransportError("peer gone")
    except ReplicationError as wrapped:
        assert classify(wrapped, never) is FailureCause.PEER_FAILURE
    try:
        try:
            raise TransportError("peer gone")
        except TransportError as inner:
            raise RuntimeError("a framework re-raised it") from inner
    except RuntimeError as outer:
        assert classify(outer, never) is FailureCause.PEER_FAILURE


def test_a_flattened_error_after_an_aborted_collective_is_a_consequence() -> None:
    """DDP's comm hook flattens the runtime's CollectiveAborted into a RuntimeError of
    its own: the type is lost, but the runtime knows a collective was aborted."""
    flat = RuntimeError("Unable to cast a failure was declared ... to Tensor")
    mark = CollectiveAborted.raised
    assert classify(flat, lambda: CollectiveAborted.raised != mark) is FailureCause.EXCEPTION
    CollectiveAborted("checkpointless: collective aborted: generation 3 failed")
    assert classify(flat, lambda: CollectiveAborted.raised != mark) is FailureCause.PEER_FAILURE


def test_consequences_are_not_counted_as_failures() -> None:
    for kind in CONSEQUENTIAL:
        assert failure_identity(2, {"kind": kind, "rank": 1}) is None
    assert failure_identity(2, {"kind": FailureCause.EXCEPTION, "rank": 1}) == "exception-1-g2"


def test_every_cause_has_words() -> None:
    for kind in FailureCause:
        text = describe({"kind": kind, "rank": 1, "node": 0, "error": "E", "ranks": [1]})
        assert text and "unknown" not in text, kind
    assert json.loads(json.dumps({"kind": FailureCause.NODE_LOST})) == {"kind": "node_lost"}


def test_the_event_log_refuses_an_unregistered_name(tmp_path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "test")
    log.emit(Event.RECOVERY, gen=1)
    log.emit("recovery", gen=2)  # the string of a registered name is the same event
    with pytest.raises(ValueError, match="'recovery_done' is not registered"):
        log.emit("recovery_done", gen=3)
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["recovery", "recovery"]


def _literal_event_names() -> set[tuple[str, str]]:
    """Every string literal passed as the first argument of an ``emit``/``_emit`` call,
    and every ``"event"`` compared against in the readers, across the packages."""
    found = set()
    for pkg in ("recovery", "replication", "launcher", "benchmarks", "examples"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("emit", "_emit") and node.args
                        and isinstance(node.args[0], ast.Constant)
                        and isinstance(node.args[0].value, str)):
                    found.add((str(path.relative_to(ROOT)), node.args[0].value))
    return found


def test_every_event_written_anywhere_is_registered() -> None:
    names = {e.value for e in Event}
    assert [(p, n) for p, n in sorted(_literal_event_names()) if n not in names] == []


_BUILTIN_ERRORS = {"Exception", "RuntimeError", "ValueError", "TypeError", "TimeoutError",
                   "OSError", "KeyError"}


def test_every_exception_of_the_project_derives_from_one_root() -> None:
    """A class that derives straight from a builtin exception also derives from
    CheckpointlessError (subclasses of ours inherit it)."""
    missing, rooted = [], 0
    for pkg in ("recovery", "replication", "launcher", "dataloader_cache"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                rooted += "CheckpointlessError" in bases
                if bases & _BUILTIN_ERRORS and "CheckpointlessError" not in bases \
                        and node.name != "CheckpointlessError":
                    missing.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert missing == []
    assert rooted >= 30  # the scan saw the project's exceptions
