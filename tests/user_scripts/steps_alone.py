"""A loop that is nothing but ``for i in cl.steps(n):`` (no epochs): the whole job is
one counted pass, and the loop's own index must agree with the runtime's on every rank
after a recovery. Each step's input depends on the index, so a rank that resumed at the
wrong index ends with different weights."""

import hashlib
import json
import os
import sys

import torch

from recovery import Checkpointless


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cl = Checkpointless(model=model, optimizer=opt)
    indices: list[int] = []
    for i in cl.steps(steps):
        with cl.training_step():
            x = torch.full((4, 8), float(i))
            model(x).pow(2).mean().backward()
            cl.all_reduce_gradients(model)
            opt.step()
            opt.zero_grad()
            indices.append(i)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    with open(os.path.join(cl.env.run_dir, f"final_rank{cl.rank}.json"), "w") as f:
        json.dump({"rank": cl.rank, "step": cl.step, "digest": digest, "data_order": "",
                   "position": 0, "last_index": indices[-1] if indices else None}, f)


if __name__ == "__main__":
    main()
