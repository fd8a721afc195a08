"""``checkpointless report``: one self-contained HTML page about a finished (or live) run.

Inputs are what a run leaves behind: ``RUN_DIR/events.jsonl`` (agents and workers) and
the durable tier's ``checkpoint_history.csv``. The pipeline is small on purpose:
:mod:`.events` reads and checks the file, :mod:`.model` derives failures, recoveries
and steps, :mod:`.checkpoints` folds the history, :mod:`.plots` draws PNGs with
matplotlib (imported only here, lazily) and :mod:`.html` writes the page.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from launcher.report.checkpoints import Checkpoints, load_checkpoints, locate
from launcher.report.events import ReportError, events_path, load_events
from launcher.report.model import Run, build_run

__all__ = ["Report", "ReportError", "generate"]


@dataclass
class Report:
    path: str
    run: Run
    checkpoints: Checkpoints
    nbytes: int


def generate(
    run_dir: str,
    output: str | None = None,
    *,
    checkpoints: str | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] = lambda _msg: None,
) -> Report:
    """Write the report of ``run_dir`` (default ``RUN_DIR/report.html``); see the CLI."""
    path = events_path(run_dir)
    loaded = load_events(path)
    try:
        run = build_run(loaded.events)
    except (KeyError, TypeError, ValueError) as exc:  # a field of an unexpected shape
        raise ReportError(f"{path}: an event has a field of an unexpected type or is "
                          f"missing one ({type(exc).__name__}: {exc})") from None
    torn = "; skipped a torn last line" if loaded.torn_last_line else ""
    progress(f"read {len(loaded.events)} events from {path} ({run.world_size} ranks, "
             f"{len(run.agents)} agent(s), {len(run.failures)} failure(s){torn})")
    url, options, note = locate(run, checkpoints)
    if url is None:
        ckpts = Checkpoints(None, note=note)
    else:
        ckpts = load_checkpoints(url, {**options, **(storage_options or {})}, run,
                                 strict=checkpoints is not None)
        progress(f"read {ckpts.history_rows} checkpoint history rows from {url}"
                 + (f" ({ckpts.note})" if ckpts.note else ""))
    images = _draw(run, ckpts, progress)
    from launcher.report.html import render

    page = render(run, ckpts, images, run_dir=os.path.abspath(run_dir), events_path=path,
                  torn=loaded.torn_last_line)
    out = output or os.path.join(run_dir, "report.html")
    data = page.encode("utf-8")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        tmp = f"{out}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out)  # a reader never sees half a page
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror or exc}") from None
    return Report(out, run, ckpts, len(data))


def _draw(run: Run, ckpts: Checkpoints, progress: Callable[[str], None]) -> dict[str, str | None]:
    progress("drawing the timeline, throughput and recovery-phase plots")
    try:
        from launcher.report import plots
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ReportError(f"matplotlib is needed for the report's plots ({exc}); install "
                          "it with: pip install 'checkpointless[report]'") from None
    phases = plots.recovery_phases(run)
    return {
        "timeline": plots.data_uri(plots.timeline(run, ckpts)),
        "throughput": plots.data_uri(plots.throughput(run)),
        "phases": plots.data_uri(phases) if phases else None,
    }
