"""The runtime a user imports and what runs each step: ``Checkpointless``
(:mod:`.checkpointless`), the epoch-shaped loop (:mod:`.epoch_loop`), live rollback
(:mod:`.live_rollback`), the gradient average (:mod:`.gradient_average`), the watchdog
(:mod:`.watchdog`) and the scheduler's stop (:mod:`.drain`).

The top room of the worker side: it may use every other room of ``recovery/``. Users
import ``from recovery import Checkpointless``; the package's ``__init__`` loads it lazily.
"""
