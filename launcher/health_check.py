"""Is this node fit to train: ``recovery.health_check`` and, on CUDA hosts, each device.

Run by each agent when it starts, before it registers, and by a spare node again just
before it takes over a lost node's ranks (a node idle for hours may have gone bad
meanwhile). A failure fences the node with one line holding the command's output:

- a training node at start: the job cannot start on it, so the job stops there, with
  that line on every node (replace the node, or start it as a spare node elsewhere);
- a spare node, at start or before a takeover: it leaves the job (exit 4) without
  taking anything, and the next spare node takes the ranks, or the job shrinks.

The built-in CUDA check runs in a child process, so the agent itself never initialises
CUDA (its workers are forked from a zygote, and a CUDA context does not survive a fork).
"""

from __future__ import annotations

import os
import subprocess
import sys

from replication import contract
from replication.errors import CheckpointlessError

#: A check that runs longer than this fails (the node is not fit if it cannot answer).
TIMEOUT_S = 120.0
#: Characters of a failing check's output kept in its one line.
OUTPUT_CHARS = 300

#: Each visible device allocates, computes and copies back a known sum.
_CUDA_PROBE = """
import sys, torch
bad = []
for d in range(torch.cuda.device_count()):
    try:
        x = torch.arange(1 << 20, device=f"cuda:{d}", dtype=torch.float64)
        got = float((x * 2).sum().item())
        torch.cuda.synchronize(d)
        if got != float((1 << 20) * ((1 << 20) - 1)):
            bad.append(f"cuda:{d} computed {got}")
    except Exception as exc:
        bad.append(f"cuda:{d}: {type(exc).__name__}: {exc}")
if bad:
    print("; ".join(bad))
    sys.exit(1)
"""


class Unhealthy(CheckpointlessError, RuntimeError):
    """This node failed its health check and leaves the job (exit :data:`EXIT_FENCED`)."""

    exit_code = contract.EXIT_FENCED


def one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= OUTPUT_CHARS else flat[: OUTPUT_CHARS - 3] + "..."


def has_cuda_devices() -> bool:
    """An NVIDIA driver is there (without initialising CUDA in this process)."""
    return os.path.exists("/dev/nvidiactl")


def _run(argv: list[str], what: str) -> str | None:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"{what} did not finish in {TIMEOUT_S:g}s"
    except OSError as exc:
        return f"{what} could not run: {exc}"
    if done.returncode == 0:
        return None
    output = one_line(done.stdout + " " + done.stderr) or "no output"
    return f"{what} exited with {done.returncode}: {output}"


def problem(command: str, cuda: bool | None = None) -> str | None:
    """Why this node is not fit, in one line, or None. ``cuda``: run the device check
    (default: when an NVIDIA driver is present)."""
    if command and (why := _run(["/bin/sh", "-c", command], f"health check {command!r}")):
        return why
    if has_cuda_devices() if cuda is None else cuda:
        return _run([sys.executable, "-c", _CUDA_PROBE], "the CUDA device check")
    return None
