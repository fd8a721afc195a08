"""The job store on etcd: a ``torch.distributed.Store`` backed by an etcd v3 cluster.

Why: node 0's c10d ``TCPStore`` is a single point of failure; an etcd cluster of three
or five members keeps answering while a minority of them is down. Everything that
takes a ``dist.Store`` (the control-plane records of ``recovery.generation.protocol``, the commit
ledger, gloo's rendezvous through ``PrefixStore``) works unchanged on :class:`EtcdStore`,
because it subclasses ``dist.Store`` and keeps c10d's semantics: ``get`` and ``wait``
block until the key exists, ``add`` keeps the counter as a decimal string,
``compare_set`` creates a missing key when ``expected`` is empty.

The client speaks JSON to etcd's gRPC gateway (``/v3/kv/...``, ``/v3/lease/...``,
``/v3/watch``; keys and values base64) with ``http.client``: stdlib only, no grpc, no
``requests`` pin next to torch (``docs/adr/0020-etcd-job-store.md``). Read-modify-write
operations are transactions that compare the key's ``mod_revision``, retried on
contention. A blocking wait watches the key from the revision it read, in slices of
:data:`WATCH_SLICE_S`, so it wakes on the write itself and costs etcd one request per
slice, not a poll loop. A request that a member cannot answer (refused, reset, timed
out, 5xx) goes to the next endpoint; when none answers for ``unavailable_after`` seconds
:class:`EtcdUnavailable` names them all.

Known limit: ``add``/``append``/``compare_set`` are not exactly-once across a failover
that loses the *answer* to a transaction etcd did apply (the retry applies it again).
"""

from __future__ import annotations

import base64
import datetime
import http.client
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from replication.errors import CheckpointlessError

#: A blocking wait re-checks the key and its member at least this often (seconds).
WATCH_SLICE_S = 1.0


#: The gRPC status code etcd answers when what a request names does not exist (for the
#: lease calls: ``etcdserver: requested lease not found``).
GRPC_NOT_FOUND = 5


