"""The snapshot engine and its copies: capture into slots (:mod:`.snapshot`,
:mod:`.slots`), copies overlapped with training (:mod:`.overlap`), digested
(:mod:`.digest_copy`, :mod:`.checksum`), streamed (:mod:`.streamcopy`, the
``_streamcopy`` kernel) and device-resident (:mod:`.device_tier`, :mod:`.device_copy`),
the host memory budget (:mod:`.memory`) and the replay check (:mod:`.replay_check`).

May use :mod:`replication.training_state` and the shared top-level modules.
"""
