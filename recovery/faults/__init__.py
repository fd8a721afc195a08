"""What goes wrong besides a lost rank, and the lines that say so: injected faults
(:mod:`.spec`, :mod:`.injection`), a bug in the user's script (:mod:`.user_errors`) and
ranks that stop training one model (:mod:`.divergence`).

:mod:`.spec` is stdlib-only: the recipe validator reads it. May use
:mod:`recovery.common`, :mod:`recovery.job_store` and :mod:`recovery.generation`.
"""
