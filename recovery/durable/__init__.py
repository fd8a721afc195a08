"""The worker's use of the durable tier: persist committed steps (:mod:`.tier`) and
restore every rank from one agreed checkpoint (:mod:`.restore`).

The format, writer and reader are ``replication.durable``. May use
:mod:`recovery.common`, :mod:`recovery.job_store`, :mod:`recovery.generation` and
:mod:`recovery.schedules`.
"""
