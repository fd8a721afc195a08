"""Where the job's store is, as one string every process of the job can pass around.

Two backends (``checkpointless run --rdzv-backend``):

- ``c10d`` (the default): node 0's agent hosts a ``TCPStore``; the address is
  ``HOST:PORT``, exactly as before, so ``MASTER_ADDR``-style tooling keeps working;
- ``etcd``: an etcd v3 cluster next to the job holds every record; the address is
  ``etcd://H1:P1,H2:P2,.../JOB`` (the members, then the job's key prefix), and no agent
  hosts anything, so any node may be lost (ADR 0020).

Agents and workers hand this string to :func:`connect` and get a ``dist.Store``: the
protocol code above never knows which backend it runs on.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from replication.errors import CheckpointlessError

ETCD_SCHEME = "etcd://"
#: Every job's keys live under this prefix in a shared etcd cluster, then its id.
ETCD_KEY_ROOT = "checkpointless"
DEFAULT_PATIENCE_S = 15.0


class BadStoreAddress(CheckpointlessError, ValueError):
    """A store address that names no backend or no endpoint."""


@dataclass(frozen=True)
class StoreAddress:
    """A parsed store address: the backend, its endpoints and (etcd) the job prefix."""

    backend: str  # "c10d" or "etcd"
    endpoints: tuple[tuple[str, int], ...]
    job: str = ""
    #: etcd: how long no member may answer (down, or no quorum) before an operation
    #: fails (``recovery.store_outage_s``); carried in the address so every process of
    #: the job waits out the same outage.
    patience_s: float = DEFAULT_PATIENCE_S

    @property
    def is_etcd(self) -> bool:
        return self.backend == "etcd"

    @property
    def prefix(self) -> str:
        """The job's key prefix in etcd (``""`` for a TCPStore, which holds one job)."""
        return f"{ETCD_KEY_ROOT}/{self.job}/" if self.is_etcd else ""

    def endpoint_text(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def __str__(self) -> str:
        if self.is_etcd:
            return f"{ETCD_SCHEME}{self.endpoint_text()}/{self.job}?patience={self.patience_s:g}"
        host, port = self.endpoints[0]
        return f"{host}:{port}"


def tcp(host: str, port: int) -> StoreAddress:
    return StoreAddress("c10d", ((host, int(port)),))


def etcd(endpoints: list[tuple[str, int]] | tuple[tuple[str, int], ...], job: str,
         patience_s: float = DEFAULT_PATIENCE_S) -> StoreAddress:
    if not endpoints:
        raise BadStoreAddress("an etcd store address needs at least one endpoint")
    return StoreAddress("etcd", tuple((h, int(p)) for h, p in endpoints), job,
                        float(patience_s))


def parse(text: str) -> StoreAddress:
    """The inverse of ``str(address)``."""
    if text.startswith(ETCD_SCHEME):
        rest = text[len(ETCD_SCHEME):]
        members, _, job = rest.partition("/")
        job, _, query = job.partition("?")
        if not job:
            raise BadStoreAddress(f"store address {text!r}: no job after the members")
        patience = DEFAULT_PATIENCE_S
        if query.startswith("patience="):
            try:
                patience = float(query.removeprefix("patience="))
            except ValueError:
                raise BadStoreAddress(f"store address {text!r}: bad patience") from None
        return etcd([_endpoint(m, text) for m in members.split(",") if m], job, patience)
    return StoreAddress("c10d", (_endpoint(text, text),))


def _endpoint(item: str, text: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise BadStoreAddress(f"store address {text!r}: {item!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def connect(address: StoreAddress | str, timeout_s: float = 60.0) -> dist.Store:
    """A new client of the job's store (each call is a new connection)."""
    addr = parse(address) if isinstance(address, str) else address
    timeout = datetime.timedelta(seconds=timeout_s)
    if addr.is_etcd:
        from recovery.job_store.etcd_store import EtcdStore

        return EtcdStore([f"{h}:{p}" for h, p in addr.endpoints], prefix=addr.prefix,
                         timeout=timeout, unavailable_after=addr.patience_s)
    host, port = addr.endpoints[0]
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)
