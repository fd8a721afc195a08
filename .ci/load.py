"""A steady competing load for the suite: one CPU-bound process per core, at normal
priority, plus a disk writer, until the command it wraps ends.

    python .ci/load.py [--cpus N] [--disk-mb-s M] [--dir D] -- COMMAND...

``make test-load`` (and ``bash .ci/run --load``) run the whole suite under it. A user's
cluster node is rarely idle: the suite must stay green when every core is contended and
the disk is busy, and a bound that only holds on an idle host belongs in
``benchmarks/``, not in ``tests/`` (docs/testing.md, "Under load").

The burners spin in pure Python (one core each, never sleeping); the writer writes
``--chunk-mb`` blocks with ``fsync`` into ``--dir``, at most ``--disk-mb-s`` a second,
and removes them, so the page cache and the journal stay busy without filling the disk.
Every load process dies with this one (``PR_SET_PDEATHSIG``), so an interrupted run
leaves nothing behind. The exit status is the command's. A line at the end says how much
CPU the load took, so a log shows that it really ran.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent goes (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _burn() -> None:
    _die_with_parent()
    x = 0
    while True:
        x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def _write(directory: str, mb_per_s: float, chunk_mb: int) -> None:
    _die_with_parent()
    block = os.urandom(1 << 20)
    path = os.path.join(directory, f"load-{os.getpid()}.bin")
    while True:
        t0 = time.monotonic()
        with open(path, "wb") as f:
            for _ in range(chunk_mb):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(path)
        pause = chunk_mb / mb_per_s - (time.monotonic() - t0)
        if pause > 0:
            time.sleep(pause)


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
    return total


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("load: usage: load.py [options] -- COMMAND...", file=sys.stderr)
        return 2
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                    help="CPU-bound processes (default: one per core)")
    ap.add_argument("--disk-mb-s", type=float, default=50.0,
                    help="the disk writer's rate, MB/s (default 50)")
    ap.add_argument("--chunk-mb", type=int, default=64, help="MB per fsync'd file (64)")
    ap.add_argument("--dir", default=None, help="where the writer writes (default: a "
                    "temporary folder on the same disk as the repository)")
    ns = ap.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        print("load: no command given after --", file=sys.stderr)
        return 2
    directory = ns.dir or tempfile.mkdtemp(prefix="load-", dir=os.getcwd())
    load: list[int] = []
    for _ in range(max(0, ns.cpus)):
        pid = os.fork()
        if pid == 0:
            _burn()
        load.append(pid)
    if ns.disk_mb_s > 0:
        pid = os.fork()
        if pid == 0:
            _write(directory, ns.disk_mb_s, ns.chunk_mb)
        load.append(pid)
    print(f"load: {ns.cpus} CPU burner(s) and a disk writer at {ns.disk_mb_s:g} MB/s in "
          f"{directory} (pids {' '.join(map(str, load))})", flush=True)
    t0 = time.monotonic()
    try:
        code = subprocess.call(command)
    except KeyboardInterrupt:
        code = 130
    finally:
        used = _cpu_s(load)
        for pid in load:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except OSError:
                pass
        for name in os.listdir(directory):
            os.unlink(os.path.join(directory, name))
        if ns.dir is None:
            os.rmdir(directory)
    wall = time.monotonic() - t0
    print(f"load: ran {wall / 60:.1f} min beside the command; the load used {used / 60:.1f} "
          f"CPU-minutes ({used / max(wall, 1e-9):.2f} cores on average)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
