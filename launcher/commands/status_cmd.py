"""``checkpointless status``: a running job's nodes, ranks, progress and incidents.

It reads the job store the agents use, with the job secret (like an agent: the store's
records are sealed with a key derived from it, and a reader without it trusts nothing).
It refreshes in place like ``watch``; ``--json`` prints once. What is shown and where it
comes from: :mod:`launcher.job_status`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from replication.contract import ENV_JOB_SECRET, EXIT_USAGE

PROG = "checkpointless"

EPILOG = f"""\
examples:
  checkpointless status --rdzv-endpoint node0:29500 --rdzv-id job1 --job-secret-file s.key
  checkpointless status --rdzv-backend etcd --rdzv-endpoint e1:2379,e2:2379 --rdzv-id job1
  checkpointless status --rdzv-endpoint 127.0.0.1:29500 --rdzv-id job1 --json

The job secret comes from {ENV_JOB_SECRET} or --job-secret-file, as for 'checkpointless
run'; a job of one machine that generated its own is read from --run-dir."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status", help="show a running job: nodes, ranks, generation, progress, incidents",
        description="Read a running job's store and show its nodes (training, spare, "
        "lost, fenced), ranks, generation, committed step, step rate and latest incidents.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                        required=True, metavar="HOST:PORT[,...]",
                        help="the job's store, as given to 'checkpointless run'")
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", required=True,
                        metavar="ID", help="the job id")
    parser.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend",
                        default="c10d", choices=("c10d", "static", "etcd"))
    parser.add_argument("--job-secret-file", dest="job_secret_file", metavar="FILE")
    parser.add_argument("--run-dir", dest="run_dir", metavar="DIR",
                        help="where a one-machine job left its generated secret")
    parser.add_argument("--json", action="store_true", help="print once, as JSON")
    parser.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                        help="refresh period (default 2)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="how long to wait for the store (default 10)")
    parser.set_defaults(handler=run)


def _error(message: str) -> int:
    print(f"{PROG} status: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from launcher import job_secret, job_status, job_store
    from launcher.run_args import UsageError, parse_endpoint, parse_etcd_endpoints
    from recovery.job_store import store_address
    from replication.errors import CheckpointlessError
    from replication.side_channel import signing

    try:
        secret = job_secret.from_sources(os.environ, args.job_secret_file)
        if secret is None and args.run_dir:
            secret = job_secret.read_shared(args.run_dir, timeout_s=0.0)
        if secret is None:
            return _error(f"no job secret: set {ENV_JOB_SECRET} or pass --job-secret-file "
                          "(or --run-dir for a job of one machine)")
        signing.install(job_secret.signer_for(secret, args.rdzv_id))
        if args.rdzv_backend == "etcd":
            addr = store_address.etcd(list(parse_etcd_endpoints(args.rdzv_endpoint)),
                                      args.rdzv_id)
            where = f"etcd {addr.endpoint_text()}"
            store = store_address.connect(addr, args.timeout)
        else:
            host, port = parse_endpoint(args.rdzv_endpoint)
            where = f"{host}:{port}"
            store = job_store.connect_store(host, port, args.timeout)
        job_store.check_job_key(store, where, timeout_s=args.timeout)
    except (UsageError, CheckpointlessError) as exc:
        return _error(str(exc))
    except Exception as exc:  # the store's own errors (refused, timed out)
        return _error(f"cannot read the job store at {args.rdzv_endpoint}: "
                      f"{job_store.brief(exc)}")
    if args.json:
        print(json.dumps(job_status.read(store, args.rdzv_id, where).to_json(), indent=1))
        return 0
    tty = sys.stdout.isatty()
    try:
        while True:
            text = job_status.render(job_status.read(store, args.rdzv_id, where))
            sys.stdout.write(("\x1b[H\x1b[J" if tty else "") + text + "\n")
            sys.stdout.flush()
            time.sleep(max(0.2, args.interval))
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # the job ended and its store went with it
        print(f"{PROG} status: the job store stopped answering ({job_store.brief(exc)})",
              file=sys.stderr)
        return 1
