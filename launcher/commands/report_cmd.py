"""``checkpointless report RUN_DIR``: write a run's HTML report (see ``docs/report.md``).

Only argument parsing lives here; :mod:`launcher.report` does the work and is imported
when the command runs, so ``checkpointless --help`` never pays for matplotlib. Progress
goes to stderr, the path of the page to stdout; bad input is ``checkpointless: error:
...`` with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from replication.contract import EXIT_USAGE

PROG = "checkpointless"

EPILOG = """\
examples:
  checkpointless report runs/job1                       # writes runs/job1/report.html
  checkpointless report runs/job1 -o /tmp/job1.html
  checkpointless report runs/job1 --checkpoints s3://bucket/job1 \\
      --storage-option client_kwargs.endpoint_url=http://minio:9000

The durable checkpoints come from --checkpoints, else from persistence.path in the
recipe the run recorded (events from 'checkpointless run' carry it)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="write an HTML report of a run (timeline, recoveries, checkpoints)",
        description="Turn RUN_DIR/events.jsonl and the durable checkpoint history into one "
        "self-contained HTML page.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run's --run-dir")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help="where to write the page (default: RUN_DIR/report.html)")
    parser.add_argument("--checkpoints", metavar="URL",
                        help="persistence root holding checkpoint_history.csv (default: the "
                        "run's persistence.path)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                        help="fsspec storage option for --checkpoints (repeatable; dotted "
                        "keys nest)")
    parser.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from launcher.commands.ckpt_cmd import _CkptError, storage_options
    from launcher.report import ReportError, generate

    def progress(message: str) -> None:
        print(f"{PROG} report: {message}", file=sys.stderr, flush=True)

    try:
        options = storage_options(args.storage_option)
        report = generate(args.run_dir, args.output, checkpoints=args.checkpoints,
                          storage_options=options, progress=progress)
    except (ReportError, _CkptError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    run = report.run
    print(f"wrote {report.path} ({report.nbytes / 1000:.0f} KB: {len(run.failures)} "
          f"failure(s), {len(run.recoveries)} recovery(ies), {len(report.checkpoints.rows)} "
          "durable checkpoint step(s))")
    return 0
