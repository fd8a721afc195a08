"""A newcomer's script with a bug at import time (a module that does not exist)."""

import checkpointless_no_such_module  # noqa: F401

print("never reached")
