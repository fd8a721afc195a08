"""One module per ``checkpointless`` subcommand.

Each module exposes ``register(subparsers)``, which adds its parser and sets
``handler`` (``args -> exit code``) as a default. Modules are imported lazily by
name so that a light command (``config``) never pays for a heavy one's imports
(``run`` brings in torch).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: Subcommand modules, in the order ``--help`` lists them. Add ``run``, ``ckpt``,
#: ``report`` here as they land.
COMMAND_MODULES: tuple[str, ...] = ("launcher.commands.config_cmd", "launcher.commands.run_cmd")
COMMAND_MODULES += ("launcher.commands.ckpt_cmd",)
COMMAND_MODULES += ("launcher.commands.chaos_cmd",)
COMMAND_MODULES += ("launcher.commands.report_cmd",)
COMMAND_MODULES += ("launcher.commands.status_cmd",)


def load_commands() -> list[ModuleType]:
    return [importlib.import_module(name) for name in COMMAND_MODULES]
