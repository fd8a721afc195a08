"""Turn each configuration source into a list of assignments, in precedence order.

An :class:`Assignment` is "set this path to this value, said by this source". Every
layer (recipe, env, command line) is reduced to assignments and applied in order, so
precedence is simply list order and every value keeps the name of where it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from recovery.recipe.errors import Problem, short_repr, suggest
from recovery.recipe.fields import fields_by_env
from recovery.recipe.recipe import RecipeBlock
from recovery.recipe.schema import BLOCK_KEY
from replication import contract

ENV_PREFIX = "CHECKPOINTLESS_"

#: Variables the runtime sets for its own processes; the config loader never reads them.
#: (:data:`~replication.contract.ENV_JOB_SECRET` is the job secret: never config, never
#: echoed; :data:`~replication.contract.ENV_CONFIG` is the resolved recipe itself;
#: :data:`~replication.contract.ENV_STATUS_FILE` is where an agent writes its status.)
RESERVED_ENV = frozenset(
    {"CHECKPOINTLESS_RECIPE", "CHECKPOINTLESS_OVERRIDES", contract.ENV_CONFIG,
     contract.ENV_JOB_SECRET, contract.ENV_STATUS_FILE}
)
#: Any variable with this prefix is also the runtime's own (rank hand-off, generations...).
RESERVED_ENV_PREFIX = "CHECKPOINTLESS_INTERNAL_"


@dataclass(frozen=True)
class Assignment:
    """Set ``path`` (relative to the block; ``()`` is the block itself) to ``value``."""

    path: tuple[str, ...]
    value: Any
    source: str
    from_text: bool = False  # the value is raw text (env, command line), not YAML data


def recipe_assignments(block: RecipeBlock) -> list[Assignment]:
    return [Assignment((), block.data, block.source)]


def is_reserved_env(name: str) -> bool:
    return name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX)


def env_assignments(env: Mapping[str, str]) -> tuple[list[Assignment], list[Problem]]:
    """Assignments from ``CHECKPOINTLESS_<SECTION>_<KEY>`` variables.

    An unknown ``CHECKPOINTLESS_*`` variable is an error rather than ignored: a typo in
    a job script would otherwise silently run with the default. Sub-keys of a mapping
    field may be set one by one (``CHECKPOINTLESS_PERSISTENCE_STORAGE_OPTIONS_ANON``,
    the sub-key lower-cased) as well as whole (a YAML/JSON mapping).
    """
    table = fields_by_env()
    dict_prefixes = {name + "_": spec for name, spec in table.items() if spec.kind == "dict"}
    assignments, problems = [], []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or is_reserved_env(name):
            continue
        source = f"env {name}"
        spec = table.get(name)
        if spec is not None:
            assignments.append(Assignment(spec.path, env[name], source, from_text=True))
            continue
        for prefix, dict_spec in dict_prefixes.items():
            sub = name[len(prefix) :]
            if name.startswith(prefix) and sub:
                path = (*dict_spec.path, sub.lower())
                assignments.append(Assignment(path, env[name], source, from_text=True))
                break
        else:
            hint = suggest(
                name.removeprefix(ENV_PREFIX),
                [known.removeprefix(ENV_PREFIX) for known in table],
                display=lambda n: ENV_PREFIX + n,
            )
            problems.append(Problem(name, f"unknown configuration variable{hint}", "environment"))
    return assignments, problems


def override_assignments(overrides: Sequence[str]) -> tuple[list[Assignment], list[Problem]]:
    """Assignments from ``key=value`` arguments (``checkpointless.`` prefix optional)."""
    assignments, problems = [], []
    for arg in overrides:
        source = f"command line {short_repr(arg)}"
        key, sep, text = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            why = "expected key=value" if not sep else "empty key"
            problems.append(Problem(short_repr(arg), f"not an override ({why})", "command line"))
            continue
        path = tuple(key.split("."))
        if path[0] == BLOCK_KEY:
            path = path[1:]
        if any(not part for part in path):
            problems.append(Problem(key, "malformed key (empty component)", source))
            continue
        assignments.append(Assignment(path, text, source, from_text=True))
    return assignments, problems
