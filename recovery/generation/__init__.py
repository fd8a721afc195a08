"""A generation's rendezvous and plan: the control-plane contract, who trains, and
what every rank restores.

:mod:`.protocol` holds every store key agents and workers agree on; :mod:`.rendezvous`
and :mod:`.live_plan` make one plan per generation; :mod:`.world` says which launch
ranks train now; :mod:`.fencing` keeps a node declared lost out; :mod:`.recovery_timeline`
splits a recovery's seconds. May use :mod:`recovery.common` and :mod:`recovery.job_store`.
"""