class EtcdStoreError(CheckpointlessError, dist.DistStoreError):
    """etcd refused a request or answered with something this client cannot read.

    ``code`` is the gRPC status code of etcd's reply when it gave one (its JSON gateway
    answers an error as ``{"error", "message", "code"}``), else None: callers tell
    refusals apart by it, not by the wording of the message.
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class EtcdStoreTimeout(EtcdStoreError):
    """A key did not appear within the timeout (what ``TCPStore`` raises as a
    ``DistStoreError``); the message names the keys and the timeout."""


class EtcdUnavailable(EtcdStoreError):
    """No endpoint of the cluster answered within the bound; the message names them."""


class EtcdLeaseExpired(EtcdStoreError):
    """A lease that a keepalive was sent for no longer exists (it expired or was revoked)."""


def _grpc_code(text: str) -> int | None:
    """The gRPC status code in etcd's JSON error reply, or None if it has none."""
    try:
        code = json.loads(text).get("code")
    except (ValueError, AttributeError):
        return None
    return code if isinstance(code, int) else None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _seconds(timeout: datetime.timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _host_port(endpoint: str) -> tuple[str, int]:
    bare = endpoint.strip()
    if "://" in bare:
        scheme, bare = bare.split("://", 1)
        if scheme != "http":
            raise ValueError(f"etcd endpoint {endpoint!r}: only http:// is supported")
    bare = bare.rstrip("/")
    host, sep, port = bare.rpartition(":")
    if not sep or not port.isdigit():
        return bare, 2379
    return host.strip("[]"), int(port)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class _Retry(CheckpointlessError):
    """This member cannot answer now; try the next one."""


class EtcdStore(dist.Store):
    """A c10d store whose keys live under ``prefix`` in an etcd v3 cluster.

    ``endpoints`` are ``host:port`` (or ``http://host:port``) client URLs of the
    members; ``timeout`` is the store's default for ``get``/``wait`` (c10d's
    ``timeout``); ``request_timeout`` bounds one HTTP request to one member;
    ``unavailable_after`` bounds how long every member may fail to answer before a call
    raises :class:`EtcdUnavailable` (at most ``unavailable_after`` plus one round of
    ``request_timeout`` per member, when members hang instead of refusing).
    """

    def __init__(self, endpoints: Sequence[str] | str, prefix: str,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=300), *,
                 request_timeout: float = 5.0, unavailable_after: float = 15.0) -> None:
        super().__init__()
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self._endpoints = [e.strip() for e in endpoints]
        self._addrs = [_host_port(e) for e in self._endpoints]
        self._prefix = prefix
        self._raw_prefix = prefix.encode()
        self._request_timeout = float(request_timeout)
        self._unavailable_after = float(unavailable_after)
        self._current = 0  # the member that answered last; requests start there
        self._local = threading.local()  # one keep-alive connection per thread and member
        self.set_timeout(timeout)

    # -- transport ------------------------------------------------------------------

    def _conn(self, idx: int) -> http.client.HTTPConnection:
        conns: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("c", {})
        conn = conns.get(idx)
        if conn is None:
            host, port = self._addrs[idx]
            conn = conns[idx] = http.client.HTTPConnection(host, port,
                                                           timeout=self._request_timeout)
        return conn

    def _drop(self, idx: int) -> None:
        conn = self._local.__dict__.get("c", {}).pop(idx, None)
        if conn is not None:
            conn.close()

    def _post_once(self, idx: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for fresh in (False, True):
            conn = self._conn(idx)
            reused = conn.sock is not None
            try:
                conn.request("POST", path, json.dumps(body),
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError) as exc:
                self._drop(idx)  # an idle keep-alive connection the member closed:
                if reused and not fresh:  # the request never reached it, send it again
                    continue
                raise _Retry(f"{self._endpoints[idx]}: {exc!r}") from exc
            except (OSError, http.client.HTTPException) as exc:
                self._drop(idx)
                raise _Retry(f"{self._endpoints[idx]}: {exc!r}") from exc
        text = data.decode(errors="replace")
        if resp.status >= 500 or resp.status == 429:
            raise _Retry(f"{self._endpoints[idx]}: HTTP {resp.status} {text[:200]}")
        if resp.status != 200:
            raise EtcdStoreError(f"etcd {self._endpoints[idx]} refused {path}: "
                                 f"HTTP {resp.status} {text[:300]}", _grpc_code(text))
        line = text.strip().split("\n", 1)[0]  # streaming calls answer one JSON per line
        reply = json.loads(line) if line else {}
        if "error" in reply:  # a stream's in-band error
            raise EtcdStoreError(f"etcd {self._endpoints[idx]} refused {path}: {reply}")
        return reply.get("result", reply)

    def _members(self) -> list[int]:
        first = self._current
        return [(first + i) % len(self._addrs) for i in range(len(self._addrs))]

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to the first member that answers; fail over across the rest."""
        deadline = time.monotonic() + self._unavailable_after
        pause = 0.05
        while True:
            errors: list[str] = []
            for idx in self._members():
                try:
                    reply = self._post_once(idx, path, body)
                except _Retry as exc:
                    errors.append(str(exc))
                    continue
                self._current = idx
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdUnavailable(
                    f"no etcd member answered {path} for {self._unavailable_after:g}s; "
                    f"endpoints {','.join(self._endpoints)}; last errors: {'; '.join(errors)}")
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)

    def _key(self, key: str) -> bytes:
        return self._raw_prefix + key.encode()

    # -- reads and transactions ------------------------------------------------------

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """(value or None if absent, the key's mod_revision or 0, the store revision)."""
        reply = self._call("/v3/kv/range", {"key": _b64(self._key(key))})
        kvs = reply.get("kvs") or []
        rev = int(reply.get("header", {}).get("revision", 0))
        if not kvs:
            return None, 0, rev
        return _unb64(kvs[0].get("value")), int(kvs[0].get("mod_revision", 0)), rev

    def _put_if_unchanged(self, key: str, mod_revision: int, value: bytes) -> bool:
        """Write ``value`` iff the key's mod_revision is still ``mod_revision`` (0: absent)."""
        k = _b64(self._key(key))
        reply = self._call("/v3/kv/txn", {
            "compare": [{"key": k, "target": "MOD", "result": "EQUAL",
                         "mod_revision": str(mod_revision)}],
            "success": [{"request_put": {"key": k, "value": _b64(value)}}],
        })
        return bool(reply.get("succeeded"))

    def _read_many(self, keys: Sequence[str], count_only: bool) -> tuple[list[bytes | None], int]:
        """Values (None: absent) of ``keys`` read in one transaction, and its revision."""
        ops = [{"request_range": {"key": _b64(self._key(k)), "count_only": count_only}}
               for k in keys]
        reply = self._call("/v3/kv/txn", {"success": ops})
        out: list[bytes | None] = []
        for r in reply.get("responses") or []:
            rr = r.get("response_range", {})
            if count_only:
                out.append(b"" if int(rr.get("count", 0)) else None)
            else:
                kvs = rr.get("kvs") or []
                out.append(_unb64(kvs[0].get("value")) if kvs else None)
        if len(out) != len(keys):
            raise EtcdStoreError(f"etcd answered {len(out)} reads for {len(keys)} keys")
        return out, int(reply.get("header", {}).get("revision", 0))

    # -- blocking waits --------------------------------------------------------------

    def _watch_for_put(self, key: str, start_revision: int, seconds: float) -> None:
        """Return when ``key`` is written at or after ``start_revision``, or after
        ``seconds`` (the caller re-reads the key either way)."""
        host, port = self._addrs[self._current]
        conn = http.client.HTTPConnection(host, port, timeout=max(0.01, seconds))
        body = {"create_request": {"key": _b64(self._key(key)),
                                   "start_revision": str(start_revision)}}
        try:
            conn.request("POST", "/v3/watch", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return
            while True:
                line = resp.readline()
                if not line:
                    return
                result = json.loads(line).get("result", {})
                if result.get("canceled") or any(e.get("type", "PUT") == "PUT"
                                                 for e in result.get("events") or []):
                    return
        except (TimeoutError, OSError, http.client.HTTPException, ValueError):
            time.sleep(min(0.05, seconds))  # a dead member: the re-read fails over
        finally:
            conn.close()

    def _await(self, keys: Sequence[str], timeout: datetime.timedelta | float | None) -> None:
        limit = _seconds(self.timeout if timeout is None else timeout)
        # c10d's kNoTimeout (zero) waits for ever, as TCPStore does.
        deadline = time.monotonic() + limit if limit > 0 else float("inf")
        for key in keys:
            while True:
                present, rev = self._read_many([key], count_only=True)
                if present[0] is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EtcdStoreTimeout(
                        f"etcd store: wait timeout after {limit * 1000:.0f}ms, keys: "
                        f"{[self._prefix + k for k in keys]} (missing {self._prefix + key!r})")
                self._watch_for_put(key, rev + 1, min(left, WATCH_SLICE_S))

    # -- the dist.Store interface ------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._call("/v3/kv/put", {"key": _b64(self._key(key)), "value": _b64(_as_bytes(value))})

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to exist."""
        while True:
            value, _, _ = self._range(key)
            if value is not None:
                return value
            self._await([key], None)

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the decimal counter at ``key`` (0 if absent); the new count."""
        while True:
            raw, mod, _ = self._range(key)
            try:
                new = (int(raw) if raw else 0) + int(value)
            except ValueError:
                raise EtcdStoreError(f"etcd store: add on {key!r}, whose value {raw[:40]!r} "
                                     "is not a number") from None
            if self._put_if_unchanged(key, mod, str(new).encode()):
                return new

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """c10d's compare-and-set: write ``desired`` if the key holds ``expected`` (or is
        absent and ``expected`` is empty); returns the value after the call, or
        ``expected`` itself when the key is absent and ``expected`` is not empty."""
        want, new = _as_bytes(expected), _as_bytes(desired)
        while True:
            raw, mod, _ = self._range(key)
            if raw is None and want:
                return want
            if raw is not None and raw != want:
                return raw
            if self._put_if_unchanged(key, mod, new):
                return new

    def append(self, key: str, value: bytes | str) -> None:
        """Append to the value of ``key``, creating it if absent (atomically)."""
        extra = _as_bytes(value)
        while True:
            raw, mod, _ = self._range(key)
            if self._put_if_unchanged(key, mod, (raw or b"") + extra):
                return

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._await(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        """True iff every key exists now (never blocks)."""
        if not keys:
            return True
        present, _ = self._read_many(list(keys), count_only=True)
        return all(p is not None for p in present)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Values of ``keys`` read in one transaction, waiting for missing ones first."""
        while True:
            values, _ = self._read_many(list(keys), count_only=False)
            missing = [k for k, v in zip(keys, values) if v is None]
            if not missing:
                return [v for v in values if v is not None]
            self._await(missing, None)

    def read_now(self, keys: list[str]) -> list[bytes | None]:
        """Values of ``keys`` in one transaction, ``None`` for a missing one (never
        waits: a lease-bound record that expired is simply gone)."""
        values, _ = self._read_many(list(keys), count_only=False)
        return values

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        ops = [{"request_put": {"key": _b64(self._key(k)), "value": _b64(_as_bytes(v))}}
               for k, v in zip(keys, values)]
        self._call("/v3/kv/txn", {"success": ops})

    def delete_key(self, key: str) -> bool:
        reply = self._call("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(reply.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """How many keys live under this store's prefix."""
        reply = self._call("/v3/kv/range", {"key": _b64(self._raw_prefix),
                                            "range_end": _b64(_prefix_end(self._raw_prefix)),
                                            "count_only": True})
        return int(reply.get("count", 0))

    # The C++ trampoline calls these two by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> EtcdStore:
        """A new client of the same cluster and prefix with its own connections (the
        watchdog gets one so that its requests never queue behind the trainer's)."""
        return EtcdStore(self._endpoints, self._prefix, self.timeout,
                         request_timeout=self._request_timeout,
                         unavailable_after=self._unavailable_after)

    # -- leases (for the launcher's liveness records) -------------------------------

    def grant_lease(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; keys written with it vanish when it expires."""
        return int(self._call("/v3/lease/grant", {"TTL": int(ttl_s)})["ID"])

    def keepalive(self, lease_id: int) -> int:
        """Renew the lease once; returns its new TTL. :class:`EtcdLeaseExpired` if gone."""
        ttl = int(self._call("/v3/lease/keepalive", {"ID": str(lease_id)}).get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseExpired(f"etcd lease {lease_id:x} has expired or was revoked")
        return ttl

    def set_with_lease(self, key: str, value: bytes | str, lease_id: int) -> None:
        self._call("/v3/kv/put", {"key": _b64(self._key(key)),
                                  "value": _b64(_as_bytes(value)), "lease": str(lease_id)})

    def revoke(self, lease_id: int) -> bool:
        """Revoke the lease (its keys are deleted); False if it did not exist."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdStoreError as exc:
            if exc.code == GRPC_NOT_FOUND:  # the only NotFound of a revoke: no such lease
                return False
            raise
        return True

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def prefix(self) -> str:
        return self._prefix
