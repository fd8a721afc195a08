"""A safe, pickle-free codec for the non-tensor skeleton of a state dict.

A training state is a tree of containers whose leaves are mostly tensors. Snapshots
store the tensors as raw bytes in a preallocated buffer and the rest of the tree (the
*skeleton*) as tagged JSON. Unlike pickle, decoding can never construct arbitrary
objects, so a replica received from a peer or a file read back from storage cannot run
code. Everything the codec does not know is refused with the path of the offending
value, which makes unsupported user state fail loudly at the first snapshot rather
than at restore time.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import Any

import torch

try:  # numpy is optional for users, but its RNG state and arrays are common leaves.
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None  # type: ignore[assignment]


class CodecError(TypeError):
    """A state leaf the snapshot codec cannot represent (the message names its path)."""


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
        torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
        torch.bool,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    """Return the stable short name of a dtype, refusing dtypes snapshots cannot hold."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CodecError(f"tensor dtype {dtype} is not supported by snapshots")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`, with a clear error for unknown names."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown tensor dtype {name!r} in snapshot metadata") from None


def encode(obj: Any, on_tensor: Callable[[torch.Tensor, str], int]) -> Any:
    """Turn ``obj`` into JSON-able tagged data; tensors are handed to ``on_tensor``.

    ``on_tensor(tensor, path)`` returns the index under which the tensor's bytes are
    stored; the skeleton keeps only that index.
    """
    return _encode(obj, "", on_tensor)


def _encode(obj: Any, path: str, on_tensor: Callable[[torch.Tensor, str], int]) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Tensor):
        return {"t": on_tensor(obj, path)}
    if isinstance(obj, dict):
        return {
            "D": [
                [_encode(k, f"{path}/<key>", on_tensor), _encode(v, f"{path}/{k}", on_tensor)]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return {"L": [_encode(v, f"{path}/{i}", on_tensor) for i, v in enumerate(obj)]}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"T": [_encode(v, f"{path}/{i}", on_tensor) for i, v in enumerate(obj)]}
    if isinstance(obj, torch.dtype):
        return {"dt": dtype_name(obj)}
    if isinstance(obj, torch.Size):
        return {"S": list(obj)}
    if isinstance(obj, torch.device):
        return {"dev": str(obj)}
    if isinstance(obj, bytes):
        return {"B": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, (set, frozenset)):
        return {"set": [_encode(v, f"{path}/{i}", on_tensor) for i, v in enumerate(obj)]}
    if np is not None:
        if isinstance(obj, np.ndarray):
            return {"np": on_tensor(torch.from_numpy(np.ascontiguousarray(obj)), path)}
        if isinstance(obj, np.generic):
            return {"ns": [obj.dtype.str, obj.item()]}
    raise CodecError(
        f"state value at {path or '/'} has type {type(obj).__qualname__}, which snapshots "
        "cannot store; keep state to tensors, numbers, strings and dict/list/tuple of them"
    )


def decode(data: Any, tensor_at: Callable[[int], torch.Tensor]) -> Any:
    """Rebuild the tree from tagged data; ``tensor_at(i)`` supplies tensor ``i``."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, dict) and len(data) == 1:
        (tag, val), = data.items()
        if tag == "t":
            return tensor_at(val)
        if tag == "D":
            return {decode(k, tensor_at): decode(v, tensor_at) for k, v in val}
        if tag == "L":
            return [decode(v, tensor_at) for v in val]
        if tag == "T":
            return tuple(decode(v, tensor_at) for v in val)
        if tag == "f":
            return float(val)
        if tag == "dt":
            return dtype_from_name(val)
        if tag == "S":
            return torch.Size(val)
        if tag == "dev":
            return torch.device(val)
        if tag == "B":
            return base64.b64decode(val)
        if tag == "set":
            return {decode(v, tensor_at) for v in val}
        if tag == "np" and np is not None:
            return tensor_at(val).numpy().copy()
        if tag == "ns" and np is not None:
            return np.dtype(val[0]).type(val[1])
    raise CodecError(f"malformed snapshot skeleton node: {str(data)[:80]!r}")


def dumps(data: Any) -> bytes:
    """Serialise encoded skeleton data compactly (floats round-trip exactly)."""
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes) -> Any:
    """Parse bytes written by :func:`dumps`."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"snapshot skeleton is not valid JSON: {exc}") from None
