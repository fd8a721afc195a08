"""DeepSpeed: a ZeRO engine's training state, registered with the runtime.

``Checkpointless(engine=model_engine, loader=...)`` takes the engine that
``deepspeed.initialize`` returned and registers what it holds, so snapshots, replicas
and restores cover it like any other state (ADR 0051):

- ``model``: the engine's module. Under ZeRO stages 1 and 2 every rank holds the whole
  model (in the training dtype); its parameters are views into ZeRO's flat buffers, and
  a restore copies into them in place, so those views stay valid;
- ``optimizer``: the torch optimizer DeepSpeed drives. Under ZeRO it is the client's
  optimizer over this rank's partition of fp32 master weights, so its state is this
  rank's partition of the optimizer state and nothing else; under stage 0 it is the
  client's optimizer over the module's parameters;
- ``scheduler``: the engine's learning-rate scheduler, when it has one;
- ``deepspeed``: :class:`EngineState`, the rest: the fp32 master partitions, the engine's
  counters (``global_steps``, ``global_samples``, ``micro_steps``, ``skipped_steps``) and
  a loss scaler's state.

A runtime step is one optimizer step: a loop with ``gradient_accumulation_steps: k``
runs ``k`` micro-batches (``engine(x)``, ``engine.backward(loss)``, ``engine.step()``)
inside each ``with cl.training_step():``, so a snapshot never falls inside an
accumulation. A step that ends inside one stops the job with one line, at the first
such step (a check at every step's end, not only at snapshots).

A failure can interrupt ZeRO in the middle of a backward (its gradient reduction runs in
autograd hooks) or of ``engine.step()``. A restore therefore first puts the engine and
its optimizer back to the state they have between two steps
(:func:`reset_interrupted_step`): no reduction in flight, no gradient held, no bucket
half full.

What is refused, each with one line at ``Checkpointless(...)``: ZeRO stage 3 (its
parameters are partitioned too, and gathered per layer by hooks the runtime does not
reset yet), optimizer or parameter offload, and optimizer wrappers other than ZeRO's
and the client's own (DeepSpeed's fp16 and bf16 wrappers without ZeRO).

The DeepSpeed engine's process groups are torch ones made with ``new_group`` on the
default group, which under ``checkpointless run`` is the runtime's own: their
collectives fail fast and are rebuilt for each generation like every other group's.
DeepSpeed's shared-memory all-reduce for CPU inference bypasses torch.distributed (a
dead peer would hang it); :func:`install` turns it off before DeepSpeed looks for it, and
with it the compile of its extension.

``engine.save_checkpoint`` goes through the runtime too: asynchronous, atomic and
checksummed, in DeepSpeed's own layout (:mod:`recovery.engines.deepspeed_saves`).

Tested with DeepSpeed 0.19.8. DeepSpeed is imported only when an engine is given, or
by the worker's import hook once the script imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from recovery.common.errors import ScriptLoopError
from replication.training_state.state import StateRegistrationError

Refused = StateRegistrationError  # one line at Checkpointless(...), before any step
SUPPORTED_STAGES = (0, 1, 2)
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps",
             "_unmanaged_backward_count")
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
SHM_OP = "deepspeed_shm_comm"


def install() -> None:
    """Called once ``deepspeed`` is imported in a worker: turns off the shared-memory
    all-reduce (see the module docstring), so DeepSpeed never builds it."""
    ops = sys.modules.get("deepspeed.ops")
    if ops is None:
        import deepspeed.ops as ops
    compatible = ops.__compatible_ops__  # probed once, then read from the module
    compatible[SHM_OP] = False


@dataclass(frozen=True)
class SaveHooks:
    """What the runtime gives ``engine.save_checkpoint`` (:mod:`.deepspeed_saves`)."""

    generation: Callable[[], int]
    run_id: str
    emit: Callable[..., Any]  # the event log's, for ``tagged_checkpoint`` events
    before_commit: Callable[[int], None] | None = None  # the ``save`` fault phase


def entries(engine: Any, state: Any, extra: dict[str, Any] | None, given: tuple = (),
            saves: SaveHooks | None = None
            ) -> tuple[tuple[torch.nn.Module, torch.optim.Optimizer, Any], dict[str, Any]]:
    """``engine`` taken apart (see the module docstring), after checking it is one the
    runtime supports: its module, its torch optimizer and its scheduler (None without
    one), and ``extra`` with :class:`EngineState` added. ``state``: the runtime's
    registry, whose restores first reset the interrupted step; ``given``: the model,
    optimizer and scheduler passed beside the engine (refused: the engine holds them);
    ``saves``: route the engine's own checkpoints through the runtime (ADR 0052)."""
    install()
    refuse_unsupported(engine)
    if any(x is not None for x in given):
        raise Refused("Checkpointless(engine=...) takes the model, optimizer and scheduler "
                      "from the DeepSpeed engine: leave model=, optimizer= and scheduler= out")
    if "deepspeed" in (extra or {}):
        raise Refused("extra= names an entry 'deepspeed': that name is the engine's own")
    if saves is not None:
        from recovery.engines import deepspeed_saves  # imports deepspeed

        deepspeed_saves.install(engine, generation=saves.generation, run_id=saves.run_id,
                                emit=saves.emit, before_commit=saves.before_commit)
    state.add_restore_guard(lambda: reset_interrupted_step(engine))
    state.add_step_check(lambda: check_boundary(engine))
    parts = (engine.module, base_optimizer(engine), engine.lr_scheduler)
    return parts, {"deepspeed": EngineState(engine, state), **(extra or {})}


