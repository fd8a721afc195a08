"""A loop that counts its own steps with ``range`` and takes no data from a loader: after
a recovery a survivor's counter goes on from where it was and a replacement's starts at
0, so the survivors finish first while the replacement still trains (nothing runs out
of data here, so no ``StopIteration`` shows it)."""

import torch

from recovery import Checkpointless


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cl = Checkpointless(model=model, optimizer=opt)
    for _ in range(16):  # the mistake: cl.steps(16) counts with the runtime
        with cl.training_step():
            model(torch.randn(4, 8)).pow(2).mean().backward()
            cl.all_reduce_gradients(model)
            opt.step()
            opt.zero_grad()
    cl.finish()


if __name__ == "__main__":
    main()
