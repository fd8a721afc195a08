"""Render the report as one self-contained HTML page (inline CSS, PNGs as data URIs).

No script, no font, no stylesheet and no image is fetched from anywhere: the page must
open the same from a laptop, a CI artifact store or an air-gapped cluster. Every value
that came from the run goes through :func:`html.escape`.
"""

from __future__ import annotations

import datetime
import html
import json
from collections.abc import Iterable, Sequence

from launcher.report.checkpoints import Checkpoints
from launcher.report.model import PHASE_LABELS, PHASES, Run

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;
 color:#222;background:#f6f7f9}
main{max-width:1160px;margin:0 auto;padding:20px 28px 40px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;
 border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#666;font-size:12px}.meta code{font-size:12px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:10px;
 margin-top:14px}
.card{background:#fff;border:1px solid #e2e4e8;border-radius:6px;padding:8px 12px}
.card .v{font-size:20px;font-weight:600}.card .k{color:#666;font-size:12px}
.outcome{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:600;
 font-size:13px}
.ok{background:#e3f4e1;color:#1e6b1a}.bad{background:#fbe3e3;color:#9b1c1c}
.warn{background:#fff4d6;color:#7a5a00}
table{border-collapse:collapse;width:100%;background:#fff;font-size:13px}
th,td{border:1px solid #e2e4e8;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef0f3}td.n{text-align:right;font-variant-numeric:tabular-nums;
 white-space:nowrap}
img{max-width:100%;background:#fff;border:1px solid #e2e4e8;border-radius:4px}
.note{color:#666;font-size:12px;margin:6px 0}
.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px}
details summary{cursor:pointer;color:#444}
"""


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s" if value < 100 else f"{value:.0f} s"


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def table(head: Sequence[str], rows: Iterable[Sequence[str]], *, numeric: Sequence[int] = (),
          ident: str = "") -> str:
    """A table; cells are already-escaped HTML, columns in ``numeric`` right-aligned."""
    ident_attr = f' id="{ident}"' if ident else ""
    out = [f"<table{ident_attr}><thead><tr>"]
    out += [f"<th>{esc(h)}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        cells = (f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                 for i, c in enumerate(row))
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render(run: Run, ckpts: Checkpoints, images: dict[str, str | None], *, run_dir: str,
           events_path: str, torn: bool) -> str:
    """The whole page; ``images`` maps a figure name to its data URI (None: not drawn)."""
    parts = [_header(run, ckpts, run_dir, events_path, torn), _failures(run)]
    parts.append(_figure("Timeline", images.get("timeline"),
                         "Steps and snapshots from rank 0; replicated = a replication round "
                         "committed; persisted = durable saves (green ok, yellow some ranks "
                         "only, grey skipped, red failed); the recovery lane shows each "
                         "recovery's phases."))
    parts.append(_figure("Throughput", images.get("throughput"),
                         "Steps completed per second (replayed steps included); shaded: from "
                         "each failure to the first step completed after its recovery."))
    parts.append(_phases(run, images.get("phases")))
    parts.append(_checkpoints(ckpts))
    parts.append(_replication(run))
    parts.append(_event_counts(run))
    if run.config:
        parts.append("<details><summary>Recorded configuration</summary><pre>"
                     + esc(json.dumps(run.config, indent=2)) + "</pre></details>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>checkpointless run report: {esc(run_dir)}</title>"
            f"<style>{CSS}</style></head><body><main>\n{body}\n</main></body></html>\n")


def _header(run: Run, ckpts: Checkpoints, run_dir: str, events_path: str, torn: bool) -> str:
    recs = [f.recovery_s for f in run.recoveries if f.recovery_s is not None]
    started = datetime.datetime.fromtimestamp(run.t0).strftime("%Y-%m-%d %H:%M:%S")
    cls = ("ok" if run.outcome == "completed"
           else "bad" if run.outcome.startswith("failed") else "warn")
    cards = [
        ("ranks", run.world_size or "?"), ("agents (nodes)", len(run.agents) or "?"),
        ("steps", run.final_step if run.final_step is not None else "-"),
        ("failures", len(run.failures)), ("recoveries", len(run.recoveries)),
        ("mean recovery", secs(sum(recs) / len(recs)) if recs else "-"),
        ("max recovery", secs(max(recs)) if recs else "-"),
        ("steps lost", sum(f.steps_lost for f in run.failures)),
        ("duration", secs(run.duration_s)),
        ("durable checkpoints", sum(1 for r in ckpts.rows if r.ok) if ckpts.url else "-"),
    ]
    card_html = "".join(f'<div class="card"><div class="v">{esc(v)}</div>'
                        f'<div class="k">{esc(k)}</div></div>' for k, v in cards)
    torn_note = " (a torn last line was skipped)" if torn else ""
    return (f"<h1>checkpointless run report</h1>"
            f'<div class="meta">run <code>{esc(run_dir)}</code>, started {esc(started)}; '
            f"{sum(run.counts.values())} events from <code>{esc(events_path)}</code>"
            f"{esc(torn_note)}</div>"
            f'<p>Outcome: <span class="outcome {cls}" id="outcome">{esc(run.outcome)}</span></p>'
            f'<div class="cards" id="summary">{card_html}</div>')


def _failures(run: Run) -> str:
    if not run.failures:
        return "<h2>Failures</h2><p id=\"failures\">No failure in this run.</p>"
    rows = []
    for f in run.failures:
        what = "<br>".join(esc(w) for w in f.what) or "-"
        if f.faults:
            what += "<br><small>injected: " + esc(", ".join(f.faults)) + "</small>"
        outcome = "recovered" + (" from durable storage" if f.via == "durable" else "")
        rows.append([
            esc(f.gens_text), esc(f"+{f.failed_at - run.t0:.2f} s"), what,
            esc(outcome if f.recovered else f.outcome),
            esc(f.target_step if f.target_step is not None else "-"), esc(f.steps_lost),
            esc(secs(f.recovery_s)), "<br>".join(esc(r) for r in f.replacements) or "-",
        ])
    head = ("gen", "at", "failure", "outcome", "rolled back to step", "steps lost",
            "recovery time", "replacement")
    return ("<h2>Failures</h2>" + table(head, rows, numeric=(1, 4, 5, 6), ident="failures")
            + '<p class="note">One row per failure: every detector of one failure agrees '
            "on one new generation, and generations superseded before training resumed (a "
            "failure during the recovery, a spare node taking a lost node over) are folded "
            "into the row of the recovery that ended them. Recovery time runs from the "
            "failure (the injected fault, else its first detection) to the first step "
            "completed after the recovery.</p>")


def _figure(title: str, uri: str | None, caption: str) -> str:
    if not uri:
        return f"<h2>{esc(title)}</h2><p class=\"note\">Nothing to draw.</p>"
    return (f"<h2>{esc(title)}</h2><img src=\"{uri}\" alt=\"{esc(title)}\">"
            f'<p class="note">{esc(caption)}</p>')


def _phases(run: Run, uri: str | None) -> str:
    if not run.recoveries:
        return "<h2>Recovery phases</h2><p class=\"note\">No recovery in this run.</p>"
    head = ("gen", *(PHASE_LABELS[p] for p in PHASES), "total", "critical rank",
            "newcomers", "bytes to newcomers")
    rows = [[esc(f.gens_text), *(esc(secs(f.phases.get(p))) for p in PHASES),
             esc(secs(f.recovery_s)), esc(f.critical_rank), esc(f.newcomers or "-"),
             esc(size(f.bytes_transferred))] for f in run.recoveries]
    img = f'<img src="{uri}" alt="recovery phases">' if uri else ""
    return ("<h2>Recovery phases</h2>" + img
            + table(head, rows, numeric=(*range(1, len(PHASES) + 2), len(head) - 1),
                    ident="phases")
            + '<p class="note">Phases of the rank that finished recovering last: detect '
            "(failure to that rank noticing it), abort (leaving the failed generation), "
            "rendezvous (joining the next one and rebuilding process groups), transfer "
            "(state to newcomers, rollback elsewhere), then the first step after it.</p>")


def _checkpoints(ckpts: Checkpoints) -> str:
    title = "<h2>Durable checkpoints</h2>"
    where = (f'<p class="meta">history under <code>{esc(ckpts.url)}</code></p>'
             if ckpts.url else "")
    note = f'<p class="note">{esc(ckpts.note)}</p>' if ckpts.note else ""
    if not ckpts.rows:
        return title + where + (note or '<p class="note">No durable saves recorded.</p>')
    rows = [[esc(r.step), esc(size(r.nbytes) if r.nbytes else "-"),
             esc(secs(r.duration_s) if r.duration_s else "-"),
             esc(size(r.throughput_MBps * 1e6) + "/s" if r.throughput_MBps else "-"),
             f'<span class="outcome {"ok" if r.ok else "warn"}">{esc(r.status)}</span>',
             esc(r.stored), esc(r.detail[:120])] for r in ckpts.rows]
    head = ("step", "bytes", "duration", "throughput", "status", "in storage now", "detail")
    return (title + where + table(head, rows, numeric=(0, 1, 2, 3), ident="checkpoints") + note
            + '<p class="note">One row per step: bytes of every rank that saved it, the '
            "slowest rank's duration, so the throughput is the job's. Status is from "
            "checkpoint_history.csv; \"in storage now\" checks the step's manifest.</p>")


def _replication(run: Run) -> str:
    stalls = [s for _, _, s in run.steps if s is not None]
    rounds = [r for _, r in run.replications]
    rows = [["snapshots (rank 0)", esc(len(stalls)),
             esc(f"mean stall {1000 * sum(stalls) / len(stalls):.1f} ms, max "
                 f"{1000 * max(stalls):.1f} ms" if stalls else "-")]]
    if rounds:
        sent = sum(int(r.get("bytes_sent") or 0) for r in rounds)
        mean_t = sum(float(r.get("transfer_s") or 0) + float(r.get("commit_s") or 0)
                     for r in rounds) / len(rounds)
        rows.append(["replication rounds committed (rank 0)", esc(len(rounds)),
                     esc(f"{size(sent)} sent in all; mean transfer + commit "
                         f"{1000 * mean_t:.1f} ms")])
    return "<h2>Snapshots and replication</h2>" + table(("what", "count", "detail"), rows,
                                                         numeric=(1,))


def _event_counts(run: Run) -> str:
    rows = [[esc(name), esc(n)] for name, n in run.counts.items()]
    return ("<details><summary>Event counts</summary>"
            + table(("event", "count"), rows, numeric=(1,)) + "</details>")
