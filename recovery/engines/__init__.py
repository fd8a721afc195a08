"""Training engines of other frameworks, registered as the runtime's training state.

A framework that owns the model, the optimizer and their wrappers (DeepSpeed's engine)
is taken apart here into the entries a snapshot captures (``Checkpointless(engine=...)``).
Only its modules import the framework, and only when an engine is given.
"""
