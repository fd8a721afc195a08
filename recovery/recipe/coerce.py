"""Turn one user-supplied value into the typed value of one field, or say why not.

Values arrive as YAML data (recipe files), or as text (env vars, ``key=value``
overrides, string interpolations such as ``${oc.env:X}``). Text is parsed the way YAML
would (``true``, ``1e3``, ``[1, 2]``), except for string fields, which keep the text
as typed so a path or a fault spec is never reinterpreted (``0:5`` is not sexagesimal,
``a #b`` keeps its ``#b``); fully quoted text is unquoted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import yaml

from recovery.recipe.errors import short_repr
from recovery.recipe.fields import FieldSpec
from replication.errors import CheckpointlessError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_MAX_DEPTH = 32


class InvalidValue(CheckpointlessError, ValueError):
    """The value does not fit the field; the message says what was expected."""


class _TextLoader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e3`` as a float (YAML 1.2), like OmegaConf does."""


_TextLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def is_plain(value: Any, _depth: int = 0, _seen: set[int] | None = None) -> bool:
    """True for acyclic, shallow trees of dict/list/str/int/float/bool/None.

    Anything else (dates, bytes, recursive aliases, arbitrary objects) cannot be
    written to YAML or JSON for the workers, so it is refused at the door.
    """
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if _depth > _MAX_DEPTH or not isinstance(value, dict | list):
        return False
    seen = _seen if _seen is not None else set()
    if id(value) in seen:
        return False
    seen.add(id(value))
    try:
        if isinstance(value, dict):
            return all(
                (k is None or isinstance(k, str | int | float | bool))
                and is_plain(v, _depth + 1, seen)
                for k, v in value.items()
            )
        return all(is_plain(v, _depth + 1, seen) for v in value)
    finally:
        seen.discard(id(value))


def parse_text(text: str) -> Any:
    """Parse text as a YAML value; text that is not plain YAML data stays text."""
    try:
        value = yaml.load(text, Loader=_TextLoader)  # a SafeLoader subclass
    except (yaml.YAMLError, RecursionError, ValueError, OverflowError):
        return text
    return value if is_plain(value) else text


def _describe_type(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), type(value).__name__
    )


def coerce(spec: FieldSpec, value: Any, *, from_text: bool = False) -> Any:
    """Return ``value`` converted to ``spec``'s type, or raise :class:`InvalidValue`."""
    expected = spec.describe()

    def fail(detail: str = "") -> InvalidValue:
        shown = short_repr(value)
        got = f"got {_describe_type(value)} {shown}" if detail == "type" else f"got {shown}"
        extra = f" ({detail})" if detail and detail != "type" else ""
        return InvalidValue(f"{got}{extra}; expected {expected}")

    if spec.words and isinstance(value, str):
        word = value.strip().strip("'\"").strip().lower()
        if word in spec.words:
            return word  # a numeric field's word, such as every_n_steps: auto
    if spec.kind == "str":
        result = _to_str(spec, value, from_text, fail)
        if isinstance(result, str) and not _is_text(result):
            raise fail("not valid Unicode text: it holds a lone surrogate such as \\ud800")
    elif value is None:
        if spec.kind == "dict":
            return {}  # an empty YAML section (``storage_options:``) means "no options"
        if spec.nullable:
            return None
        raise fail()
    elif spec.kind == "bool":
        result = _to_bool(value, fail)
    elif spec.kind == "dict":
        result = _to_dict(value, fail)
        if not _all_text(result):
            raise fail("not valid Unicode text: it holds a lone surrogate such as \\ud800")
    else:
        result = _to_number(spec.kind, value, fail)
    if result is None:
        return None
    if spec.choices is not None and result not in spec.choices:
        raise fail()
    if (spec.min is not None and result < spec.min) or (spec.max is not None and result > spec.max):
        raise fail()
    return result


def _is_text(value: str) -> bool:
    """Encodable as UTF-8: no lone surrogates (YAML and JSON escapes can make them),
    which no path, URL or name can hold and which would not survive a JSON round trip."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _all_text(value: Any) -> bool:
    """:func:`_is_text` for every string in a nested dict or list."""
    if isinstance(value, str):
        return _is_text(value)
    if isinstance(value, dict):
        return all(_all_text(k) and _all_text(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_all_text(v) for v in value)
    return True


def _to_str(spec: FieldSpec, value: Any, from_text: bool, fail) -> str | None:
    if from_text:
        # Text is kept verbatim (YAML would drop " #..." as a comment and trim spaces);
        # only fully quoted text is unquoted, and only ``null`` means None.
        stripped = value.strip()
        if len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\"":
            parsed = parse_text(stripped)
            if isinstance(parsed, str):
                return parsed
        if spec.nullable and stripped in ("null", "Null", "NULL", "~"):
            return None
        return value
    if value is None and spec.nullable:
        return None
    if not isinstance(value, str):
        hint = "quote it in YAML" if isinstance(value, int | float) else "type"
        raise fail(hint)
    return value


def _to_bool(value: Any, fail) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise fail("type")


def _to_number(kind: str, value: Any, fail) -> int | float:
    if isinstance(value, str):
        parsed = parse_text(value)
        if isinstance(parsed, str) or parsed is None:
            raise fail()
        return _to_number(kind, parsed, lambda detail="": fail(detail))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail("type")
    if isinstance(value, float) and not math.isfinite(value):
        raise fail("not a finite number")
    if kind == "float":
        try:
            return float(value)
        except OverflowError:
            raise fail("not a finite number") from None
    if isinstance(value, float):
        if not value.is_integer():
            raise fail("not a whole number")
        return int(value)
    return value


def _to_dict(value: Any, fail) -> dict[str, Any]:
    if isinstance(value, str):
        value = parse_text(value)
        if value is None:
            return {}
    if not isinstance(value, Mapping):
        raise fail("type")
    value = dict(value)
    if not all(isinstance(k, str) for k in value):
        raise fail("keys must be strings")
    if not is_plain(value):
        raise fail("values must be plain YAML data")
    return to_plain(value)


def to_plain(value: Any) -> Any:
    """A deep copy of plain data, so later merges never alias the caller's objects."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value
