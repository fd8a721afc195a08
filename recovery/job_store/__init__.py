"""The job store: where a job's processes coordinate, and how its records are trusted.

Owns the etcd-backed ``torch.distributed.Store`` (:mod:`.etcd_store`), the one-string
address every process passes around (:mod:`.store_address`), and the sealed records
every reader goes through (:mod:`.auth`). The bottom room of ``recovery/``: it imports
nothing else of the package, only ``replication``'s seals.
"""
