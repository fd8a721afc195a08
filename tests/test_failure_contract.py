"""The typed failure contract: causes by exception type, event names from one registry."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from recovery.common.causes import CONSEQUENTIAL, FailureCause, classify, describe
from recovery.common.errors import CollectiveAborted, FailureDetected, InjectedFault
from recovery.common.events import Event
from recovery.generation.protocol import EventLog, failure_identity
from replication.replica_protocol.replicator import ReplicationError
from replication.side_channel.transport import TransportError

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


#: Where events are written or read: the packages, the benchmarks and the examples.
_EVENT_CODE = ("recovery", "replication", "launcher", "dataloader_cache", "benchmarks",
               "examples")


def _trees() -> list[tuple[str, ast.AST]]:
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text()))
            for pkg in _EVENT_CODE for path in sorted((ROOT / pkg).rglob("*.py"))]


def _literal_event_names() -> set[tuple[str, str]]:
    """Every string literal passed as the first argument of an ``emit``/``_emit`` call
    (the writers), across the packages, the benchmarks and the examples."""
    found = set()
    for rel, tree in _trees():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("emit", "_emit") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.add((rel, node.args[0].value))
    return found


def _is_event_field(node: ast.AST) -> bool:
    """``e["event"]`` or ``e.get("event")`` (whatever ``e`` is called)."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event")


def _string_constants(node: ast.AST) -> list[str]:
    """A string literal, or the string literals of a tuple/list/set literal."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def _compared_event_literals(tree: ast.AST) -> tuple[int, set[str]]:
    """(how many comparisons of an event's name ``tree`` holds, the string literals
    they compare it with): ``e["event"] == "step"``, ``e.get("event") in ("a", "b")``,
    the name on either side of the operator."""
    seen, found = 0, set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for left, right in itertools.pairwise(operands):
            for field, other in ((left, right), (right, left)):
                if _is_event_field(field):
                    seen += 1
                    found |= set(_string_constants(other))
    return seen, found


def test_every_event_written_anywhere_is_registered() -> None:
    names = {e.value for e in Event}
    assert [(p, n) for p, n in sorted(_literal_event_names()) if n not in names] == []


def test_readers_compare_event_names_against_the_registry() -> None:
    """A reader spelling a name itself would silently match nothing after a rename;
    comparing against ``Event`` members fails at import instead."""
    literals, seen = [], 0
    for rel, tree in _trees():
        n, found = _compared_event_literals(tree)
        seen += n
        literals += [(rel, name) for name in sorted(found)]
    assert literals == []
    assert seen >= 20  # the scan saw the readers' comparisons


def test_the_comparison_scan_sees_each_spelling() -> None:
    """The scan above is live: it finds a literal in each form a reader writes."""
    tree = ast.parse('a = e["event"] == "step"\nb = "kill" != e.get("event")\n'
                     'c = e.get("event") in ("saved", Event.STEP)\n')
    assert _compared_event_literals(tree) == (3, {"step", "kill", "saved"})


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
