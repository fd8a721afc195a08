"""Signed records in the job store: write, read, claim, and report what fails to verify.

Every value that an agent or worker acts on is sealed with the job key
(:mod:`replication.side_channel.signing`). Readers go through this module, which opens the seal and
treats a value that fails as *absent*, reporting it once as an ``auth_rejected`` event
(through the reporter the agent or runtime installs). So a process without the job
secret can write whatever it likes into the store, and no participant acts on it.

Compare-and-set keys need one more rule. A first-writer-wins key (a generation's cause,
the fatal flag, a group's owner) that a forger occupied first would otherwise lock the
legitimate writer out forever, so :func:`claim` treats a value that does not verify as
free and replaces it, with a compare-and-set *from that exact value*: two legitimate
claimers racing over the same forged value still produce exactly one winner.

What this does not stop (see ``docs/security.md``): a process that keeps overwriting or
deleting keys can still disrupt the job (denial of service); it cannot make the job
accept a forged record.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from replication.errors import CheckpointlessError
from replication.side_channel.signing import Signer, process_signer

#: How many distinct rejected values one process reports before it only counts them.
MAX_REPORTS = 100
#: How often :func:`claim` replaces a forged value before it gives up.
CLAIM_ATTEMPTS = 50


class StoreTampered(CheckpointlessError, TimeoutError):
    """A trusted record could not be written: something keeps overwriting it."""


Reporter = Callable[..., None]
_reporter: Reporter | None = None
_reported: set[tuple[str, str]] = set()
_suppressed = 0
_report_lock = threading.Lock()


def set_reporter(reporter: Reporter | None) -> None:
    """Where rejected values are reported: ``reporter(key=..., reason=..., value=..., size=...)``.

    Without one, a line goes to stderr. Each distinct (key, value) is reported once.
    """
    global _reporter
    _reporter = reporter


def report(key: str, raw: bytes, reason: str | None = None) -> None:
    """Report a value of ``key`` that failed verification (once per distinct value)."""
    global _suppressed
    digest = hashlib.sha256(raw).hexdigest()[:16]
    with _report_lock:
        if (key, digest) in _reported:
            return
        if len(_reported) >= MAX_REPORTS:
            _suppressed += 1
            return
        _reported.add((key, digest))
    fields: dict[str, Any] = {
        "key": key, "reason": reason or Signer.why_invalid(raw), "size": len(raw),
        "value": raw[:60].decode("utf-8", "replace"), "digest": digest,
    }
    reporter = _reporter
    try:
        if reporter is not None:
            reporter(**fields)
        else:
            print(f"checkpointless: ignored a value of store key {key!r} that is not sealed "
                  f"with the job's key ({fields['reason']})", file=sys.stderr, flush=True)
    except Exception:
        pass  # reporting must never break the reader


def suppressed() -> int:
    """Rejections not reported because :data:`MAX_REPORTS` was reached."""
    return _suppressed


def open_value(key: str, raw: bytes | None) -> str | None:
    """The payload of ``raw`` read from ``key``, or None (reported) if it does not verify."""
    if raw is None:
        return None
    payload = process_signer().open(key, raw)
    if payload is None:
        report(key, bytes(raw))
        return None
    return payload.decode()


def put(store: dist.Store, key: str, payload: str) -> bytes:
    """Write ``payload`` sealed under ``key``; returns the sealed bytes."""
    sealed = process_signer().seal(key, payload)
    store.set(key, sealed)
    return sealed


def read_raw(store: dist.Store, key: str) -> bytes | None:
    """The raw value of ``key``, None if absent (never blocks on a missing key)."""
    return store.get(key) if store.check([key]) else None


def read(store: dist.Store, key: str) -> str | None:
    """The verified payload of ``key``; None if absent or not validly sealed."""
    return open_value(key, read_raw(store, key))


def read_all(store: dist.Store, keys: Sequence[str]) -> list[str | None] | None:
    """Verified payloads of ``keys`` if every key exists (None otherwise), one round trip
    each for the existence check and the values; a forged value reads as None."""
    if not keys or not store.check(list(keys)):
        return None
    raws = store.multi_get(list(keys))
    return [open_value(k, r) for k, r in zip(keys, raws)]


def claim(store: dist.Store, key: str, payload: str) -> tuple[bool, str]:
    """Write ``payload`` to ``key`` unless a validly sealed value is already there.

    Returns ``(True, payload)`` if this call wrote it, ``(False, existing)`` if another
    legitimate writer was first. A forged value is replaced (see the module docstring);
    :class:`StoreTampered` if it keeps coming back.
    """
    signer = process_signer()
    sealed = signer.seal(key, payload)
    expected: bytes = b""
    for _ in range(CLAIM_ATTEMPTS):
        current = bytes(store.compare_set(key, expected, sealed))
        if current == sealed:
            return True, payload
        existing = signer.open(key, current)
        if existing is not None:
            return False, existing.decode()
        report(key, current)
        # c10d answers a compare-and-set on a missing key with `expected` itself.
        expected = current if store.check([key]) else b""
    raise StoreTampered(f"could not record {key}: its value keeps being replaced by one that "
                        "is not sealed with the job's key")


def replace(store: dist.Store, key: str, current_raw: bytes, payload: str) -> bool:
    """Compare-and-set ``key`` from exactly ``current_raw`` to sealed ``payload``; True if
    this call won (exactly one of several callers racing from the same value does)."""
    sealed = process_signer().seal(key, payload)
    expected = current_raw if store.check([key]) else b""
    return bytes(store.compare_set(key, expected, sealed)) == sealed
