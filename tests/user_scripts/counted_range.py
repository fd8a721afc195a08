"""A loop that counts its own steps with ``range`` and takes no data from a loader: after
a recovery a survivor's counter goes on from where it was and a replacement's starts at
0 (nothing runs out of data here, so no ``StopIteration`` shows it).

- no argument: one pass of 16 steps; the survivors finish first while the replacement
  still trains;
- ``epochs``: two epochs of 8 steps in ``cl.epochs``; the survivors end epoch 0 at an
  earlier step than the replacement does.
"""

import sys

import torch

from recovery import Checkpointless


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cl = Checkpointless(model=model, optimizer=opt)

    def step() -> None:
        with cl.training_step():
            model(torch.randn(4, 8)).pow(2).mean().backward()
            cl.all_reduce_gradients(model)
            opt.step()
            opt.zero_grad()

    if sys.argv[1:] == ["epochs"]:
        for _epoch in cl.epochs(2):
            for _ in range(8):  # the mistake: cl.steps(8) counts with the runtime
                step()
        return
    for _ in range(16):  # the mistake: cl.steps(16) counts with the runtime
        step()
    cl.finish()


if __name__ == "__main__":
    main()
