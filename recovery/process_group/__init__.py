"""The owned process group: one ``ProcessGroup`` object valid across generations.

The group third-party code holds (:mod:`.owned_group`), the controller that binds it to
each generation (:mod:`.controller`), the failable works it hands out (:mod:`.works`),
the ``init_process_group`` hook (:mod:`.init_hook`), the training groups kept and let go
across generations (:mod:`.training_groups`), a generation's NCCL backend
(:mod:`.nccl_inner`), the rank-ordered sum (:mod:`.ordered_sum`), DDP's bucket layout
(:mod:`.ddp_layout`) and the rank's GPU (:mod:`.device_placement`).
May use :mod:`recovery.common`, :mod:`recovery.job_store` and :mod:`recovery.generation`.
"""
