"""Intervals and schedules: how often to snapshot, and when a durable save falls due.

The ``auto`` interval policy (:mod:`.interval_policy`), its adapter in a running job
(:mod:`.auto_interval`) and the durable save cadence (:mod:`.save_schedule`).
May use :mod:`recovery.common`.
"""
