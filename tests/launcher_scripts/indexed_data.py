"""The dataset the shrink tests' scripts train on: generated regression samples, each
carrying its own index, so a test can tell which samples every step consumed."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class Indexed(Dataset):
    def __init__(self, n: int, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i
