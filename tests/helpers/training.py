"""Small training loops and exact-comparison helpers shared by tests and workers."""

from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import numpy as np
import torch
from torch import nn

IN_FEATURES, OUT_FEATURES = 16, 4


def make_model(hidden: int = 64) -> nn.Module:
    """A tiny MLP with dropout, so the torch RNG influences training."""
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(hidden, OUT_FEATURES),
    )


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any = None,
    scaler: Any = None,
) -> float:
    """One step whose result depends on the torch, python and numpy RNG streams."""
    x = torch.randn(8, IN_FEATURES)
    y = torch.randn(8, OUT_FEATURES)
    jitter = random.random() + float(np.random.rand())
    loss = ((model(x) - y) ** 2).mean() * (1.0 + 0.01 * jitter)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    if sched is not None:
        sched.step()
    return float(loss.item())


def rng_draws() -> list[float]:
    """One draw from each global RNG stream."""
    return [random.random(), float(np.random.rand()), float(torch.rand(1).item())]


class LoopState:
    """Loop counters that live only in the snapshot skeleton (no tensors)."""

    def __init__(self, rank: int = 0) -> None:
        self.step = 0
        self.rank = rank
        self.history: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "history": list(self.history)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.rank, self.history = sd["step"], sd["rank"], list(sd["history"])


class ShardState:
    """A per-rank tensor (think: a data-loader position or a sharded buffer)."""

    def __init__(self, rank: int, numel: int = 256) -> None:
        self.values = torch.full((numel,), float(rank))

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.values = sd["values"].clone()


class Holder:
    """Stateful that just keeps whatever state dict it is given (for inspection)."""

    def __init__(self, sd: Any = None) -> None:
        self.sd = sd

    def state_dict(self) -> Any:
        return self.sd

    def load_state_dict(self, sd: Any) -> None:
        self.sd = sd


def _canon(obj: Any, h: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.dtype.str}{obj.shape}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k, v in obj.items():
            _canon(k, h)
            _canon(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__}{len(obj)}".encode())
        for v in obj:
            _canon(v, h)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, np.generic)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(f"cannot digest {type(obj).__qualname__}")


def digest(obj: Any) -> str:
    """sha256 of a canonical, type-tagged serialisation of a state tree."""
    h = hashlib.sha256()
    _canon(obj, h)
    return h.hexdigest()


def buffer_sha(buf: torch.Tensor) -> str:
    return hashlib.sha256(buf.contiguous().numpy().tobytes()).hexdigest()


def assert_tree_equal(a: Any, b: Any, path: str = "") -> None:
    """Exact equality: same types, bit-equal tensors/arrays, nan == nan, -0.0 != 0.0."""
    where = path or "/"
    assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape}"
        assert torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(), b.nan_to_num())
        ), f"{where}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}/{i}")
    elif isinstance(a, float):
        if math.isnan(a):
            assert math.isnan(b), f"{where}: nan != {b!r}"
        else:
            assert a == b and math.copysign(1, a) == math.copysign(1, b), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
