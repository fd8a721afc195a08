"""The vocabulary every room of ``recovery/`` shares: errors, event names, causes,
the ``recovery`` configuration section and the launcher's environment.

Small modules, light to import (the recipe validator reads :mod:`.config` without torch).
May use only :mod:`recovery.job_store` (the environment carries the store's address).
"""
