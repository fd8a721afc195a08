"""Changing the world's size: leaving one world for the next (:mod:`.world_resize`) and
FSDP2 state resharded in memory (:mod:`.reshard`).

May use every room below it: :mod:`recovery.common`, :mod:`recovery.job_store`,
:mod:`recovery.generation`, :mod:`recovery.process_group` and :mod:`recovery.loader`.
"""
