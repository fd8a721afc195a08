"""The GPU check is a script (``make test-gpu``), not part of the CPU pytest suite.

Nothing here is a pytest file; this keeps pytest from collecting anything in the
directory should a ``test_*.py`` helper ever be added.
"""

collect_ignore_glob = ["*.py"]
