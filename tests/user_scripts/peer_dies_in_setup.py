"""A DDP script whose rank 1 is SIGKILLed (once per run directory) during set-up,
before the first step, while rank 0 waits in DDP's weight broadcast: an
infrastructure failure that comes before any step, not a bug in the script."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.gpt import CharData, TinyGPT, loss_fn, make_corpus
from recovery import Checkpointless


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    marker = Path(os.environ["CHECKPOINTLESS_INTERNAL_RUN_DIR"]) / "killed_in_setup"
    if rank == 1 and not marker.exists():
        marker.write_text("1")
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    torch.manual_seed(rank)
    data = CharData(make_corpus(), 16, 4, rank, world, seed=0)
    model = DDP(TinyGPT(data.vocab_size, 32, 1, seq_len=16))  # rank 0 waits here
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cl = Checkpointless(model=model, optimizer=opt, loader=data)

    def train_step(step: int) -> None:
        x, y = data.next_batch()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cl.run(train_step, 6)


if __name__ == "__main__":
    main()
