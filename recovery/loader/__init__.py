"""The user's data loader, resumable at the exact batch, and one loader standing for
several after a shrink (:mod:`.loader_position`, :mod:`.hosted_loader`).

May use :mod:`recovery.common`.
"""
