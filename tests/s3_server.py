"""A real S3 endpoint for tests and benchmarks: moto's server on 127.0.0.1, over HTTP.

``moto_s3()`` starts ``moto.server.ThreadedMotoServer`` on a free port in this process
(or, with ``subprocess=True``, ``python -m moto.server`` in its own process, so the
server does not share this process's GIL: fairer for throughput figures), sets dummy
AWS credentials in the environment, creates a bucket and yields an :class:`S3Server`
whose ``storage_options`` point s3fs at it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess as sp
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    _stop: Any = field(default=None, repr=False)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
        }

    def url(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"moto server did not listen on port {port}")


@contextlib.contextmanager
def moto_s3(*, subprocess: bool = False, bucket: str | None = None) -> Iterator[S3Server]:
    """Start a moto S3 server on 127.0.0.1, create a bucket, stop it afterwards."""
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(_ENV)
    proc = server = None
    try:
        if subprocess:
            port = _free_port()
            proc = sp.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=sp.DEVNULL, stderr=sp.DEVNULL, env=dict(os.environ),
            )
            _wait_listening(port)
        else:
            import logging

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            _host, port = server.get_host_and_port()
        s3 = S3Server(f"http://127.0.0.1:{port}", bucket or f"ckpt-{uuid.uuid4().hex[:8]}")
        s3.filesystem().call_s3("create_bucket", Bucket=s3.bucket)
        yield s3
    finally:
        if server is not None:
            server.stop()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except sp.TimeoutExpired:
                proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
