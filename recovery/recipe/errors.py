"""The one exception the configuration layer raises, carrying every problem found.

Users fix recipes in rounds; reporting all problems at once (each with the file,
env var or command-line argument it came from) saves a round trip per mistake.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from replication.errors import CheckpointlessError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration."""

    key: str  # full dotted key, env var name, or the recipe file for file-level problems
    message: str
    source: str = ""  # e.g. "recipe r.yaml", "env CHECKPOINTLESS_X", "command line 'a=b'"

    def __str__(self) -> str:
        where = f" (from {self.source})" if self.source else ""
        return f"{self.key}: {self.message}{where}"


class ConfigError(CheckpointlessError, ValueError):
    """Invalid configuration; ``problems`` lists each issue, the message one per line."""

    def __init__(self, problems: Sequence[Problem] | Problem | str):
        if isinstance(problems, str):
            problems = [Problem("checkpointless", problems)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__(self._format())

    def _format(self) -> str:
        if len(self.problems) == 1:
            return f"invalid configuration: {self.problems[0]}"
        lines = [f"invalid configuration ({len(self.problems)} problems):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


def short_repr(value: object, limit: int = 80) -> str:
    """``repr`` capped at ``limit`` characters, so one huge value cannot flood a message."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # e.g. ints beyond the str-conversion limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def suggest(
    word: str,
    candidates: Iterable[str],
    *,
    leaf_of: Callable[[str], str] | None = None,
    display: Callable[[str], str] = str,
) -> str:
    """A ``"; did you mean ...?"`` suffix, or ``""`` when nothing is close.

    Compare names without their shared prefix (``checkpointless.``, ``CHECKPOINTLESS_``)
    so that the prefix does not make everything look alike; ``display`` puts it back.
    ``leaf_of`` maps a candidate to its last component so that a right name in the
    wrong place (``factor`` instead of ``replication.factor``) is still found.
    """
    scores: dict[str, float] = {}
    for c in candidates:
        score = _similarity(word, c)
        if leaf_of is not None:
            score = max(score, _similarity(leaf_of(word), leaf_of(c)) - 0.05)
        scores[c] = score
    best = max(scores.values(), default=0.0)
    # Only the clear front-runners: a long shared prefix makes many names look alike.
    found = [c for c, s in sorted(scores.items(), key=lambda i: -i[1]) if s >= max(0.6, best - 0.1)]
    if not found:
        return ""
    return "; did you mean " + " or ".join(repr(display(c)) for c in found[:3]) + "?"


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()
