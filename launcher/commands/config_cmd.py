"""``checkpointless config show|validate|reference``: resolve a recipe exactly as ``run``
would, or print the reference page of every key.

Both take the same inputs as ``run`` (recipe, ``CHECKPOINTLESS_*`` env, ``key=value``)
so a user can see, before spending a GPU allocation, what the job will actually use.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recovery.recipe import (
    all_fields,
    config_to_json,
    config_to_yaml,
    load_config,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "config", help="show or validate the resolved checkpointless configuration"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    show = actions.add_parser(
        "show",
        help="print the resolved configuration (defaults < recipe < env < overrides)",
        description="Print the configuration a job would run with.",
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    show.add_argument("recipe", nargs="?", metavar="RECIPE", help="YAML recipe (optional)")
    _add_common(show)
    show.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    show.add_argument(
        "--comments", action="store_true", help="annotate each YAML key with its help text"
    )
    show.set_defaults(handler=_show)

    validate = actions.add_parser(
        "validate",
        help="check a recipe and overrides; print 'ok' or every problem",
        description="Check a recipe (with env and overrides); exit 0 if valid, 2 if not.",
        epilog=keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("recipe", metavar="RECIPE", help="YAML recipe")
    _add_common(validate)
    validate.set_defaults(handler=_validate)

    reference = actions.add_parser(
        "reference",
        help="print the reference of every key (Markdown), generated from the schema",
        description="Print docs/reference/configuration.md: every key, its type, default, "
        "allowed values, environment variable and meaning.",
    )
    reference.set_defaults(handler=_reference)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="overrides such as replication.factor=3 (a 'checkpointless.' prefix is optional)",
    )
    parser.add_argument(
        "--ignore-env", action="store_true", help="do not read CHECKPOINTLESS_* variables"
    )


def _split_recipe(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """argparse gives the first positional to RECIPE even when it is an override."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).is_file():
        return None, [recipe, *overrides]
    return recipe, overrides


def _load(args: argparse.Namespace, recipe: str | None, overrides: list[str]):
    return load_config(recipe, overrides, env={} if args.ignore_env else None)


def _show(args: argparse.Namespace) -> int:
    recipe, overrides = _split_recipe(args)
    cfg = _load(args, recipe, overrides)
    if args.json:
        print(config_to_json(cfg, indent=2))
    else:
        print(config_to_yaml(cfg, comments=args.comments), end="")
    return 0


def _validate(args: argparse.Namespace) -> int:
    _load(args, args.recipe, list(args.overrides))
    print("ok")
    return 0


def _reference(_args: argparse.Namespace) -> int:
    from recovery.recipe.reference import reference_markdown

    print(reference_markdown(), end="")
    return 0


def keys_help() -> str:
    """The table of every key, for ``--help``: type, default and what it does."""
    lines = ["keys (set in the recipe, as KEY=VALUE, or as CHECKPOINTLESS_<SECTION>_<KEY>):"]
    for spec in all_fields():
        name = ".".join(spec.path)
        lines.append(f"  {name:<42} {spec.kind:<5} default {spec.default!r}")
        if spec.help:
            lines.append(f"      {spec.help}")
    return "\n".join(lines)
