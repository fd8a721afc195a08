"""Apply assignments, in order, onto the defaults; collect every problem on the way.

Later assignments win, so callers express precedence by ordering. Sub-keys of
mapping fields merge (``persistence.storage_options.anon=true`` on the command line
keeps the recipe's ``endpoint_url``), while setting the whole mapping replaces it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from recovery.recipe.coerce import InvalidValue, coerce, is_plain, parse_text, to_plain
from recovery.recipe.errors import Problem, short_repr, suggest
from recovery.recipe.fields import FieldSpec, all_fields, fields_by_path
from recovery.recipe.schema import BLOCK_KEY, SECTIONS, CheckpointlessConfig
from recovery.recipe.sources import Assignment


class Resolution:
    """The outcome of applying assignments: values, where each came from, and problems."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], Any] = {}
        self.sources: dict[tuple[str, ...], str] = {}
        self.bad: set[tuple[str, ...]] = set()
        self.problems: list[Problem] = []

    def source_of(self, spec: FieldSpec) -> str:
        return self.sources.get(spec.path, "default")

    def apply(self, a: Assignment) -> None:
        if not a.path or (len(a.path) == 1 and a.path[0] in SECTIONS):
            self._apply_container(a)
            return
        if a.path[0] in SECTIONS:
            spec, rest = fields_by_path().get(a.path[:2]), a.path[2:]
        else:
            spec, rest = fields_by_path().get(a.path[:1]), a.path[1:]
        if spec is None:
            self._unknown(a)
        elif rest:
            self._apply_sub_key(spec, rest, a)
        else:
            self._apply_field(spec, a)

    def build(self) -> CheckpointlessConfig:
        cfg = CheckpointlessConfig()
        for path, value in self.values.items():
            target = cfg if len(path) == 1 else getattr(cfg, path[0])
            setattr(target, path[-1], value)
        return cfg

    def _apply_container(self, a: Assignment) -> None:
        value = parse_text(a.value) if a.from_text else a.value
        key = _key(a.path)
        if value is None:
            return  # an empty section (``recovery:`` with everything commented out)
        if not isinstance(value, Mapping):
            what = "the whole block" if not a.path else f"the {a.path[0]} section"
            self.problems.append(
                Problem(key, f"got {short_repr(value)}; expected a mapping ({what})", a.source)
            )
            return
        for sub, sub_value in value.items():
            if not isinstance(sub, str):
                self._unknown(Assignment((*a.path, repr(sub)), sub_value, a.source))
                continue
            self.apply(Assignment((*a.path, sub), sub_value, a.source))

    def _apply_field(self, spec: FieldSpec, a: Assignment) -> None:
        try:
            value = coerce(spec, a.value, from_text=a.from_text)
        except InvalidValue as exc:
            self.problems.append(Problem(spec.key, str(exc), a.source))
            self.bad.add(spec.path)
            return
        self.values[spec.path] = value
        self.sources[spec.path] = a.source
        self.bad.discard(spec.path)

    def _apply_sub_key(self, spec: FieldSpec, rest: tuple[str, ...], a: Assignment) -> None:
        key = _key(a.path)
        if spec.kind != "dict":
            msg = f"{spec.key} is {spec.describe()}, not a mapping; it has no sub-keys"
            self.problems.append(Problem(key, msg, a.source))
            return
        value = parse_text(a.value) if a.from_text else a.value
        if not is_plain(value):
            self.problems.append(
                Problem(key, f"got {short_repr(value)}; expected plain YAML data", a.source)
            )
            return
        current = self.values.get(spec.path)
        tree = copy.deepcopy(spec.default if current is None else current)
        node = tree
        for part in rest[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[rest[-1]] = to_plain(value)
        self.values[spec.path] = tree
        self.sources[spec.path] = a.source

    def _unknown(self, a: Assignment) -> None:
        key = _key(a.path)
        hint = suggest(
            ".".join(a.path),
            [".".join(spec.path) for spec in all_fields()],
            leaf_of=lambda k: k.rsplit(".", 1)[-1],
            display=lambda k: f"{BLOCK_KEY}.{k}",
        )
        if not hint:
            hint = "; " + _known_here(a.path)
        self.problems.append(Problem(key, f"unknown key{hint}", a.source))


def resolve(assignments: Iterable[Assignment]) -> Resolution:
    """Apply ``assignments`` in order (later wins) onto the defaults."""
    resolution = Resolution()
    for a in assignments:
        resolution.apply(a)
    return resolution


def _key(path: tuple[str, ...]) -> str:
    return ".".join((BLOCK_KEY, *path))


def _known_here(path: tuple[str, ...]) -> str:
    """List the valid names at the level where an unknown key was found."""
    if len(path) > 1 and path[0] in SECTIONS:
        names = [spec.name for spec in all_fields() if spec.section == path[0]]
        return f"the {path[0]} section has: " + ", ".join(names)
    names = [spec.name for spec in all_fields() if spec.section is None] + list(SECTIONS)
    return "valid top-level keys: " + ", ".join(names)
