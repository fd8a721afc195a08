"""Who is in the job and which agent runs which ranks, as recorded in the job store.

Agents coordinate only through keys from :mod:`recovery.generation.protocol`:

- ``AGENTS_KEY`` lists every agent that ever joined: the ring in which each agent
  watches its next few neighbours' heartbeats (:mod:`launcher.liveness`). Registering
  rewrites ``LIVENESS_VERSION_KEY``, so watchers re-read the list only when it grew;
- ``group_owner_key(g)`` names the agent that runs group ``g``'s ranks. Ownership is
  moved with a compare-and-set from the lost owner's record, which makes the takeover of
  a lost node's ranks exclusive without depending on which generation each claimer saw.

Every one of these values is sealed with the job key (:mod:`recovery.job_store.auth`): a forged or
garbled agents-list entry spoils nothing but itself, and owner records carry an epoch
that grows with each takeover, so an old one written back is recognised. The heartbeat
thread puts back this agent's owner record if something overwrote it
(:func:`reassert_owner`; ``docs/security.md`` says what remains possible).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from recovery.generation import protocol
from recovery.job_store import auth
from replication.side_channel import signing


def register(store: dist.Store, node: int, nproc: int, spare: bool,
             link: str | None = None) -> None:
    """Publish this agent; its heartbeat key exists before anyone can list it.

    The agents list is an append-only string of sealed entries between commas, so a
    forged or garbled entry (or a forger's unterminated text) spoils nothing but itself.
    """
    info = {"node": node, "host": socket.gethostname(), "pid": os.getpid(),
            "nproc": nproc, "spare": spare, "link": link}  # link: launcher.peer_link
    auth.put(store, protocol.agent_info_key(node), json.dumps(info))
    auth.put(store, protocol.agent_heartbeat_key(node), "0")
    entry = signing.process_signer().seal(protocol.AGENTS_KEY, str(node))
    store.append(protocol.AGENTS_KEY, b"," + entry + b",")
    protocol.bump_liveness_version(store)


def registered_nodes(store: dist.Store) -> list[int]:
    """Nodes with a validly sealed entry in the agents list."""
    raw = auth.read_raw(store, protocol.AGENTS_KEY)
    nodes = set()
    for entry in protocol.sealed_list_entries(raw):
        payload = auth.open_value(protocol.AGENTS_KEY, entry)
        if payload is not None:
            nodes.add(int(payload))
    return sorted(nodes)


def agent_info(store: dist.Store, node: int) -> dict | None:
    return protocol.read_json(store, protocol.agent_info_key(node))


@dataclass(frozen=True)
class OwnerRecord:
    node: int
    epoch: int  # 0 at launch, +1 with each takeover
    raw: bytes  # the sealed value as stored


#: group -> the newest owner record this process verified (one job per agent process).
_owners_seen: dict[int, OwnerRecord] = {}


def _parse_owner(group: int, raw: bytes | None) -> OwnerRecord | None:
    payload = auth.open_value(protocol.group_owner_key(group), raw)
    if payload is None or raw is None:
        return None
    rec = OwnerRecord(*protocol.parse_owner_payload(payload), bytes(raw))
    known = _owners_seen.get(group)
    if known is not None and rec.epoch < known.epoch:
        auth.report(protocol.group_owner_key(group), rec.raw,
                    f"an old owner record written back (epoch {rec.epoch} < {known.epoch})")
        return None
    _owners_seen[group] = rec
    return rec


def own_group(store: dist.Store, group: int, node: int) -> bool:
    """Claim group ``group`` at launch; False if some agent already owns it."""
    key = protocol.group_owner_key(group)
    _, payload = auth.claim(store, key, protocol.owner_payload(node, 0))
    owner_node, epoch = protocol.parse_owner_payload(payload)
    if owner_node != node:
        return False
    # Seals are deterministic: this is exactly the value in the store.
    sealed = signing.process_signer().seal(key, payload)
    _owners_seen[group] = OwnerRecord(node, epoch, sealed)
    return True


def take_over(store: dist.Store, group: int, lost: int, node: int) -> bool:
    """Move ``group`` from the lost node to this one; exactly one claimer wins.

    The compare-and-set goes from the exact stored value. If that value does not verify
    (a forger overwrote the lost owner's record), the record this agent verified before
    stands in for it, so a forger cannot block the takeover of a lost node's ranks.
    """
    key = protocol.group_owner_key(group)
    raw = auth.read_raw(store, key)
    rec = _parse_owner(group, raw)
    if rec is None:
        rec = _owners_seen.get(group)
    if rec is None or rec.node != lost:
        return False
    payload = protocol.owner_payload(node, rec.epoch + 1)
    if not auth.replace(store, key, raw or b"", payload):
        return False
    _parse_owner(group, signing.process_signer().seal(key, payload))
    return True


def reassert_owner(store: dist.Store, group: int, node: int) -> None:
    """Put this agent's owner record back if a forger replaced or deleted it."""
    known = _owners_seen.get(group)
    if known is None or known.node != node:
        return
    key = protocol.group_owner_key(group)
    raw = auth.read_raw(store, key)
    if raw is not None and bytes(raw) == known.raw:
        return
    current = _parse_owner(group, raw)
    if current is not None and current.epoch > known.epoch:
        return  # legitimately taken over by another agent
    store.compare_set(key, bytes(raw) if raw is not None else b"", known.raw)


def owner(store: dist.Store, group: int) -> int | None:
    """The node owning ``group``; None if none does or the record does not verify."""
    rec = _parse_owner(group, auth.read_raw(store, protocol.group_owner_key(group)))
    return None if rec is None else rec.node


def owners(store: dist.Store, ngroups: int) -> dict[int, int | None]:
    """group -> owning node (None while a group has no verified owner, e.g. before launch)."""
    keys = [protocol.group_owner_key(g) for g in range(ngroups)]
    present = [g for g, k in enumerate(keys) if store.check([k])]
    values = store.multi_get([keys[g] for g in present]) if present else []
    found = {g: _parse_owner(g, bytes(v)) for g, v in zip(present, values)}
    return {g: (rec.node if (rec := found.get(g)) is not None else None) for g in range(ngroups)}


def wait_for_groups(
    store: dist.Store, ngroups: int, nproc: int, timeout_s: float, should_stop: Callable[[], bool]
) -> str | None:
    """Wait until every group has an agent (torchrun's rendezvous); the problem, if any.

    Returns None when all groups are owned by agents with the same ``nproc`` (or when
    ``should_stop`` or the fatal flag ends the wait: the caller checks those).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if should_stop() or protocol.fatal(store) is not None:
            return None
        found = owners(store, ngroups)
        missing = [g for g, node in found.items() if node is None]
        if not missing:
            break
        if time.monotonic() > deadline:
            return f"node ranks {missing} did not join within {timeout_s:.0f}s"
        time.sleep(0.1)
    for node in sorted(set(found.values())):
        info = agent_info(store, node)
        if info and int(info["nproc"]) != nproc:
            return (f"node {node} runs {info['nproc']} workers per node but another runs "
                    f"{nproc}: every agent needs the same --nproc-per-node")
    return None
