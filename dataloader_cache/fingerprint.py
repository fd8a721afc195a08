"""Stable fingerprints naming *what* a cache entry holds.

Cache keys must be identical in every process that computes them (the replacement
worker must find the dead worker's entries), so nothing here uses ``hash()`` (salted per
process) or ``id()``. A fingerprint changes when the data or the preprocessing plausibly
changes: the dataset's class and module, the bytecode of its ``__getitem__``/``__iter__``,
its length, and its public simple configuration attributes (paths, sizes, flags; names
starting with ``_`` are left out, so per-process bookkeeping such as a log path or a
handle does not split the cache between processes). Anything the heuristic cannot see can
be folded in by the user: give the dataset a ``cache_fingerprint`` attribute (str) or
method, or pass ``fingerprint=`` to the loader, which replaces the heuristic entirely.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import xxhash

_SIMPLE = (str, int, float, bool, type(None))
_MAX_ATTRS = 64
_SKIP = object()


def _simple(value: Any, depth: int = 0) -> Any:
    if isinstance(value, _SIMPLE):
        return value
    if depth < 2 and isinstance(value, (list, tuple)) and len(value) <= 32:
        out = [_simple(v, depth + 1) for v in value]
        return _SKIP if any(o is _SKIP for o in out) else out
    return _SKIP


def _code_digest(fn: Any) -> str:
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    h = xxhash.xxh3_64(code.co_code)
    h.update(repr([c for c in code.co_consts if isinstance(c, _SIMPLE)]).encode())
    return h.hexdigest()


def callable_name(fn: Callable[..., Any] | None) -> str:
    """``module.qualname`` of a callable (collate functions), stable across processes."""
    if fn is None:
        return "none"
    target = getattr(fn, "func", fn)  # functools.partial
    mod = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", type(target).__qualname__)
    return f"{mod}.{name}:{_code_digest(target)}"


def dataset_fingerprint(dataset: Any, extra: str | None = None) -> str:
    """A 16-hex-digit fingerprint of a dataset's identity and preprocessing."""
    cls = type(dataset)
    parts: dict[str, Any] = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "getitem": _code_digest(getattr(cls, "__getitem__", None)),
        "iter": _code_digest(getattr(cls, "__iter__", None)),
    }
    try:
        parts["len"] = len(dataset)
    except TypeError:
        parts["len"] = None
    attrs = {}
    public = [(k, v) for k, v in getattr(dataset, "__dict__", {}).items() if k[:1] != "_"]
    for k, v in sorted(public, key=lambda kv: kv[0])[:_MAX_ATTRS]:
        s = _simple(v)
        if s is not _SKIP:
            attrs[k] = s
    parts["attrs"] = attrs
    user = getattr(dataset, "cache_fingerprint", None)
    if callable(user):
        user = user()
    if user is not None:
        parts["user"] = str(user)
    if extra is not None:
        parts["extra"] = extra
    return xxhash.xxh3_64_hexdigest(json.dumps(parts, sort_keys=True, default=str).encode())


def combine(*items: Any) -> str:
    """Fingerprint of several values (e.g. dataset fingerprint plus sampler settings)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(items, sort_keys=True, default=str).encode())
