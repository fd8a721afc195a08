"""The training job of ``bench_preload``: a Hugging Face GPT-2 under DDP, as people write it.

The model comes from a ``GPT2Config`` with random initialisation (nothing is
downloaded); a replacement (``is_replacement()``) builds it on the meta device, since
its values come from a replica, and ties its weights again after ``to_empty`` (which
gives every parameter its own storage: untied, the replacement's optimizer would hold
one parameter more than the snapshot's). Each rank writes ``<out>/ready_rank<r>_<n>.json`` with
the wall-clock time just before ``Checkpointless(...)`` (``n``: 0 for a first worker, 1
for a replacement), and ``final_rank<r>.json`` (a digest of the weights) at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import GPT2Config, GPT2LMHeadModel

from recovery import Checkpointless, is_replacement


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = GPT2Config(n_layer=args.layers, n_head=4, n_embd=128, vocab_size=2048,
                        n_positions=64)
    torch.manual_seed(0)
    if is_replacement():  # its values come from a replica: skip the random init
        with torch.device("meta"):
            model = GPT2LMHeadModel(config)
        model = model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives every parameter its own storage: re-tie
    else:
        model = GPT2LMHeadModel(config)
    model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with open(os.path.join(args.out, f"ready_rank{rank}_{int(is_replacement())}.json"),
              "w") as f:
        json.dump({"ts": time.time()}, f)
    cl = Checkpointless(model=model, optimizer=opt)

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(step * 7919 + rank)
        ids = torch.randint(0, config.vocab_size, (4, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cl.run(train_step, num_steps=args.steps)
    digest = hashlib.sha256()
    for name, t in sorted(model.module.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    with open(os.path.join(args.out, f"final_rank{rank}.json"), "w") as f:
        json.dump({"digest": digest.hexdigest()}, f)


if __name__ == "__main__":
    main()
