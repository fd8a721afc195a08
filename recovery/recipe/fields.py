"""A flat table of every settable key, derived from the section dataclasses.

The validator, the env-var mapping, the suggestions and ``config show --help`` all
read this one table, so adding a field to a section dataclass is enough to make it
settable everywhere, with its bounds and choices enforced.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any

from recovery.recipe.schema import BLOCK_KEY, SECTIONS, CheckpointlessConfig

_KINDS = {int: "int", float: "float", bool: "bool", str: "str", dict: "dict"}


@dataclass(frozen=True)
class FieldSpec:
    """One settable key: where it lives, its type and the constraints from its metadata."""

    section: str | None  # None for a top-level field such as ``run_dir``
    name: str
    kind: str  # one of "int", "float", "bool", "str", "dict"
    default: Any
    nullable: bool = False
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None
    help: str = ""
    words: tuple[str, ...] | None = None  # words a numeric field also takes ("auto")

    @property
    def path(self) -> tuple[str, ...]:
        return (self.name,) if self.section is None else (self.section, self.name)

    @property
    def key(self) -> str:
        """The full dotted key users see in messages, e.g. ``checkpointless.replication.factor``."""
        return ".".join((BLOCK_KEY, *self.path))

    @property
    def env_var(self) -> str:
        return "CHECKPOINTLESS_" + "_".join(self.path).upper()

    def describe(self) -> str:
        """What is allowed, in words, for error messages and help."""
        text = {
            "int": "an integer",
            "float": "a number",
            "bool": "a boolean (true/false/yes/no/1/0)",
            "str": "a string",
            "dict": "a mapping",
        }[self.kind]
        if self.choices is not None:
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        if self.min is not None and self.max is not None:
            text += f" in [{self.min}, {self.max}]"
        elif self.min is not None:
            text += f" >= {self.min}"
        elif self.max is not None:
            text += f" <= {self.max}"
        if self.words:
            text += ", or " + " or ".join(repr(w) for w in self.words)
        if self.nullable:
            text += ", or null"
        return text


def _kind_of(annotation: Any) -> tuple[str, bool]:
    """Map a resolved type hint to (kind, nullable); ``X | None`` makes it nullable."""
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported config field type {annotation!r}")
        annotation = args[0]
        origin = typing.get_origin(annotation)
    base = origin or annotation
    if base not in _KINDS:
        raise TypeError(f"unsupported config field type {annotation!r}")
    return _KINDS[base], nullable


def _specs_of(cls: type, section: str | None) -> list[FieldSpec]:
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        if section is None and f.name in SECTIONS:
            continue
        kind, nullable = _kind_of(hints[f.name])
        meta = f.metadata
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        specs.append(
            FieldSpec(
                section=section,
                name=f.name,
                kind=kind,
                default=default,
                nullable=bool(meta.get("nullable", nullable)),
                choices=tuple(meta["choices"]) if "choices" in meta else None,
                min=meta.get("min"),
                max=meta.get("max"),
                help=meta.get("help", ""),
                words=tuple(meta["words"]) if "words" in meta else None,
            )
        )
    return specs


@cache
def all_fields() -> tuple[FieldSpec, ...]:
    """Every settable field, top-level ones first, then each section in block order."""
    specs = _specs_of(CheckpointlessConfig, None)
    for name, cls in SECTIONS.items():
        specs.extend(_specs_of(cls, name))
    return tuple(specs)


@cache
def fields_by_path() -> dict[tuple[str, ...], FieldSpec]:
    return {spec.path: spec for spec in all_fields()}


@cache
def fields_by_env() -> dict[str, FieldSpec]:
    table: dict[str, FieldSpec] = {}
    for spec in all_fields():
        # Underscores join both the path and the words in a name, so two different
        # paths could in principle spell the same variable; refuse that at import time
        # rather than let one silently shadow the other.
        if spec.env_var in table:
            raise RuntimeError(
                f"{spec.env_var} names both {table[spec.env_var].key} and {spec.key}"
            )
        table[spec.env_var] = spec
    return table
