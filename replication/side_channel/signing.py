"""Seals for store values that other processes act on: HMAC-SHA256 with the job's key.

The job's c10d store has no authentication: any process that can reach its port can
read, list, write and delete every key. So a value that some process *trusts* (a failure
record, a group owner, the committed step) carries a seal: an HMAC-SHA256 over the key
name and the payload, made with a key only the job's own processes hold. A reader that
gets a value without a valid seal treats it as absent and reports it; a forger who does
not hold the key cannot produce one, and because the key name is part of the MAC a
sealed value is only valid under the key it was written to.

A sealed value is ``cl1:<64 hex digits of HMAC>:<payload>`` (the payload is text, usually
JSON, and is stored readable, so the store stays debuggable; seals give integrity, not
secrecy).

Where the key comes from: ``checkpointless run`` derives it from the job secret and the
rendezvous id and hands it to its workers in
:data:`~replication.contract.ENV_JOB_KEY`. A process without that variable
(``python train.py`` on a laptop, the multi-process unit tests) uses a fixed, public
key: everything works the same, and nothing is authenticated
(:attr:`Signer.authenticated` is False).

This module is stdlib-only so that ``replication`` (the commit ledger) can seal values
without importing ``recovery``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading

from replication.contract import ENV_JOB_KEY

#: The job key (hex) that ``checkpointless run`` gives every worker; never logged.

_MAGIC = b"cl1:"
_MAC_HEX = 64  # hex digits of an HMAC-SHA256
_HEADER = len(_MAGIC) + _MAC_HEX + 1  # magic, MAC, ':'
#: The key of processes started without a job key: public, so it authenticates nothing.
_UNAUTHENTICATED_KEY = b"checkpointless: no job secret (unauthenticated)"


def derive_job_key(secret: bytes, job_id: str) -> bytes:
    """The key a job seals with: bound to the rendezvous id, so a secret reused across
    jobs with different ids does not make one job's records valid in another."""
    return hmac.new(secret, b"checkpointless job key v1\0" + job_id.encode(),
                    hashlib.sha256).digest()


class Signer:
    """Seals and opens store values with one job key."""

    def __init__(self, key: bytes, *, authenticated: bool = True) -> None:
        if not key:
            raise ValueError("a job key must not be empty")
        self._key = key
        self.authenticated = authenticated

    def __repr__(self) -> str:  # never show the key
        return f"Signer(authenticated={self.authenticated})"

    def key_hex(self) -> str:
        """The key as text, for the worker environment only."""
        return self._key.hex()

    def _mac(self, key: str, payload: bytes) -> bytes:
        msg = key.encode() + b"\0" + payload
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode()

    def seal(self, key: str, payload: str | bytes) -> bytes:
        """``payload`` sealed for the store key ``key``."""
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        return _MAGIC + self._mac(key, data) + b":" + data

    def open(self, key: str, raw: bytes | str | None) -> bytes | None:
        """The payload of ``raw`` if it is a valid seal for ``key``; None otherwise."""
        if raw is None:
            return None
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if len(data) < _HEADER or not data.startswith(_MAGIC) or data[_HEADER - 1:_HEADER] != b":":
            return None
        mac, payload = data[len(_MAGIC):_HEADER - 1], data[_HEADER:]
        if not hmac.compare_digest(mac, self._mac(key, payload)):
            return None
        return payload

    @staticmethod
    def why_invalid(raw: bytes | str) -> str:
        """A short reason for a value :meth:`open` refused (for the rejection report)."""
        data = raw.encode() if isinstance(raw, str) else bytes(raw)
        if not data.startswith(_MAGIC) or len(data) < _HEADER:
            return "not sealed"
        return "bad seal (wrong key, or tampered)"


_lock = threading.Lock()
_process_signer: Signer | None = None


def process_signer() -> Signer:
    """This process's signer: the one :func:`install`\\ ed, else from
    :data:`~replication.contract.ENV_JOB_KEY`.

    Without either, a public key (nothing is authenticated; see the module docstring).
    """
    global _process_signer
    if _process_signer is None:
        with _lock:
            if _process_signer is None:
                text = os.environ.get(ENV_JOB_KEY, "")
                if text:
                    try:
                        key = bytes.fromhex(text)
                    except ValueError:
                        raise ValueError(f"environment variable {ENV_JOB_KEY} is not hex") from None
                    _process_signer = Signer(key)
                else:
                    _process_signer = Signer(_UNAUTHENTICATED_KEY, authenticated=False)
    return _process_signer


def install(signer: Signer | None) -> None:
    """Make ``signer`` this process's signer (None: read
    :data:`~replication.contract.ENV_JOB_KEY` again)."""
    global _process_signer
    with _lock:
        _process_signer = signer


def seal(key: str, payload: str | bytes) -> bytes:
    return process_signer().seal(key, payload)


def open_sealed(key: str, raw: bytes | str | None) -> bytes | None:
    return process_signer().open(key, raw)
