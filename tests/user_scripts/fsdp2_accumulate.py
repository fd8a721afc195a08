"""``examples/train_fsdp2.py``'s loop with gradient accumulation, as FSDP2 users write it.

Each optimizer step takes ``--accumulate`` micro-batches: FSDP2's gradient sync
(``set_requires_gradient_sync``) is off for all but the last, so the earlier
micro-batches' gradients accumulate on the unsharded parameters and only the last
backward reduce-scatters the sum. Everything else is the example's: ``fully_shard`` on
each block and on the root, AdamW, a warmup-cosine ``LambdaLR``, ``cl.run``. Each
step's loss goes into a list registered with the runtime (so a rollback rolls it back)
and into ``final_rank<r>.json``.

Where a kill lands is recorded apart from the state: every rank appends a line per
micro-batch event to ``trace_rank<r>.jsonl`` in the run directory (process id,
generation, step, micro-batch index, ``forward`` once the forward returned,
``backward`` once the backward did), flushed at once: a SIGKILLed process's lines are
all there, and a rollback removes none.

``--kill-between R:S``: rank R SIGKILLs itself once the first micro-batch of step S is
done (its backward returned), before the next micro-batch's forward: the exact middle
of an accumulation, which no ``recovery.fault`` phase names (``backward`` fires as the
first micro-batch's backward starts, ``optimizer`` after the last one). Once per job: a
marker file in the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.gpt import CharData, TinyGPT, loss_fn, lr_lambda, make_corpus, state_digest
from recovery import Checkpointless


class Losses:
    """The step losses the script logs, registered so a rollback rolls them back."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"losses": torch.tensor(self.losses, dtype=torch.float64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.losses[:] = state["losses"].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--accumulate", type=int, default=2)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-between", default="", metavar="RANK:STEP")
    args = ap.parse_args()
    torch.set_num_threads(1)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(args.seed)  # FSDP2 shards the same full weights on every rank

    data = CharData(make_corpus(), args.seq_len, args.batch, rank, world, seed=args.seed)
    model = TinyGPT(data.vocab_size, args.dim, args.layers, seq_len=args.seq_len)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(3, args.steps))
    losses: list[float] = []

    cl = Checkpointless(model=model, optimizer=opt, scheduler=sched, loader=data,
                        extra={"losses": Losses(losses)})
    out = cl.env.run_dir
    trace = open(os.path.join(out, f"trace_rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115
    kill_rank, kill_step = (int(v) for v in args.kill_between.split(":")) \
        if args.kill_between else (-1, -1)
    marker = os.path.join(out, "killed-between")

    def record(event: str, step: int, micro: int) -> None:
        trace.write(json.dumps({"pid": os.getpid(), "gen": cl.gen, "step": step,
                                "micro": micro, "event": event}) + "\n")
        trace.flush()

    def train_step(step: int) -> None:
        k = args.accumulate
        total = 0.0
        for j in range(k):
            model.set_requires_gradient_sync(j == k - 1)  # reduce-scatter on the last only
            x, y = data.next_batch()
            loss = loss_fn(model(x), y) / k
            record("forward", step, j)
            loss.backward()
            record("backward", step, j)
            total += loss.item()
            if (rank, step, j) == (kill_rank, kill_step, 0) and _claim(marker):
                os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(total)

    cl.run(train_step, args.steps)

    with open(os.path.join(out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position,
                   "losses": losses, "gen": cl.gen}, f)
    dist.destroy_process_group()


def _claim(marker: str) -> bool:
    """True for the first caller in the job (the replay of the step must not kill again)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


if __name__ == "__main__":
    main()
