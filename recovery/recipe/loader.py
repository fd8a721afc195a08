"""``load_config``: defaults < recipe file < ``CHECKPOINTLESS_*`` env < ``key=value``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from recovery.recipe.build import resolve
from recovery.recipe.errors import ConfigError, Problem
from recovery.recipe.recipe import read_recipe
from recovery.recipe.schema import CheckpointlessConfig
from recovery.recipe.sources import (
    Assignment,
    env_assignments,
    override_assignments,
    recipe_assignments,
)
from recovery.recipe.validate import cross_check


def load_config(
    recipe: str | Path | None = None,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> CheckpointlessConfig:
    """Resolve the configuration from every source, or raise one :class:`ConfigError`.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. All
    problems from all sources are collected before raising, each naming its key and
    where the bad value came from.
    """
    if isinstance(overrides, str):  # a lone "a=b" would otherwise iterate characters
        overrides = [overrides]
    env = os.environ if env is None else env
    assignments: list[Assignment] = []
    problems: list[Problem] = []
    if recipe:
        try:
            assignments += recipe_assignments(read_recipe(recipe))
        except ConfigError as exc:
            problems += exc.problems
    for layer in (env_assignments(env), override_assignments(overrides)):
        assignments += layer[0]
        problems += layer[1]
    res = resolve(assignments)
    problems += res.problems
    cfg = res.build()
    problems += cross_check(cfg, res)
    if problems:
        raise ConfigError(problems)
    return cfg
