"""Read a recipe file and extract its single ``checkpointless:`` block.

The block may be the whole file or sit anywhere inside a larger Hydra/NeMo YAML
(``exp_manager.checkpointless``, ``trainer.plugins[0].checkpointless``...), so users
keep one file per experiment. Files are read with OmegaConf so ``${...}``
interpolations resolve the way Hydra and NeMo resolve them, but only the block itself
is resolved: interpolations elsewhere in the file may use resolvers (NeMo's, custom
ones) that are not registered in this process, and they are none of our business.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from recovery.recipe.errors import ConfigError, Problem
from recovery.recipe.schema import BLOCK_KEY


@dataclass(frozen=True)
class RecipeBlock:
    """The resolved ``checkpointless:`` block of one recipe file."""

    file: Path
    location: str  # where the block sits in the file, e.g. "exp_manager.checkpointless"
    data: Any  # plain data: normally a dict; None for an empty ``checkpointless:``

    @property
    def source(self) -> str:
        """How problems with values from this block name their origin."""
        if self.location == BLOCK_KEY:
            return f"recipe {self.file}"
        return f"recipe {self.file}, block {self.location}"


def read_recipe(path: str | Path) -> RecipeBlock:
    """Load ``path`` and return its one ``checkpointless:`` block, resolved.

    Raises :class:`ConfigError` when the file is missing, is not valid YAML, has no
    block, has more than one, or the block's interpolations do not resolve.
    """
    file = Path(path)
    root = _load(file)
    plain = OmegaConf.to_container(root, resolve=False)
    trails = _find_blocks(plain)
    if not trails:
        raise ConfigError(
            Problem(str(file), f"the file has no '{BLOCK_KEY}:' block (at any depth)")
        )
    if len(trails) > 1:
        where = ", ".join(_dotted(t) for t in trails)
        raise ConfigError(
            Problem(
                str(file), f"the file has {len(trails)} '{BLOCK_KEY}:' blocks: {where}; keep one"
            )
        )
    trail = trails[0]
    try:
        node: Any = root
        for step in trail[:-1]:
            node = node[step]
        block = node[trail[-1]]  # resolves an interpolated block (``${base.checkpointless}``)
        if isinstance(block, DictConfig | ListConfig):
            block = OmegaConf.to_container(block, resolve=True, throw_on_missing=True)
    except Exception as exc:  # any failure here is the file's content, not a bug of ours
        raise ConfigError(
            Problem(_dotted(trail), f"cannot resolve the block: {_one_line(exc)}", f"recipe {file}")
        ) from None
    return RecipeBlock(file=file, location=_dotted(trail), data=block)


def _load(file: Path) -> DictConfig | ListConfig:
    if not file.exists():
        raise ConfigError(Problem(str(file), "recipe file not found"))
    if not file.is_file():
        raise ConfigError(Problem(str(file), "recipe path is not a file"))
    try:
        return OmegaConf.load(file)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(Problem(str(file), f"not valid YAML: {at}{what}")) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(Problem(str(file), f"not a UTF-8 text file ({exc.reason})")) from None
    except OSError as exc:
        raise ConfigError(Problem(str(file), f"cannot read: {exc.strerror or exc}")) from None
    except Exception as exc:  # OmegaConf/yaml edge cases: the file's fault, still a clear error
        raise ConfigError(Problem(str(file), f"cannot load: {_one_line(exc)}")) from None


def _find_blocks(plain: Any) -> list[tuple[Any, ...]]:
    """Trails (keys and list indices) of every ``checkpointless`` key, outermost only.

    Iterative so a pathologically deep file cannot exhaust the Python stack.
    """
    found: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), plain)]
    while stack:
        trail, node = stack.pop()
        if isinstance(node, dict):
            items = list(node.items())
        elif isinstance(node, list):
            items = list(enumerate(node))
        else:
            continue
        for key, value in reversed(items):  # reversed + LIFO keeps file order
            if isinstance(node, dict) and key == BLOCK_KEY:
                found.append((*trail, key))
            else:
                stack.append(((*trail, key), value))
    return found


def _dotted(trail: tuple[Any, ...]) -> str:
    text = ""
    for step in trail:
        text += f"[{step}]" if isinstance(step, int) and not isinstance(step, bool) else f".{step}"
    return text.lstrip(".")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
