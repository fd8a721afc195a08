"""Whether the saves a durable writer skipped were its documented back-pressure.

A due save is skipped, never waited for, when storage is slower than the cadence asks
(ADR 0005: a store that cannot keep up never stalls training nor grows memory). How
many are skipped measures the host's disk, not the product, so a test checks each skip
against the same run's own records instead of bounding their number:

- "still writing step S (T s so far); storage cannot keep up": the same rank saved S,
  and that save's own measured duration covers T;
- "superseded by step N": a snapshot round committed only after the next due one had
  ended (``recovery.durable.tier``); the same rank handed N to the writer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

KEEP_UP = re.compile(r"still writing step (\d+) \(([\d.]+)s so far\); storage cannot keep up")
SUPERSEDED = re.compile(r"superseded by step (\d+)")


def unjustified_skips(rows: Iterable[Mapping[str, str]]) -> list[tuple[str, str, str, str]]:
    """(step, rank, status, detail) of every history row that is neither a save nor a
    skip its own run justifies (see the module)."""
    rows = list(rows)
    ok = {(int(r["rank"]), int(r["step"])): float(r.get("duration_s") or 0.0)
          for r in rows if r["status"] == "ok"}
    handed = {(int(r["rank"]), int(r["step"])) for r in rows}
    bad = []
    for r in rows:
        if r["status"] == "ok":
            continue
        detail = r.get("detail") or ""
        rank = int(r["rank"])
        keep_up = KEEP_UP.search(detail) if r["status"] == "skipped" else None
        newer = SUPERSEDED.match(detail) if r["status"] == "skipped" else None
        if keep_up is not None:
            busy = (rank, int(keep_up.group(1)))
            if busy in ok and ok[busy] + 0.05 >= float(keep_up.group(2)):
                continue
        elif newer is not None and (rank, int(newer.group(1))) in handed \
                and int(newer.group(1)) > int(r["step"]):
            continue
        bad.append((r["step"], r["rank"], r["status"], detail))
    return bad
