"""The YAML recipe: schema, loading with precedence, validation and serialisation.

The one configuration layer, below everything that reads it: the launcher resolves
the recipe with :func:`load_config` and hands workers the result as JSON, which each
worker re-validates with :func:`worker_config` (the same parser); the Lightning
strategy loads a recipe with :func:`load_config` when run without the launcher. This
package imports only the configuration sections it composes (``recovery.common.config``,
``replication.config``, ``dataloader_cache.config``), so every part of ``recovery``
and ``launcher`` may import it (the layer test in ``tests/test_layers.py`` holds it
to that).

Precedence, lowest first: dataclass defaults, the recipe's ``checkpointless:``
block, ``CHECKPOINTLESS_<SECTION>_<KEY>`` env vars, ``key=value`` overrides.
"""

from recovery.recipe.errors import ConfigError, Problem
from recovery.recipe.fields import FieldSpec, all_fields
from recovery.recipe.loader import load_config
from recovery.recipe.recipe import RecipeBlock, read_recipe
from recovery.recipe.schema import BLOCK_KEY, SECTIONS, CheckpointlessConfig
from recovery.recipe.serialize import (
    config_from_json,
    config_to_json,
    config_to_yaml,
    worker_config,
)
from recovery.recipe.sources import RESERVED_ENV, RESERVED_ENV_PREFIX, is_reserved_env

__all__ = [
    "BLOCK_KEY",
    "RESERVED_ENV",
    "RESERVED_ENV_PREFIX",
    "SECTIONS",
    "CheckpointlessConfig",
    "ConfigError",
    "FieldSpec",
    "Problem",
    "RecipeBlock",
    "all_fields",
    "config_from_json",
    "config_to_json",
    "config_to_yaml",
    "is_reserved_env",
    "load_config",
    "read_recipe",
    "worker_config",
]
