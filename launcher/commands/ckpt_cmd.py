"""``checkpointless ckpt list|show|verify|prune URL``: inspect durable checkpoints.

URL is a persistence root (``persistence.path``) or one ``step_<N>`` directory under it,
on any fsspec store (a local path, ``s3://bucket/prefix``, ``gs://...``). Options for
the store go in ``-o KEY=VALUE`` (dotted keys nest: ``-o client_kwargs.endpoint_url=
http://127.0.0.1:9000``; values are read as JSON when they parse, else as strings).

Every subcommand prints a table, or JSON with ``--json``. Bad input or unreachable
storage prints ``checkpointless: error: ...`` and exits 2; ``verify`` exits 1 when it
finds damage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

PROG = "checkpointless"
EXIT_DAMAGED = 1
EXIT_USAGE = 2

EPILOG = """\
examples:
  checkpointless ckpt list /mnt/ckpt/run1
  checkpointless ckpt list s3://bucket/run1 -o client_kwargs.endpoint_url=http://minio:9000
  checkpointless ckpt show /mnt/ckpt/run1            # the newest valid checkpoint
  checkpointless ckpt verify /mnt/ckpt/run1/step_400 --json
  checkpointless ckpt prune /mnt/ckpt/run1 --keep-last 3 --dry-run"""


class _CkptError(Exception):
    pass


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ckpt", help="list, show, verify or prune durable checkpoints",
        description="Inspect the durable checkpoints written under persistence.path.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = actions.add_parser("list", help="list checkpoints, newest last")
    _common(p)
    p.add_argument("--all", action="store_true",
                   help="also list incomplete and damaged step directories")
    p.set_defaults(handler=_guard(_list))

    p = actions.add_parser("show", help="details of one checkpoint (default: the newest)")
    _common(p)
    p.set_defaults(handler=_guard(_show))

    p = actions.add_parser("verify", help="re-hash checkpoint files against their manifest")
    _common(p)
    p.add_argument("--all", action="store_true", help="verify every valid checkpoint")
    p.add_argument("--deep", action="store_true",
                   help="also load every rank's tensors and check the snapshot digests")
    p.set_defaults(handler=_guard(_verify))

    p = actions.add_parser("prune", help="keep the newest N checkpoints, delete the rest")
    _common(p)
    p.add_argument("--keep-last", type=int, required=True, metavar="N",
                   help="valid checkpoints to keep")
    p.add_argument("--grace-s", type=float, default=3600.0, metavar="S",
                   help="delete incomplete directories newer than the newest checkpoint only "
                   "when untouched for S seconds (a save may be writing them; default 3600)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p.set_defaults(handler=_guard(_prune))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", metavar="URL", help="persistence root or step_<N> directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option (repeatable; dotted keys nest)")


def _guard(fn):
    def handler(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except _CkptError as exc:
            return _error(str(exc))
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # storage errors come in many types; never a traceback
            from replication.durable import DurableError

            if isinstance(exc, (DurableError, ValueError)):
                return _error(str(exc))
            if isinstance(exc, FileNotFoundError):
                return _error(f"{args.url}: not found ({exc})")
            return _error(f"{args.url}: {type(exc).__name__}: {exc}")

    return handler


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def storage_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise _CkptError(f"storage option {pair!r} is not KEY=VALUE")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise _CkptError(f"storage option {pair!r} conflicts with {part}={child!r}")
            node = child
        node[parts[-1]] = value
    return out


def _opts(args: argparse.Namespace) -> dict[str, Any]:
    return storage_options(args.storage_option)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _dump(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=True))


def _list(args: argparse.Namespace) -> int:
    from replication.durable import scan

    infos = scan(args.url, _opts(args))
    if not args.all:
        infos = [i for i in infos if i.valid]
    if args.json:
        _dump({"url": args.url, "checkpoints": [i.to_json() for i in infos]})
        return 0
    if not infos:
        print(f"no {'step directories' if args.all else 'valid checkpoints'} under {args.url}")
        return 0
    rows = [("STEP", "STATUS", "WORLD", "SIZE", "CREATED", "URL")]
    for i in infos:
        created = _when(i.manifest.created_unix if i.manifest else i.mtime)
        status = i.status if i.valid or not i.reason else f"{i.status} ({i.reason})"
        rows.append((str(i.step), status, str(i.world_size or "-"), _size(i.nbytes), created,
                     i.url))
    _table(rows)
    return 0


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _show(args: argparse.Namespace) -> int:
    from replication.durable import open_checkpoint

    info = open_checkpoint(args.url, _opts(args))
    m = info.manifest
    assert m is not None
    if args.json:
        _dump({**info.to_json(), "manifest": m.to_json()})
        return 0
    print(f"checkpoint   {info.url}")
    print(f"step         {m.step}")
    print(f"world size   {m.world_size}")
    print(f"run id       {m.run_id}")
    print(f"created      {_when(m.created_unix)}")
    print(f"size         {_size(m.total_bytes)} in {len(m.files)} files")
    ident = m.identical_segments
    print(f"state        {', '.join(sorted(m.ranks[0].segments))}")
    print(f"identical    {', '.join(ident) if ident else '-'}"
          + ("  (loadable at any world size)" if len(ident) == len(m.ranks[0].segments) else ""))
    rows = [("RANK", "FILE", "SIZE", "XXH3-128")]
    for r in m.ranks:
        for rel, f in sorted(r.files.items()):
            rows.append((str(r.rank), rel, _size(f.size), f.digest))
    print()
    _table(rows)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from replication.durable import DurableError, list_checkpoints, open_checkpoint, verify

    opts = _opts(args)
    if args.all:
        targets = list_checkpoints(args.url, opts)
        if not targets:
            raise DurableError(f"no valid checkpoint under {args.url}")
    else:
        targets = [open_checkpoint(args.url, opts)]
    reports = [verify(t, opts, deep=args.deep) for t in targets]
    if args.json:
        _dump({"ok": all(r.ok for r in reports), "checkpoints": [r.to_json() for r in reports]})
    else:
        for r in reports:
            verdict = "ok" if r.ok else "CORRUPTED"
            print(f"step {r.step}: {verdict}: {r.files_checked} files, {_size(r.nbytes)} "
                  f"in {r.duration_s:.2f}s  {r.url}")
            for p in r.problems:
                print(f"    {p}")
    return 0 if all(r.ok for r in reports) else EXIT_DAMAGED


def _prune(args: argparse.Namespace) -> int:
    from replication.durable import prune

    if args.keep_last < 0:
        raise _CkptError(f"--keep-last must be >= 0, got {args.keep_last}")
    report = prune(args.url, args.keep_last, _opts(args), incomplete_grace_s=args.grace_s,
                   dry_run=args.dry_run)
    if args.json:
        _dump({**report.to_json(), "dry_run": args.dry_run})
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"kept steps {report.kept or '-'}")
    for url in report.deleted:
        print(f"{verb} {url}")
    for url in report.spared:
        print(f"spared {url} (incomplete, recently written: a save may be in progress)")
    if not report.deleted:
        print(f"nothing to {'delete' if args.dry_run else 'prune'}")
    return 0
