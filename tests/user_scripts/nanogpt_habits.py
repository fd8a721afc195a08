"""Two habits of Karpathy's nanoGPT, adapted to the plain API by a new user.

Seeding: nanoGPT seeds each rank differently (``1337 + seed_offset``) and relies on
DDP's constructor to broadcast rank 0's weights. Without DDP (``--seed-by-rank``), each
rank trains its own model; the runtime must say so at the first step.

Prefetch: nanoGPT's loop fetches the next batch at the end of each step, without
registering the batch.

nanoGPT fetches the first batch before its loop and the next one at the end of each
step (``X, Y = get_batch('train')``), so the batch a step trains on was fetched by the
step before. The loader is registered, so a rollback restores its position, but the
prefetched batch in this closure is not: a survivor replays the steps after the commit
on batches from the future, and its trajectory differs from a failure-free run. The
runtime must say so (``replay_diverged``) instead of reporting a clean recovery.
With ``--register-batch`` the batch is part of the state and the replay is exact.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from examples.gpt import CharData, TinyGPT, loss_fn, make_corpus, state_digest
from recovery import Checkpointless


class Prefetched:
    """The batch fetched ahead, as state the runtime can snapshot (``--register-batch``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x.clone(), y.clone()

    def state_dict(self) -> dict:
        return {"x": self.x, "y": self.y}

    def load_state_dict(self, sd: dict) -> None:
        self.x.copy_(sd["x"])
        self.y.copy_(sd["y"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--register-batch", action="store_true")
    ap.add_argument("--seed-by-rank", action="store_true")
    ap.add_argument("--drift-at", type=int, default=0,
                    help="rank 1 nudges one weight at this step (a rank-dependent update)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(1337 + (int(os.environ["RANK"]) if args.seed_by_rank else 0))
    data = CharData(make_corpus(), 16, 4, int(os.environ["RANK"]),
                    int(os.environ["WORLD_SIZE"]), seed=0)
    model = TinyGPT(data.vocab_size, 32, 1, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = data.next_batch()
    batch = Prefetched(x, y)
    extra = {"batch": batch} if args.register_batch else None
    cl = Checkpointless(model=model, optimizer=opt, loader=data, extra=extra)

    def train_step(step: int) -> None:
        loss_fn(model(batch.x), batch.y).backward()
        cl.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == args.drift_at and cl.rank == 1:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3
        nx, ny = data.next_batch()  # the next step's batch, fetched ahead
        batch.x.copy_(nx)
        batch.y.copy_(ny)

    cl.run(train_step, args.steps)
    with open(os.path.join(cl.env.run_dir, f"final_rank{cl.rank}.json"), "w") as f:
        json.dump({"rank": cl.rank, "step": cl.step, "digest": state_digest(model, opt),
                   "data_order": data.order_hash, "position": data.position}, f)


if __name__ == "__main__":
    main()
