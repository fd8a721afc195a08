"""Checks that involve more than one field, run once every field has its final value.

Single-field rules (type, bounds, choices) live in the section metadata; these are
the combinations that are each valid alone but cannot work together. A check is
skipped when one of its fields already has an error, so one mistake is reported once.
"""

from __future__ import annotations

from collections.abc import Callable

from recovery.recipe.build import Resolution
from recovery.recipe.errors import Problem, short_repr
from recovery.recipe.fields import FieldSpec, fields_by_path
from recovery.recipe.schema import CheckpointlessConfig

Check = Callable[[CheckpointlessConfig, Resolution], list[Problem]]


def _spec(section: str, name: str) -> FieldSpec:
    return fields_by_path()[(section, name)]


def _persistence_needs_path(cfg: CheckpointlessConfig, res: Resolution) -> list[Problem]:
    p = cfg.persistence
    if p.path:
        return []
    problems = []
    path_key = _spec("persistence", "path").key
    for name, value in (("every_n_steps", p.every_n_steps), ("interval_s", p.interval_s)):
        if value == "auto" or value > 0:  # every_n_steps: auto asks for them too
            spec = _spec("persistence", name)
            msg = (
                f"got {short_repr(value)}, which asks for durable checkpoints, "
                f"but {path_key} is empty; set that path, or set this to 0"
            )
            problems.append(Problem(spec.key, msg, res.source_of(spec)))
    return problems


def _heartbeat_timeout_exceeds_interval(
    cfg: CheckpointlessConfig, res: Resolution
) -> list[Problem]:
    r = cfg.recovery
    if r.heartbeat_timeout_s > r.heartbeat_interval_s:
        return []
    timeout, interval = (
        _spec("recovery", "heartbeat_timeout_s"),
        _spec("recovery", "heartbeat_interval_s"),
    )
    msg = (
        f"got {short_repr(r.heartbeat_timeout_s)}; must be greater than {interval.key} "
        f"({short_repr(r.heartbeat_interval_s)}), or healthy workers are declared hung"
    )
    return [Problem(timeout.key, msg, res.source_of(timeout))]


def _fault_spec_shape(cfg: CheckpointlessConfig, res: Resolution) -> list[Problem]:
    from recovery.faults.spec import FaultSpecError, parse_faults

    fault = cfg.recovery.fault
    try:
        parse_faults(fault)
    except FaultSpecError as exc:
        spec = _spec("recovery", "fault")
        msg = f"got {short_repr(fault)}; expected 'rank:step:phase[:kind]' entries: {exc}"
        return [Problem(spec.key, msg, res.source_of(spec))]
    return []


_CHECKS: list[tuple[tuple[tuple[str, str], ...], Check]] = [
    (
        (("persistence", "path"), ("persistence", "every_n_steps"), ("persistence", "interval_s")),
        _persistence_needs_path,
    ),
    (
        (("recovery", "heartbeat_timeout_s"), ("recovery", "heartbeat_interval_s")),
        _heartbeat_timeout_exceeds_interval,
    ),
    ((("recovery", "fault"),), _fault_spec_shape),
]


def cross_check(cfg: CheckpointlessConfig, res: Resolution) -> list[Problem]:
    """Problems from every multi-field rule whose fields are all individually valid."""
    problems: list[Problem] = []
    for paths, check in _CHECKS:
        if not any(path in res.bad for path in paths):
            problems.extend(check(cfg, res))
    return problems