def refuse_unsupported(engine: Any) -> None:
    """One line for an engine whose state the runtime cannot capture and restore."""
    kind = type(engine).__name__
    if not hasattr(engine, "zero_optimization_stage") or not hasattr(engine, "module"):
        raise Refused(f"engine= takes the engine deepspeed.initialize() returns; got "
                        f"{kind}")
    stage = int(engine.zero_optimization_stage())
    if stage not in SUPPORTED_STAGES:
        raise Refused(
            f"DeepSpeed ZeRO stage {stage} is not supported by checkpointless yet (stages "
            f"{', '.join(map(str, SUPPORTED_STAGES))} are): stage 3 partitions the "
            "parameters too; use zero_optimization.stage 1 or 2")
    if engine.optimizer is None:
        raise Refused("the DeepSpeed engine has no optimizer: give deepspeed.initialize() "
                        "one, or a config with an \"optimizer\" section")
    offload = getattr(engine, "zero_offload_optimizer", lambda: None)() or getattr(
        engine, "zero_offload_param", lambda: None)()
    if offload:
        raise Refused("DeepSpeed's optimizer and parameter offload are not supported by "
                        "checkpointless yet: turn zero_optimization.offload_* off")
    opt = engine.optimizer
    if stage == 0 and not isinstance(opt, torch.optim.Optimizer):
        raise Refused(
            f"DeepSpeed's {type(opt).__name__} (its fp16/bf16 wrapper without ZeRO) is not "
            "supported by checkpointless yet: use zero_optimization.stage 1 or 2 with "
            "mixed precision, or train in fp32")


def base_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose state is this rank's: the client's optimizer inside
    ZeRO's wrapper, or the engine's own under stage 0."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None) if is_zero(engine) else opt
    if not isinstance(inner, torch.optim.Optimizer):
        raise Refused(f"DeepSpeed's {type(opt).__name__} holds no torch optimizer the "
                        "runtime can capture")
    return inner


def is_zero(engine: Any) -> bool:
    return int(engine.zero_optimization_stage()) > 0


