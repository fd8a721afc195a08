"""The YAML recipe: schema, loading with precedence, validation and serialisation.

Precedence, lowest first: dataclass defaults, the recipe's ``checkpointless:``
block, ``CHECKPOINTLESS_<SECTION>_<KEY>`` env vars, ``key=value`` overrides.
"""

from launcher.config.errors import ConfigError, Problem
from launcher.config.fields import FieldSpec, all_fields
from launcher.config.loader import load_config
from launcher.config.recipe import RecipeBlock, read_recipe
from launcher.config.schema import BLOCK_KEY, SECTIONS, CheckpointlessConfig
from launcher.config.serialize import (
    CONFIG_JSON_ENV,
    config_from_json,
    config_to_json,
    config_to_yaml,
)
from launcher.config.sources import RESERVED_ENV, RESERVED_ENV_PREFIX, is_reserved_env

__all__ = [
    "BLOCK_KEY",
    "CONFIG_JSON_ENV",
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
]
