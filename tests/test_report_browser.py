"""The run report of a REAL run with a failure, opened in a real headless Chromium.

A 2-worker job runs under ``checkpointless run`` with a warm spare, durable saves every
4 steps and a SIGKILL injected into rank 1 at step 6. ``checkpointless report`` turns
its run directory into a page, which Chromium loads over the DevTools protocol (on a
pipe: ``--remote-debugging-pipe``, so no port and no extra Python package). The test
fails on any console error, uncaught exception, failed load or request leaving the
page; then it reads the rendered DOM and checks that the page shows this run's failure,
recovery and checkpoints, cross-checked against the events file.

Without Chromium the test is skipped, unless ``TESTS_REQUIRE_BROWSER=1``
(CI sets it), where a missing browser is a failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest

from tests.recovery_harness import REPO, assert_recovered, assert_succeeded, clean_env, run_job

pytestmark = pytest.mark.timeout(300)

FAULT = "1:6:forward"
BROWSER_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-pipe",
)


def chromium_binary() -> str:
    """The browser, or skip (fail when TESTS_REQUIRE_BROWSER=1)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    message = "no chromium on PATH (apt-get install -y chromium chromium-driver)"
    if os.environ.get("TESTS_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{message}, and TESTS_REQUIRE_BROWSER=1")
    pytest.skip(message)


