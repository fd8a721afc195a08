"""A real Prometheus server for the tests (Debian's ``prometheus``), scraping given targets.

Started with a scrape interval of 0.5 s on a free loopback port, its data in the test's
temporary directory; :meth:`Prometheus.query` is its HTTP query API. Without
``/usr/bin/prometheus`` the tests that need it skip, unless ``TESTS_REQUIRE_PROMETHEUS=1``
(CI), which fails them instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.mp import free_port

BINARY = "/usr/bin/prometheus"
SCRAPE_MS = 500  # Prometheus takes no fractional durations


def require() -> str:
    path = shutil.which("prometheus") or (BINARY if os.path.exists(BINARY) else None)
    if path is None:
        missing = "Prometheus is not installed (apt-get install prometheus)"
        if os.environ.get("TESTS_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(f"{missing}, and TESTS_REQUIRE_PROMETHEUS=1", pytrace=False)
        pytest.skip(missing)
    return path


class Prometheus:
    """One server; ``targets`` are ``host:port`` of the agents' metrics."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.binary = require()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_MS}ms\n"
            f"  scrape_timeout: {SCRAPE_MS}ms\n"
            "scrape_configs:\n"
            "  - job_name: checkpointless\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n")
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"prometheus not ready in 30 s:\n{self.log.read_text()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (each ``{"metric": labels, "value": [t, v]}``)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
