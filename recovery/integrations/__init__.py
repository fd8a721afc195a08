"""Framework integrations of the worker runtime (Lightning now; NeMo builds on it).

Each integration lives in its own subpackage and is the only code that imports its
framework; nothing else in the project depends on them.
"""
