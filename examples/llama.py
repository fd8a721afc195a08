"""A small Llama-style language model, and the tensor-parallel plan its users write.

The model is the project's own, in the shape of the Llama family: token embeddings,
pre-norm blocks of RMSNorm, causal multi-head attention with rotary position
embeddings, and a SwiGLU feed-forward, then a final norm and an output projection. It
is small enough to train on CPU in tests (``dim`` 32, 2 blocks), and written so that
DTensor's ``parallelize_module`` can split it the usual way:

- attention's ``wq``/``wk``/``wv`` and the feed-forward's ``w1``/``w3`` column-wise,
  ``wo`` and ``w2`` row-wise (each block then needs one all-reduce per half);
- with sequence parallelism, the norms run on a sequence shard (``SequenceParallel``),
  and each half's input is gathered to a replicated sequence first.

Attention reads its head count from the local projection (``-1`` in the view), so the
same code runs on a whole ``wq`` and on a tensor-parallel shard of it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float = 10000.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, ``(seq_len, head_dim // 2)``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of ``x``'s last dimension (``(batch, heads, seq, head_dim)``)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[: x.size(-2)], sin[: x.size(-2)]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(proj: nn.Module) -> torch.Tensor:  # -1: this rank's heads under TP
            return proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int = 32, layers: int = 2, heads: int = 4,
                 seq_len: int = 16) -> None:
        super().__init__()
        self.tok_embeddings: nn.Module | None = nn.Embedding(vocab, dim)
        # keyed by block index: a pipeline stage keeps its blocks' original names
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.norm: nn.Module | None = RMSNorm(dim)
        self.output: nn.Module | None = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(dim // heads, seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; on a pipeline stage, whatever its parts make of its input
        (tokens on the first stage, hidden states after it)."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    def keep_stage(self, stage: int, stages: int) -> None:
        """Drop what pipeline stage ``stage`` of ``stages`` does not run: the blocks
        are split into contiguous runs, the embeddings stay on the first stage and the
        final norm and output on the last (as manual pipeline splits do it)."""
        per, extra = divmod(len(self.layers), stages)
        first = stage * per + min(stage, extra)
        mine = range(first, first + per + (1 if stage < extra else 0))
        for key in [k for k in self.layers if int(k) not in mine]:
            del self.layers[key]
        if stage > 0:
            self.tok_embeddings = None
        if stage < stages - 1:
            self.norm = self.output = None


def init_weights(model: Llama, seed: int) -> None:
    """Llama's usual init (normal, std 0.02; output scaled by depth), from ``seed``:
    every rank builds the same full weights before they are split."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # the norms
                continue
            std = 0.02 / math.sqrt(2 * len(model.layers)) if name.endswith(("wo.weight",
                                                                            "w2.weight")) \
                else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)


def tensor_parallel_plan(sequence_parallel: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the root's plan, each block's plan), as DTensor's tutorials write them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        root = {"output": ColwiseParallel(output_layouts=Replicate())}
        block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
                 "feed_forward.w3": ColwiseParallel()}
        return root, block
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return root, block
