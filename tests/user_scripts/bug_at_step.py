"""A training loop whose step 7 raises on rank 1 every time it runs (a user's bug)."""

import torch

from recovery import Checkpointless


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cl = Checkpointless(model=model, optimizer=opt)

    def step(n: int) -> None:
        loss = model(torch.ones(4, 8)).pow(2).mean()
        loss.backward()
        cl.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
        if n == 7 and cl.rank == 1:
            raise ValueError(f"bad batch shape at step {n}")

    cl.run(step, 12)


if __name__ == "__main__":
    main()
