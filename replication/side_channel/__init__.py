"""The side channel between ranks: gloo groups that an abort can end
(:mod:`.abortable_gloo`, :mod:`.interruptible_store`, :mod:`.work_waiter`), the transport
over them (:mod:`.transport`), every tag it uses (:mod:`.tags`), the store seals
(:mod:`.signing`) and same-host reads of a peer's slot (:mod:`.peer_memory`).

May use :mod:`replication.snapshots`, :mod:`replication.training_state` and the shared
top-level modules.
"""
