"""The script's own imports, made in the zygote before it forks, where a fork survives them.

A warm spare runs the user's script from the top once it is assigned a rank, so whatever
the script imports (``transformers``, NeMo, Megatron: seconds here, 10-60 s from a
cluster's shared filesystem) a replacement pays after the failure, while every survivor
waits. The zygote imports those modules first (:mod:`launcher.script_imports` finds
them), so every worker and spare it forks starts with them.

Not every import survives a fork. One that initialises CUDA or loads its driver leaves
every forked child unable to use the GPU; one that starts threads leaves children
without them; one that opens a process group shares its sockets with every child. So
each candidate is first imported in a *probe*: a child forked from the zygote that
imports the candidates in the script's order and reports, module by module, what the
import did. The zygote then imports only what the probe found harmless; a module that
did harm, failed to import, or hung is left to the worker, with the reason, in the
start-up line. The probe stops at the first module that changed its state, and a new
probe goes on from there, so each verdict is made on the state the zygote will have.

The probe costs the candidates' import time once more at start-up, off every
recovery's path.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

#: How long the probes may take in all, by default; a module still importing then is
#: left to the worker ("did not finish importing").
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Verdict:
    """What importing ``name`` did in the probe: ``ok``, or ``why`` not (and whether the
    probe's state is changed for the modules after it: ``tainted``)."""

    name: str
    ok: bool
    why: str = ""
    tainted: bool = False


@dataclass
class PreloadReport:
    """What the zygote imported of the script's modules, and what it left to workers."""

    loaded: list[str]
    left: dict[str, str]
    seconds: float

    def as_message(self) -> dict[str, Any]:
        return {"preloaded": self.loaded, "left": self.left, "preload_s": round(self.seconds, 3)}


def preload(names: list[str], timeout_s: float = PROBE_TIMEOUT_S) -> PreloadReport:
    """Import each of ``names`` in this process that a probe found safe to fork after.

    Names already imported are skipped. A name marked optional (``?name``: a module a
    package imports lazily, which another version may not have) that does not import
    is dropped without a word. Never raises: whatever goes wrong leaves that module to
    the worker."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    optional = {n[1:] for n in names if n.startswith("?")}
    names = [n.removeprefix("?") for n in names]
    remaining = [n for n in dict.fromkeys(names) if _needed(n)]
    loaded: list[str] = []
    left: dict[str, str] = {}
    while remaining:
        verdicts = _probe(remaining, deadline)
        if not verdicts:  # the probe died (or ran out of time) on the first module
            why = ("did not finish importing within the preload's "
                   f"{timeout_s:.0f} s" if time.monotonic() >= deadline
                   else "the probe importing it died")
            left[remaining.pop(0)] = why
            continue
        for v in verdicts:
            why = v.why if not v.ok else _import_here(v.name)
            if not why:
                loaded.append(v.name)
            elif not (v.name in optional and why.startswith(FAILED)):
                left[v.name] = why
        done = {v.name for v in verdicts}
        remaining = [n for n in remaining if n not in done]
    return PreloadReport(loaded, left, time.monotonic() - t0)


def _import_here(name: str) -> str:
    """Import ``name`` in the zygote itself; the reason it was not, or ''."""
    try:
        with _quiet():
            _load(name)
    except BaseException as exc:  # a module's import may raise anything
        return _raised(exc)
    return ""


def _load(name: str) -> None:
    """Import ``module``, or, for ``module:attr``, also look ``attr`` up (a package's
    lazy names load their modules then); a name the module does not have is not an
    error here: the script's own import will say so."""
    module, _, attr = name.partition(":")
    mod = importlib.import_module(module)
    if attr:
        getattr(mod, attr, None)


def _needed(name: str) -> bool:
    """Whether ``name`` is not loaded yet (a ``module:attr`` whose module is, may still
    be: its attribute may be lazy)."""
    module, _, attr = name.partition(":")
    return bool(attr) or module not in sys.modules


def _probe(names: list[str], deadline: float) -> list[Verdict]:
    """Fork a probe that imports ``names`` in order; its verdicts, up to and including
    the first that changed its state, or fewer if it died or ran out of time."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe
        os.close(r)
        code = 0
        try:
            _run_probe(names, w)
        except BaseException:  # the probe never returns into the zygote
            code = 1
        os._exit(code)
    os.close(w)
    verdicts: list[Verdict] = []
    buf = b""
    try:
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0 or not select.select([r], [], [], left_s)[0]:
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            verdicts += [Verdict(**json.loads(line)) for line in lines if line]
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return verdicts


def _run_probe(names: list[str], fd: int) -> None:
    from launcher.zygote import fork_hazard

    with os.fdopen(fd, "wb", buffering=0) as out:
        for name in names:
            threads = _threads()
            why, tainted = "", False
            try:
                with _quiet():
                    _load(name)
            except BaseException as exc:
                why = _raised(exc)
            if hazard := fork_hazard():
                why, tainted = _cuda_reason(hazard), True
            elif (started := _threads() - threads) > 0:
                why, tainted = f"starts {started} thread(s) at import", True
            elif _process_group_open():
                why, tainted = "opens a process group at import", True
            out.write(json.dumps({"name": name, "ok": not why, "why": why,
                                  "tainted": tainted}).encode() + b"\n")
            if tainted:
                return


def _cuda_reason(hazard: str) -> str:
    return ("initialises CUDA at import" if "initialised" in hazard
            else "loads the CUDA driver at import")


FAILED = "failed to import"


def _raised(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0][:160] if text else ""
    return f"{FAILED} ({type(exc).__name__}{': ' + first if first else ''})"


def _threads() -> int:
    """This process's threads, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _process_group_open() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(dist is not None and dist.is_available() and dist.is_initialized())
    except Exception:
        return False


@contextlib.contextmanager
def _quiet():
    """A module's import prints nothing in the zygote or the probe (as a spare's warm-up)."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def describe(report: dict[str, Any]) -> str:
    """The agent's start-up line for a zygote's preload report (its ready message)."""
    loaded, left = report.get("preloaded") or [], report.get("left") or {}
    parts = []
    if loaded:
        parts.append(f"zygote: imported {len(loaded)} module(s) of the script before forking "
                     f"({report.get('preload_s', 0):.1f} s): {', '.join(loaded)}")
    if left:
        reasons = "; ".join(f"{m} ({why})" for m, why in left.items())
        parts.append(("zygote: " if not loaded else "") + f"left to each worker: {reasons}")
    return "; ".join(parts)
