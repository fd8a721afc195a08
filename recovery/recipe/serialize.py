"""Write a resolved configuration out as a recipe block (YAML) or for workers (JSON).

The YAML is meant to be read back by :func:`load_config`, which goes through
OmegaConf, so a literal ``${`` in a string value is escaped (``\\${``) to stay a
literal rather than become an interpolation on the way back in.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from recovery.recipe.build import resolve
from recovery.recipe.errors import ConfigError, Problem
from recovery.recipe.fields import all_fields
from recovery.recipe.schema import BLOCK_KEY, SECTIONS, CheckpointlessConfig
from recovery.recipe.sources import Assignment
from recovery.recipe.validate import cross_check
from replication import contract

_COMMENT_COLUMN = 40


def config_to_yaml(cfg: CheckpointlessConfig, *, comments: bool = False) -> str:
    """A ``checkpointless:`` block; with ``comments`` each key carries its help text."""
    data = cfg.to_dict()
    lines = [f"{BLOCK_KEY}:"]
    helps = {spec.path: spec.help for spec in all_fields()}
    for name, value in data.items():
        if name in SECTIONS:
            if comments and SECTIONS[name].__doc__:
                lines.append(f"  # {_first_line(SECTIONS[name].__doc__)}")
            lines.append(f"  {name}:")
            for field_name, field_value in value.items():
                help_text = helps.get((name, field_name), "") if comments else ""
                lines.append(_entry(4, field_name, field_value, help_text))
            continue
        lines.append(_entry(2, name, value, helps.get((name,), "") if comments else ""))
    return "\n".join(lines) + "\n"


def config_to_json(cfg: CheckpointlessConfig, *, indent: int | None = None) -> str:
    """The resolved configuration as JSON (one line unless ``indent`` is given)."""
    return json.dumps(cfg.to_dict(), indent=indent)


def config_from_json(text: str, *, source: str = contract.ENV_CONFIG) -> CheckpointlessConfig:
    """Parse and re-validate JSON from :func:`config_to_json`.

    The worker trusts nothing it did not check: the JSON crossed a process boundary
    and may come from a different version of the launcher.
    """
    try:
        data = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(Problem(source, f"not valid JSON: {exc}")) from None
    res = resolve([Assignment((), data, source)])
    cfg = res.build()
    problems = res.problems + cross_check(cfg, res)
    if problems:
        raise ConfigError(problems)
    return cfg


def worker_config(text: str | None) -> CheckpointlessConfig:
    """The job's configuration as the launcher handed it to this worker, validated by
    :func:`config_from_json`; the defaults when there is none (a script run without
    ``checkpointless run``)."""
    return config_from_json(text) if text else CheckpointlessConfig()


def _entry(indent: int, name: str, value: Any, help_text: str) -> str:
    line = f"{' ' * indent}{name}: {_flow(_escape(value))}"
    if help_text:
        line = f"{line:<{_COMMENT_COLUMN}}  # {' '.join(help_text.split())}"
    return line


def _flow(value: Any) -> str:
    """One value in YAML flow style, on one line."""
    text = yaml.safe_dump(
        [value], default_flow_style=True, width=1 << 30, allow_unicode=True, sort_keys=False
    )
    return text.strip()[1:-1]


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("${", "\\${")
    if isinstance(value, dict):
        return {k: _escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escape(v) for v in value]
    return value


def _first_line(doc: str) -> str:
    return doc.strip().splitlines()[0]