class Browser:
    """A minimal DevTools-protocol client over Chromium's pipe (fd 3 in, fd 4 out).

    Messages are JSON objects separated by NUL bytes. Events (messages without an
    ``id``) are all kept in :attr:`events` so the test can inspect them afterwards.
    """

    def __init__(self, binary: str, profile: str) -> None:
        to_child, self._write = os.pipe()
        self._read, from_child = os.pipe()
        # Copies above the range dup2 writes to, so neither target clobbers a source.
        hi_in = fcntl.fcntl(to_child, fcntl.F_DUPFD, 10)
        hi_out = fcntl.fcntl(from_child, fcntl.F_DUPFD, 10)

        def wire() -> None:  # in the child, before exec
            os.dup2(hi_in, 3)
            os.dup2(hi_out, 4)

        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(
            [binary, *BROWSER_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            pass_fds=(3, 4), preexec_fn=wire,
        )
        for fd in (to_child, from_child, hi_in, hi_out):
            os.close(fd)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._write, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._receive(time.monotonic() + timeout_s, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def wait_for(self, method: str, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        seen = len(self.events)
        while True:
            for e in self.events[seen:]:
                if e.get("method") == method:
                    return e
            seen = len(self.events)
            self._receive(deadline, method)

    def drain(self, seconds: float) -> None:
        """Collect whatever events arrive in the next ``seconds``."""
        deadline = time.monotonic() + seconds
        try:
            while True:
                self._receive(deadline, "drain")
        except TimeoutError:
            pass

    def _receive(self, deadline: float, what: str) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._read], [], [], left)[0]:
                raise TimeoutError(f"no DevTools answer while waiting for {what}")
            chunk = os.read(self._read, 1 << 20)
            if not chunk:
                raise RuntimeError(f"chromium closed the pipe:\n{self.output()}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        msg = json.loads(raw)
        if "id" not in msg:
            self.events.append(msg)
        return msg

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._read, self._write):
            os.close(fd)
        self.log.close()


PAGE_PROBE = """JSON.stringify({
  outcome: document.querySelector('#outcome')?.textContent,
  summary: [...document.querySelectorAll('#summary .card')].map(
      c => [c.querySelector('.k').textContent, c.querySelector('.v').textContent]),
  failures: [...document.querySelectorAll('#failures tbody tr')].map(
      r => [...r.cells].map(c => c.innerText)),
  phases: [...document.querySelectorAll('#phases tbody tr')].map(
      r => [...r.cells].map(c => c.innerText)),
  checkpoints: [...document.querySelectorAll('#checkpoints tbody tr')].map(
      r => [...r.cells].map(c => c.innerText)),
  images: [...document.images].map(i => [i.alt, i.complete, i.naturalWidth, i.naturalHeight]),
  text: document.body.innerText,
})"""


def load_page(binary: str, url: str) -> tuple[dict[str, Any], list[str]]:
    """Open ``url``; returns (what PAGE_PROBE read, every problem the browser reported)."""
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(binary, profile)
        try:
            target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.send("Target.attachToTarget",
                                   {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                browser.send(f"{domain}.enable", session=session)
            browser.send("Page.navigate", {"url": url}, session=session)
            browser.wait_for("Page.loadEventFired")
            browser.drain(0.5)  # late console messages and failed loads
            probe = browser.send("Runtime.evaluate", {"expression": PAGE_PROBE,
                                                      "returnByValue": True}, session=session)
        finally:
            browser.close()
    return json.loads(probe["result"]["value"]), problems(browser.events, url)


def problems(events: list[dict[str, Any]], page_url: str) -> list[str]:
    out = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            out.append(f"exception: {p['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
        elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
            out.append(f"log: {p['entry'].get('text')}")
        elif method == "Network.loadingFailed":
            out.append(f"load failed: {p.get('errorText')}")
        elif method == "Network.requestWillBeSent":
            url = p["request"]["url"]
            if url != page_url and not url.startswith("data:"):
                out.append(f"request outside the page: {url}")
    return out


# --- the browser check itself must be able to fail ------------------------------------
def test_browser_check_catches_a_broken_page(tmp_path):
    binary = chromium_binary()
    page = tmp_path / "broken.html"
    page.write_text('<!DOCTYPE html><html><body><p id="x">hi</p>'
                    '<img src="missing.png" alt="m"><script>console.error("bad");'
                    "undefinedFunction();</script></body></html>")
    probe, found = load_page(binary, page.as_uri())
    assert "hi" in probe["text"]
    text = "\n".join(found)
    assert "console.error: ['bad']" in text, found
    assert "exception:" in text, found
    assert "missing.png" in text, found  # a request outside the page, and a failed load


# --- a real run ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report_of_failed_run(tmp_path_factory):
    """A finished 2-rank job that lost rank 1 to SIGKILL and recovered in place, and
    ``checkpointless report`` run on it: (job, the CLI's result, the page's path)."""
    root = tmp_path_factory.mktemp("report-run")
    job = run_job(root / "run", spares=1, timeout_s=150, overrides=[
        f"recovery.fault={FAULT}", f"persistence.path={root / 'ckpt'}",
        "persistence.every_n_steps=4"])
    assert_succeeded(job)
    assert_recovered(job)
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "report", str(job.run_dir)], cwd=REPO,
        env=clean_env(), capture_output=True, text=True, timeout=120)
    return job, done, job.run_dir / "report.html"


def test_report_of_a_real_failure(report_of_failed_run):
    """The CLI's output, and a page that references nothing outside itself."""
    job, done, page = report_of_failed_run
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {page} ("), done.stdout
    assert "1 failure(s), 1 recovery(ies)" in done.stdout
    assert f"read {len(job.events())} events from {job.run_dir / 'events.jsonl'}" in done.stderr
    assert f"checkpoint history rows from {job.run_dir.parent / 'ckpt'}" in done.stderr
    source = page.read_text()
    refs = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', source) + re.findall(r"url\(", source)
    assert refs and all(r.startswith("data:image/png;base64,") for r in refs), refs[:5]
    assert "<script" not in source and "@import" not in source
    assert "rank 1 on node 0 was killed by SIGKILL" in source


def test_report_of_a_real_failure_in_chromium(report_of_failed_run):
    binary = chromium_binary()
    job, done, page = report_of_failed_run
    assert done.returncode == 0, done.stderr
    probe, found = load_page(binary, page.as_uri())
    assert not found, f"the browser reported problems: {found}"

    events = job.events()
    rec = [e for e in events if e["event"] == "recovery"]
    exits = [e for e in events if e["event"] == "worker_exit" and e["exitcode"] != 0]
    assert probe["outcome"] == "completed"
    summary = dict(probe["summary"])
    assert summary["ranks"] == "2" and summary["steps"] == "16"
    assert summary["failures"] == "1" and summary["recoveries"] == "1"
    # the failure row: what happened, the injected fault, where the job went back to
    assert len(probe["failures"]) == 1, probe["failures"]
    gen, _, what, outcome, target, lost, took, replacement = probe["failures"][0]
    assert gen == str(rec[0]["gen"]) == "1"
    assert "rank 1 on node 0 was killed by SIGKILL" in what, what
    assert f"injected: {FAULT}:sigkill" in what, what
    assert [e["rank"] for e in exits] == [1]
    assert outcome == "recovered" and target == str(rec[0]["target_step"])
    assert int(lost) >= 0 and took.endswith(" s") and float(took[:-2]) > 0
    assert "rank 1 -> a warm spare" in replacement, replacement
    # recovery phases of the critical rank, matching its recovery event
    assert len(probe["phases"]) == 1
    critical = max(rec, key=lambda e: e["recovered_at"])
    assert probe["phases"][0][7] == str(critical["rank"])
    assert probe["phases"][0][4] == f"{critical['timings']['transfer_s']:.2f} s"
    # durable checkpoints from checkpoint_history.csv, one row per step
    steps = [int(row[0]) for row in probe["checkpoints"]]
    assert steps and steps == sorted(set(steps)) and all(s % 4 == 0 for s in steps), steps
    # every plot was decoded and drawn
    assert [(alt, ok) for alt, ok, _, _ in probe["images"]] == [
        ("Timeline", True), ("Throughput", True), ("recovery phases", True)]
    assert all(w > 300 and h > 100 for _, _, w, h in probe["images"]), probe["images"]


def test_worker_output_is_prefixed_with_its_rank(report_of_failed_run):
    """``checkpointless run`` stays readable with many ranks: every worker line on the
    agent's console names its rank."""
    job, _, _ = report_of_failed_run
    agent = job.agents[0]
    lines = [ln for ln in (agent.stdout + agent.stderr).splitlines() if ln.strip()]
    pattern = re.compile(r"^\[(rank\d+|spare|checkpointless node \d+)\]")
    assert lines and all(pattern.match(ln) for ln in lines), [
        ln for ln in lines if not pattern.match(ln)][:5]
    assert any(ln.startswith("[rank0]: [rank 0] step   10 loss") for ln in lines), lines
