"""The node agent, the YAML recipe and the ``checkpointless`` command line.

This is the top layer: it may import ``recovery``, ``replication`` and
``dataloader_cache``, and none of them may import it.
"""