class EngineState:
    """The part of a DeepSpeed engine no torch object holds: ZeRO's fp32 master
    partitions, the engine's counters, the loss scaler's state."""

    def __init__(self, engine: Any, state: Any) -> None:
        self.engine, self.state = engine, state

    def resize_refusal(self) -> str:
        """Why the job cannot shrink or grow (:mod:`recovery.resize.world_resize`)."""
        world = self.engine.dp_world_size
        return (f"a DeepSpeed engine is built for {world} data-parallel ranks (its ZeRO "
                "partitions and its train_batch_size), and DeepSpeed changes that only "
                "through its own checkpoints: add a spare node, or restart from the "
                "durable checkpoint")

    def _partitions(self) -> list[torch.Tensor]:
        return list(getattr(self.engine.optimizer, "single_partition_of_fp32_groups", []))

    def state_dict(self) -> dict[str, Any]:
        e = self.engine
        if not self.state.measuring:  # a recovery sizes the state in the middle of a step
            check_boundary(e)
        sd: dict[str, Any] = {
            "counters": {k: int(getattr(e, k)) for k in _COUNTERS if hasattr(e, k)},
            "fp32_partitions": self._partitions(),
        }
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None:
            sd["loss_scaler"] = {k: _plain(getattr(scaler, k)) for k in _SCALER_FIELDS
                                 if hasattr(scaler, k)}
        if hasattr(e.optimizer, "overflow"):
            sd["overflow"] = bool(e.optimizer.overflow)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        e = self.engine
        for k, v in sd["counters"].items():
            setattr(e, k, int(v))
        mine = self._partitions()
        if len(mine) != len(sd["fp32_partitions"]):
            raise ValueError(f"{len(sd['fp32_partitions'])} fp32 partitions in the snapshot, "
                             f"{len(mine)} in the engine")
        with torch.no_grad():
            for live, saved in zip(mine, sd["fp32_partitions"]):
                live.copy_(saved)  # the base optimizer's parameters: in place
        scaler = getattr(e.optimizer, "loss_scaler", None)
        for k, v in sd.get("loss_scaler", {}).items():
            setattr(scaler, k, v)
        if "overflow" in sd:
            e.optimizer.overflow = bool(sd["overflow"])


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def check_boundary(engine: Any) -> None:
    """A snapshot is taken between optimizer steps, never inside an accumulation: every
    rank's loop is the same, so every rank stops here with the same line, at once (a
    replay would end the step at the same micro-step again)."""
    gas = int(engine.gradient_accumulation_steps())
    managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
    micro = int(engine.micro_steps)
    if gas > 1 and managed and micro % gas:
        raise ScriptLoopError(
            f"rank {engine.global_rank}'s training step ended after micro-step {micro % gas} "
            f"of DeepSpeed's {gas}-step gradient accumulation (micro-step {micro} in all): "
            f"run gradient_accumulation_steps ({gas}) micro-batches in each "
            "`with cl.training_step():` (one runtime step is one optimizer step); "
            "not retried")


def reset_interrupted_step(engine: Any) -> None:
    """Put ``engine`` back to its state between two steps, whatever a failure interrupted:
    called before every restore (a survivor's engine may be inside a backward whose
    reduction failed, or inside ``engine.step()``)."""
    for name in ("_running_engine_backward", "_running_engine_step"):
        if hasattr(engine, name):
            setattr(engine, name, False)
    if hasattr(engine, "_running_engine_backward_count"):
        engine._running_engine_backward_count = 0
    engine.losses = None
    opt = engine.optimizer
    hooks = getattr(opt, "_backward_hook_state", None)
    if hooks is not None:
        hooks.backward_active_depth = 0
        hooks.remaining_grad_acc_hooks = 0
        hooks.reset_for_new_step()
    for bucket in getattr(opt, "ipg_buckets", {}).values():
        bucket.clear()
        bucket.index = 0
    reduced = getattr(opt, "params_already_reduced", None)
    if reduced is not None:
        reduced[:] = [False] * len(reduced)
    averaged = getattr(opt, "averaged_gradients", None)
    if isinstance(averaged, dict):
        for k in list(averaged):
            averaged[k] = None
    for grads in getattr(opt, "previous_reduced_grads", {}).values():
        grads.clear()
    if hasattr(opt, "grads_in_partition_offset"):
        opt.grads_in_partition_offset = 0
    if hasattr(opt, "is_partition_reduced"):
        opt.reset_partition_gradient_structures()
    if hasattr(opt, "zero_grad"):
        opt.zero_grad(set_to_none=True)
    for p in engine.module.parameters():
        p.grad = None
        if hasattr(p, "grad_accum"):
            p.grad_accum = None
