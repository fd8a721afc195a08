"""A small GPT-like model and a generated text corpus, for the examples and tests.

Nothing is downloaded: the corpus is produced from a fixed seed by a tiny grammar, so
every run (and every replacement process) sees the same text.
"""

from __future__ import annotations

import hashlib
import math
import random

import torch
from torch import nn

_SUBJECTS = ["the model", "a rank", "the node", "every replica", "the spare", "our job"]
_VERBS = ["keeps", "copies", "restores", "replicates", "trains", "recovers"]
_OBJECTS = ["its state", "the snapshot", "each step", "the optimizer", "a batch", "the loss"]


def make_corpus(n_sentences: int = 4000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
        for _ in range(n_sentences)
    )


class Windows(torch.utils.data.Dataset):
    """Fixed windows of the generated corpus, for the Lightning and NeMo examples: sample
    i is the same in every process, so a replacement reads exactly what it replaces."""

    def __init__(self, n: int, seq_len: int, seed: int) -> None:
        text = make_corpus()
        vocab = sorted(set(text))
        self.vocab_size = len(vocab)
        idx = {c: i for i, c in enumerate(vocab)}
        self.data = torch.tensor([idx[c] for c in text], dtype=torch.long)
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.data) - seq_len - 1, (n,), generator=g).tolist()
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        return self.data[s : s + self.seq_len], self.data[s + 1 : s + 1 + self.seq_len]


class CharData:
    """Deterministic batches: the batch for (step, rank) depends on nothing else.

    Its state (position and a running hash of the batch ids handed out) is registered
    with the runtime, so the data order itself is checked for bit-identity.
    """

    def __init__(self, text: str, seq_len: int, batch: int, rank: int, world: int, seed: int = 0):
        vocab = sorted(set(text))
        self.vocab_size = len(vocab)
        idx = {c: i for i, c in enumerate(vocab)}
        self.data = torch.tensor([idx[c] for c in text], dtype=torch.long)
        self.seq_len, self.batch, self.seed = seq_len, batch, seed
        self.rank, self.world = rank, world
        self.position = 0
        self.order_hash = "0" * 64

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position * 997 + self.rank)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (self.batch,), generator=g)
        self.order_hash = hashlib.sha256(
            (self.order_hash + ",".join(map(str, starts.tolist()))).encode()
        ).hexdigest()
        x = torch.stack([self.data[s : s + self.seq_len] for s in starts])
        y = torch.stack([self.data[s + 1 : s + 1 + self.seq_len] for s in starts])
        return x, y

    def state_dict(self) -> dict:
        return {"position": self.position, "order_hash": self.order_hash}

    def load_state_dict(self, sd: dict) -> None:
        self.position = int(sd["position"])
        self.order_hash = str(sd["order_hash"])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, dropout=0.1)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 2,
                 seq_len: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, dim))
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.drop = nn.Dropout(0.1)  # dropout makes RNG restoration matter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[:, : idx.size(1)])
        return self.head(self.ln(self.blocks(x)))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over every parameter and optimizer-state tensor (this rank's shards under
    FSDP2), in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        # reshape: a 0-dim tensor (batch norm's step counter) cannot be viewed as bytes
        h.update(_local(p).detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    osd = optimizer.state_dict()
    for pid in sorted(osd["state"]):
        for k, v in sorted(osd["state"][pid].items()):
            h.update(f"{pid}/{k}".encode())
            if isinstance(v, torch.Tensor):
                v = _local(v)
                h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return f
