"""FSDP2, tensor and pipeline parallelism on a small Llama, as PyTorch's tutorials write
them, made recoverable.

    checkpointless run --nproc-per-node 4 examples/train_llama.py --dp 2 --tp 2
    checkpointless run --nproc-per-node 2 examples/train_llama.py --pp 2 --dp 1 --tp 1

The script builds its ``(dp, tp)`` mesh (``(pp, dp, tp)`` with ``--pp``) with
``init_device_mesh`` alone (no ``init_process_group`` of its own), keeps its pipeline
stage's blocks (``--pp``: the first stage has the embeddings, the last the final norm
and output; a ``PipelineStage`` per rank, run by ``ScheduleGPipe`` or ``Schedule1F1B``
over ``--microbatches``; ``--schedule interleaved`` runs two stages per rank with
``ScheduleInterleaved1F1B``, which trains but whose recovery is not built: a failure
stops the job with one line), splits each block with ``parallelize_module``
(column-wise ``wq``/``wk``/``wv``/``w1``/``w3``, row-wise ``wo``/``w2``, with sequence
parallelism on the norms unless ``--no-sp``), then shards each block over ``dp`` with
``fully_shard``. The lines marked ``# checkpointless`` are the whole difference.

Every rank of a ``tp`` group reads the same batch (its ``dp`` rank's); each rank's
state is its own shards (parameters and AdamW moments as DTensors), snapshotted and
replicated to another node. ``--dp 1`` is tensor parallelism alone, ``--tp 1`` FSDP2
alone. On GPUs build the mesh on ``"cuda"`` (written, untested here).

``final_rank<r>.json`` (in ``--out``, else the run directory) holds the step, a digest
of the rank's shards and optimizer state, the data order and every step's loss (on a
pipeline's last stage only: the others compute none).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor.parallel import parallelize_module

from recovery import Checkpointless  # checkpointless

try:  # run as `-m examples.train_llama_2d`
    from examples.gpt import CharData, loss_fn, lr_lambda, make_corpus, state_digest
    from examples.llama import Llama, init_weights, tensor_parallel_plan
except ImportError:  # run as a script path: examples/ is sys.path[0]
    from gpt import CharData, loss_fn, lr_lambda, make_corpus, state_digest
    from llama import Llama, init_weights, tensor_parallel_plan


class Losses:
    """The step losses the script logs, registered so that a rollback rolls them back."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"losses": torch.tensor(self.values, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.values[:] = state["losses"].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP) degree")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (one per rank)")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"],
                    default="gpipe", help="interleaved: two stages per rank (Interleaved1F1B)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--no-sp", action="store_true", help="no sequence parallelism")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="directory for final_rank<r>.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    if args.pp > 1:
        mesh = init_device_mesh("cpu", (args.pp, args.dp, args.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    rank = mesh.get_rank()
    dp_rank = mesh["dp"].get_local_rank()
    stage_index = mesh["pp"].get_local_rank() if args.pp > 1 else 0

    # every stage of a pipeline reads its dp rank's batch: tokens in, targets at the end
    data = CharData(make_corpus(), args.seq_len, args.batch, dp_rank, args.dp, seed=args.seed)
    # The stages this rank runs: one, or two for the interleaved schedule (stage r and
    # r + pp, of 2 * pp), each a Llama cut down to its part of the full model.
    per_rank = 2 if args.schedule == "interleaved" and args.pp > 1 else 1
    n_stages = args.pp * per_rank
    stage_ids = [stage_index + k * args.pp for k in range(per_rank)] if args.pp > 1 else [0]
    parts = []
    for sid in stage_ids:
        part = Llama(data.vocab_size, args.dim, args.layers, args.heads, args.seq_len)
        init_weights(part, args.seed)  # the same full weights everywhere, then split
        if args.pp > 1:
            part.keep_stage(sid, n_stages)
        parts.append(part)
    root_plan, block_plan = tensor_parallel_plan(sequence_parallel=not args.no_sp)
    for part in parts:
        if args.tp > 1:
            for block in part.layers.values():
                parallelize_module(block, mesh["tp"], block_plan)
            parallelize_module(part, mesh["tp"], {k: v for k, v in root_plan.items()
                                                  if getattr(part, k) is not None})
        if args.dp > 1:
            for block in part.layers.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(part, mesh=mesh["dp"])
    model = parts[0] if len(parts) == 1 else torch.nn.ModuleDict(
        {f"stage{sid}": part for sid, part in zip(stage_ids, parts)})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(5, args.steps))
    losses = Losses()
    schedule = None
    if args.pp > 1:
        stages = [PipelineStage(part, sid, n_stages, torch.device("cpu"),
                                group=mesh["pp"].get_group())
                  for sid, part in zip(stage_ids, parts)]
        if args.schedule == "interleaved":
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches,
                                               loss_fn=loss_fn)
        else:
            kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
            schedule = kind(stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn)
    first, last = 0 in stage_ids, n_stages - 1 in stage_ids

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data,  # checkpointless
                        extra={"losses": losses})

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        if schedule is None:
            loss = loss_fn(model(x), y)
            loss.backward()
        else:  # the schedule runs forward and backward over the micro-batches
            micro: list[torch.Tensor] = []
            args_in = (x,) if first else ()
            schedule.step(*args_in, target=y if last else None, losses=micro if last else None)
            loss = torch.stack(micro).mean() if last else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if loss is not None:
            losses.values.append(loss.item())
            if dp_rank == 0 and mesh["tp"].get_local_rank() == 0 and (
                    step % 10 == 0 or step == args.steps):
                print(f"[rank {rank}] step {step:4d} loss {loss.item():.4f}", flush=True)

    cl.run(train_step, args.steps)  # checkpointless

    out = args.out or cl.env.run_dir
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position,
                   "losses": losses.values, "gen": cl.gen}, f)


if __name__ == "__main__":
    main()
