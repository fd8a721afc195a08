"""The start-up check of the durable tier: write, read back and delete a probe object.

A read-only directory or an S3 endpoint that is down used to show only once training
ran: one error per save and an exit status of 0 with no checkpoint at all, or 77 s of
botocore tracebacks before the first step. Each agent runs this once, before its
workers start, so a bad ``persistence.path`` is one line at once. The check runs on a
helper thread with a deadline: an endpoint that never answers (botocore retries a
refused connection for a long time) is reported after ``timeout_s``, and a signal stops
the wait at once.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from replication.durable.storage import display_url, is_posix, resolve

#: Seconds a probe may take before the storage is reported as not answering.
PROBE_TIMEOUT_S = 20.0


def probe_storage(
    url: str, storage_options: dict | None = None, *, timeout_s: float = PROBE_TIMEOUT_S,
    should_stop: Callable[[], bool] = lambda: False,
) -> str | None:
    """``None`` if ``url`` takes a write, a read and a delete; else one line saying what
    failed (naming ``persistence.path``), for the job's fatal reason."""
    state = {"step": "opening the filesystem"}
    box: dict[str, BaseException | bool] = {}

    def run() -> None:
        try:
            fs, root = resolve(url, storage_options)
            if is_posix(fs):  # an object store has no directories (and s3fs's makedirs
                state["step"] = "creating the directory"  # would create a bucket)
                fs.makedirs(root, exist_ok=True)
            name = f"{root}/.checkpointless-probe-{socket.gethostname()}-{os.getpid()}-" \
                   f"{uuid.uuid4().hex[:8]}"
            data = b"checkpointless storage probe " + uuid.uuid4().bytes
            state["step"] = "writing a probe object"
            fs.pipe_file(name, data)
            state["step"] = "reading it back"
            if fs.cat_file(name) != data:
                raise OSError("the probe object read back differs from what was written")
            state["step"] = "deleting it"
            fs.rm(name)
            state["where"] = display_url(fs, root)
            box["ok"] = True
        except BaseException as exc:  # reported as one line, never raised into the agent
            box["error"] = exc

    helper = threading.Thread(target=run, name="checkpointless-storage-probe", daemon=True)
    helper.start()
    deadline = time.monotonic() + timeout_s
    while helper.is_alive():
        if should_stop():
            return None  # the agent is stopping anyway; its signal says why
        if time.monotonic() > deadline:
            return (f"persistence.path {url!r} did not answer within {timeout_s:.0f}s while "
                    f"{state['step']} (is the storage endpoint up and reachable?)")
        helper.join(0.1)
    error = box.get("error")
    if isinstance(error, BaseException):
        return (f"persistence.path {url!r} failed its start-up check while {state['step']}: "
                f"{_brief(error)}")
    return None


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}"
