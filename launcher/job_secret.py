"""The job secret: where ``checkpointless run`` takes it from, and the key derived from it.

Every agent of a job needs the same secret; the records the job trusts are sealed with
a key derived from it (``replication.side_channel.signing``). Sources, in order:

- ``CHECKPOINTLESS_JOB_SECRET`` in the agent's environment, or ``--job-secret-file
  FILE`` (one of the two; the file must not be readable by other users);
- none, with every agent on this machine (a loopback rendezvous endpoint, the way tests,
  demos and benchmarks run several "nodes" on one host): node 0 generates one and leaves
  it in the run directory, readable by this user only, for the other local agents
  (removed when node 0 ends; not written with ``--standalone``, which nobody can join);
- none, single node (``--nnodes 1``, node rank 0): node 0 generates one in memory.

A multi-node job with none is refused at start: handing a generated secret out through
the unauthenticated store would hand it to anyone who can read the store
(``docs/adr/0008-job-secret.md``).

The secret itself never leaves the agent: workers get the derived *job key* in an
internal variable, and neither is written to events, logs or ``config show``.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable, Mapping

from replication.contract import ENV_JOB_SECRET
from replication.errors import CheckpointlessError
from replication.side_channel.signing import Signer, derive_job_key

#: In the run directory of a job whose agents all run on one machine.
SHARED_FILE = ".job-secret"
MIN_LENGTH = 16
HOW_TO_MAKE_ONE = ("python -c 'import secrets; print(secrets.token_hex(32))' > job.secret; "
                   "chmod 600 job.secret")


class SecretError(CheckpointlessError, ValueError):
    """The job secret is missing, unreadable or unsafe."""


def _check_text(text: str, where: str) -> bytes:
    text = text.strip()
    if len(text) < MIN_LENGTH:
        raise SecretError(f"the job secret in {where} is too short ({len(text)} characters; "
                          f"use at least {MIN_LENGTH}, e.g. {HOW_TO_MAKE_ONE})")
    return text.encode()


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``, refusing a file other users may read or a non-file."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SecretError(f"--job-secret-file {path!r}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"--job-secret-file {path!r} is not a regular file")
    if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise SecretError(f"--job-secret-file {path!r} can be read or written by other users "
                          f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecretError(f"--job-secret-file {path!r}: cannot read it ({exc})") from None
    return _check_text(text, f"--job-secret-file {path!r}")


def from_sources(environ: Mapping[str, str], secret_file: str | None) -> bytes | None:
    """The secret the user gave (environment or file), or None if none."""
    text = environ.get(ENV_JOB_SECRET)
    if text is not None and secret_file:
        raise SecretError(f"both {ENV_JOB_SECRET} and --job-secret-file are set; give the job "
                          "secret once")
    if secret_file:
        return read_secret_file(secret_file)
    if text is not None:
        return _check_text(text, ENV_JOB_SECRET)
    return None


def missing_secret_message(nnodes: int, node_rank: int, host: str) -> str:
    return (f"a multi-node job needs a job secret shared by every node (--nnodes {nnodes}, "
            f"--node-rank {node_rank}, rendezvous host {host!r} is not a loopback address "
            "such as 127.0.0.1): "
            f"set {ENV_JOB_SECRET} or pass --job-secret-file FILE on every node, e.g. "
            f"{HOW_TO_MAKE_ONE}")


def generate() -> bytes:
    return secrets.token_hex(32).encode()


def share_locally(run_dir: str, secret: bytes) -> str:
    """Leave ``secret`` for the other agents of this machine (mode 0600, atomic)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, SHARED_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, secret)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_shared(run_dir: str, timeout_s: float = 10.0,
                should_stop: Callable[[], bool] = lambda: False) -> bytes:
    """The secret node 0 left in ``run_dir`` (called once its store is reachable)."""
    path = os.path.join(run_dir, SHARED_FILE)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if should_stop() or time.monotonic() > deadline:
            raise SecretError(
                f"no job secret: none was given ({ENV_JOB_SECRET} or --job-secret-file) and node 0 "
                f"left none in {path} (the agents of a job on one machine share a generated "
                "one through a common --run-dir)")
        time.sleep(0.1)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SecretError(f"{path} is not this user's private file (owner uid {st.st_uid}, "
                          f"mode {stat.S_IMODE(st.st_mode):o}); refusing to use it")
    with open(path, encoding="utf-8") as f:
        return _check_text(f.read(), path)


def forget_shared(run_dir: str) -> None:
    """Remove the shared secret file at the end of the job (best effort)."""
    try:
        os.unlink(os.path.join(run_dir, SHARED_FILE))
    except OSError:
        pass


def signer_for(secret: bytes, job_id: str) -> Signer:
    return Signer(derive_job_key(secret, job_id))
