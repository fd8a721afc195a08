"""A language-model habit gone wrong: the output layer shares the embedding's weight, and
a replacement builds the model on the meta device and moves it with ``to_empty()``
without tying the weights again. Its optimizer then holds one parameter more than the
snapshot it receives, every time it tries."""

import torch

from recovery import Checkpointless, is_replacement


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head is

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def main() -> None:
    torch.manual_seed(0)
    if is_replacement():
        with torch.device("meta"):
            model = TiedLM()
        model = model.to_empty(device="cpu")  # the tie is lost here
    else:
        model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cl = Checkpointless(model=model, optimizer=opt)

    def train_step(step: int) -> None:
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(step))
        model(ids).logsumexp(-1).mean().backward()
        cl.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()

    cl.run(train_step, num_steps=12)


if __name__ == "__main__":
    main()
