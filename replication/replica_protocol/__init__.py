"""The replica protocol: each step's round (:mod:`.replicator`), who holds whose copies
(:mod:`.placement`, :mod:`.replicas`, :mod:`.replica_tier`), the commit
(:mod:`.commit`, :mod:`.commit_tree`, :mod:`.commit_record`), handovers to a replacement
(:mod:`.handover`, :mod:`.live_handover`, :mod:`.marks`) and drift between replicas
(:mod:`.drift`).

The top room of ``replication/``: it may use every other one.
"""
