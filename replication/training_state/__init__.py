"""What a rank's training state is, and how it lies in bytes: the registry
(:mod:`.state`), the pickle-free skeleton codec (:mod:`.codec`), the flat buffer's layout
(:mod:`.layout`) and a snapshot's metadata (:mod:`.snapshot_meta`).

The bottom room of ``replication/``: it uses only the shared top-level modules
(``replication.config``, ``contract``, ``errors``).
"""
