"""``checkpointless ckpt list|latest|show|verify|prune|export URL``: durable checkpoints.

URL is a persistence root (``persistence.path``), one ``step_<N>`` directory under it, a
DeepSpeed ``save_dir`` or one of its tags (what ``engine.save_checkpoint`` wrote under
the runtime), or (for ``list`` and ``latest``) a directory whose subdirectories are roots, such as a
``ModelCheckpoint`` directory (each ``.ckpt`` name is a root), on any fsspec store (a
local path, ``s3://bucket/prefix``, ``gs://...``). Options for
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

from replication.contract import EXIT_FAILED, EXIT_USAGE
from replication.errors import CheckpointlessError

PROG = "checkpointless"

EPILOG = """\
examples:
  checkpointless ckpt list /mnt/ckpt/run1
  checkpointless ckpt list lightning_logs/version_0/checkpoints   # one root per .ckpt
  checkpointless ckpt list /mnt/ds_ckpt               # a DeepSpeed save_dir: one row per tag
  checkpointless ckpt latest /mnt/ckpt/run1          # prints the newest checkpoint's URL
  checkpointless ckpt list s3://bucket/run1 -o client_kwargs.endpoint_url=http://minio:9000
  checkpointless ckpt show /mnt/ckpt/run1            # the newest valid checkpoint
  checkpointless ckpt verify /mnt/ckpt/run1/step_400 --json
  checkpointless ckpt prune /mnt/ckpt/run1 --keep-last 3 --dry-run
  checkpointless ckpt export --lightning ckpts/last.ckpt model.ckpt  # for plain Lightning

"complete" means the manifest is there and every file has the size it records (one
listing); file contents are re-hashed only by `verify`."""


class _CkptError(CheckpointlessError):
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

    p = actions.add_parser("latest", help="print the URL of the newest complete checkpoint")
    _common(p)
    p.set_defaults(handler=_guard(_latest))

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

    p = actions.add_parser(
        "export", help="write a checkpoint in another framework's own format",
        description="Write one rank's part of a durable checkpoint as a file that the "
        "framework loads without checkpointless (verified while reading).")
    _common(p)
    p.add_argument("dest", metavar="DEST", help="the file to write (local path)")
    p.add_argument("--lightning", action="store_true", required=True,
                   help="a single-file Lightning .ckpt (torch.save), for "
                   "Model.load_from_checkpoint and Trainer.fit(ckpt_path=...)")
    p.add_argument("--rank", type=int, default=0,
                   help="whose part (RNG streams and data position differ per rank)")
    p.set_defaults(handler=_guard(_export))


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
    from replication.durable import find_roots, scan
    from replication.durable.tagged import scan_tagged

    opts = _opts(args)
    infos = [i for root in find_roots(args.url, opts) for i in scan(root, opts)]
    infos += scan_tagged(args.url, opts)  # a DeepSpeed save_dir's tags
    if not args.all:
        infos = [i for i in infos if i.valid]
    if args.json:
        _dump({"url": args.url, "checkpoints": [_info_json(i) for i in infos]})
        return 0
    if not infos:
        print(f"no {'step directories' if args.all else 'complete checkpoints'} under "
              f"{args.url} or its subdirectories")
        return 0
    rows = [("STEP", "STATUS", "WORLD", "SIZE", "CREATED", "URL")]
    for i in infos:
        created = _when(i.manifest.created_unix if i.manifest else i.mtime)
        rows.append((str(i.step) if i.step >= 0 else "-", _status(i), str(i.world_size or "-"),
                     _size(i.nbytes),
                     created, i.url))
    _table(rows)
    print(NOT_VERIFIED)
    return 0


#: What ``list`` and ``show`` can and cannot see (they read a listing and the manifest).
NOT_VERIFIED = ("complete: manifest present, every file at its recorded size; contents not "
                "re-hashed (run `checkpointless ckpt verify URL`)")


def _status(info: Any) -> str:
    if info.valid:
        return "complete"
    return f"{info.status} ({info.reason})" if info.reason else info.status


def _info_json(info: Any) -> dict[str, Any]:
    return {**info.to_json(), "contents_verified": False}


def _latest(args: argparse.Namespace) -> int:
    from replication.durable import DurableError, find_roots, newest_checkpoint

    opts = _opts(args)
    find_roots(args.url, opts)  # a missing or non-directory URL is an error, said so
    info = newest_checkpoint([args.url], opts)
    if info is None:
        raise DurableError(f"no complete checkpoint under {args.url} or its subdirectories")
    if args.json:
        _dump(_info_json(info))
    else:
        print(info.url)
    return 0


def _export(args: argparse.Namespace) -> int:
    from replication.durable import open_checkpoint

    opts = _opts(args)
    info = open_checkpoint(args.url, opts)
    try:
        from recovery.integrations.lightning.export import export_lightning
    except ImportError as exc:
        raise _CkptError(f"--lightning needs Lightning installed ({exc})") from None
    out = export_lightning(info, args.dest, rank=args.rank, storage_options=opts)
    if args.json:
        _dump({"source": info.url, "dest": args.dest, "step": out["global_step"],
               "bytes": out["bytes"]})
    else:
        print(f"wrote {args.dest} ({_size(out['bytes'])}): step {out['global_step']} of "
              f"{info.url}, rank {args.rank}'s part; load it with plain Lightning")
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
        _dump({**_info_json(info), "manifest": m.to_json()})
        return 0
    print(f"checkpoint   {info.url}")
    print("status       complete (sizes match the manifest; contents not verified: "
          "`checkpointless ckpt verify`)")
    print(f"step         {m.step}")
    print(f"world size   {m.world_size}")
    print(f"run id       {m.run_id}")
    print(f"created      {_when(m.created_unix)}")
    print(f"size         {_size(m.total_bytes)} in {len(m.files)} files")
    ident = m.identical_segments
    if m.layout != "dcp":  # a framework's own files, under the tag it named
        print(f"layout       {m.layout}'s own, tag {m.tag!r} (load it with {m.layout})")
    else:
        print(f"state        {', '.join(sorted(m.ranks[0].segments))}")
        print(f"identical    {', '.join(ident) if ident else '-'}"
              + ("  (loadable at any world size)" if len(ident) == len(m.ranks[0].segments)
                 else ""))
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
    return 0 if all(r.ok for r in reports) else EXIT_FAILED


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
