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

from replication.errors import CheckpointlessError

try:  # numpy is optional for users, but its RNG state and arrays are common leaves.
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a declared dependency
    np = None  # type: ignore[assignment]


class CodecError(CheckpointlessError, TypeError):
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
    stored; the skeleton keeps that index, and the device of a tensor that is not on
    the host (see :func:`recorded_device`).
    """
    try:
        return _encode(obj, "", on_tensor)
    except RecursionError:
        raise CodecError("state is nested too deeply for a snapshot") from None


# Kinds of numpy scalars whose ``.item()`` is a JSON value the scalar can be rebuilt from
# exactly: bool, signed/unsigned int, float, str. (complex, datetime, bytes, void, object
# are refused rather than silently changed.)
_NP_SCALAR_KINDS = {"b": bool, "i": int, "u": int, "f": float, "U": str}


def _encode(obj: Any, path: str, on_tensor: Callable[[torch.Tensor, str], int]) -> Any:
    # numpy first: np.float64 subclasses float and np.str_ subclasses str, so the plain
    # checks below would silently turn them into python values.
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _encode_numpy(obj, path, on_tensor)
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":  # the form snapshots have always had
            return {"t": on_tensor(obj, path)}
        return {"td": [on_tensor(obj, path), str(obj.device)]}
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
    raise CodecError(
        f"state value at {path or '/'} has type {type(obj).__qualname__}, which snapshots "
        "cannot store; keep state to tensors, numbers, strings and dict/list/tuple of them"
    )


def _encode_numpy(obj: Any, path: str, on_tensor: Callable[[torch.Tensor, str], int]) -> Any:
    where = path or "/"
    if isinstance(obj, np.ndarray):
        try:
            # ascontiguousarray returns at least 1-d: reshape keeps a 0-d array 0-d.
            tensor = torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
        except (TypeError, ValueError) as exc:  # str/object dtypes, non-native byte order
            raise CodecError(
                f"numpy array at {where} has dtype {obj.dtype}, which snapshots cannot "
                f"store ({exc})"
            ) from None
        return {"np": on_tensor(tensor, path)}
    kind = _NP_SCALAR_KINDS.get(obj.dtype.kind)
    value = obj.item() if kind is not None else None
    if kind is None or type(value) is not kind:  # e.g. longdouble.item() stays numpy
        raise CodecError(
            f"numpy scalar at {where} has type {type(obj).__qualname__}, which snapshots "
            "cannot store"
        )
    return {"ns": [obj.dtype.str, value]}


# Where a decoded tensor was captured from, when not the host: set on the tensor that
# ``tensor_at`` returned (a fresh view of the snapshot buffer), see recorded_device().
_DEVICE_ATTR = "_checkpointless_device"


def recorded_device(tensor: torch.Tensor) -> torch.device | None:
    """The device ``tensor`` lived on when it was captured, if not the host.

    A snapshot holds every tensor's bytes on the host, so a decoded tensor is a host
    view; the skeleton records each device tensor's device (tag ``td``; host tensors
    keep the plain ``t`` of every earlier snapshot, so their skeletons, and their
    checksums, are unchanged), and the decoder hangs it on the view. A restore puts
    the tensors of objects that do not load in place back there
    (:meth:`replication.training_state.state.TrainingState.restore`).
    """
    return getattr(tensor, _DEVICE_ATTR, None)


def decode(data: Any, tensor_at: Callable[[int], torch.Tensor]) -> Any:
    """Rebuild the tree from tagged data; ``tensor_at(i)`` supplies tensor ``i``.

    ``data`` may come from a damaged file or a faulty peer, so every tagged node is
    type-checked: anything malformed raises :class:`CodecError`, never another error.
    """
    try:
        return _decode(data, tensor_at)
    except RecursionError:
        raise CodecError("snapshot skeleton is nested too deeply") from None


_NONFINITE = ("nan", "inf", "-inf")  # the only strings the encoder writes under "f"


def _decode(data: Any, tensor_at: Callable[[int], torch.Tensor]) -> Any:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise _malformed(data)
    (tag, val), = data.items()
    if tag in ("D", "L", "T", "S", "set", "ns"):
        _require(isinstance(val, list), data)
    if tag == "t":
        return tensor_at(_index(val, data))
    if tag == "td":
        _require(isinstance(val, list) and len(val) == 2 and isinstance(val[1], str), data)
        try:
            device = torch.device(val[1])
        except (RuntimeError, ValueError, TypeError):
            raise _malformed(data) from None
        tensor = tensor_at(_index(val[0], data))
        setattr(tensor, _DEVICE_ATTR, device)
        return tensor
    if tag == "D":
        _require(all(isinstance(kv, list) and len(kv) == 2 for kv in val), data)
        return {
            _hashable(_decode(k, tensor_at), data): _decode(v, tensor_at) for k, v in val
        }
    if tag == "L":
        return [_decode(v, tensor_at) for v in val]
    if tag == "T":
        return tuple(_decode(v, tensor_at) for v in val)
    if tag == "set":
        return {_hashable(_decode(v, tensor_at), data) for v in val}
    if tag == "f":
        _require(isinstance(val, str) and val in _NONFINITE, data)
        return float(val)
    if tag == "dt":
        _require(isinstance(val, str), data)
        return dtype_from_name(val)
    if tag == "S":
        _require(all(_is_int(d) and 0 <= d < 2**63 for d in val), data)
        return torch.Size(val)
    if tag == "dev":
        _require(isinstance(val, str), data)
        try:
            return torch.device(val)
        except (RuntimeError, ValueError, TypeError):
            raise _malformed(data) from None
    if tag == "B":
        _require(isinstance(val, str), data)
        try:
            return base64.b64decode(val, validate=True)
        except ValueError:
            raise _malformed(data) from None
    if tag == "np" and np is not None:
        tensor = tensor_at(_index(val, data))
        try:
            return tensor.numpy().copy()
        except TypeError:  # a dtype numpy lacks (bfloat16): not written by the encoder
            raise _malformed(data) from None
    if tag == "ns" and np is not None:
        _require(len(val) == 2 and isinstance(val[0], str), data)
        try:
            dtype = np.dtype(val[0])
        except TypeError:
            raise _malformed(data) from None
        _require(type(val[1]) is _NP_SCALAR_KINDS.get(dtype.kind), data)
        try:
            return dtype.type(val[1])
        except (OverflowError, ValueError):
            raise _malformed(data) from None
    raise _malformed(data)


def _malformed(data: Any) -> CodecError:
    return CodecError(f"malformed snapshot skeleton node: {str(data)[:80]!r}")


def _require(ok: bool, data: Any) -> None:
    if not ok:
        raise _malformed(data)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _index(val: Any, data: Any) -> int:
    _require(_is_int(val), data)
    return val


def _hashable(key: Any, data: Any) -> Any:
    """Dict keys and set members must hash; a damaged skeleton may decode to a list."""
    try:
        hash(key)
    except TypeError:
        raise _malformed(data) from None
    return key


def dumps(data: Any) -> bytes:
    """Serialise encoded skeleton data compactly (floats round-trip exactly)."""
    try:
        return json.dumps(data, separators=(",", ":")).encode("utf-8")
    except (ValueError, RecursionError) as exc:  # ints past json's digit limit, deep trees
        raise CodecError(f"state cannot be written as a snapshot skeleton: {exc}") from None


def loads(raw: bytes) -> Any:
    """Parse bytes written by :func:`dumps`."""
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise CodecError(f"snapshot skeleton is not valid JSON: {exc!r}"[:200]) from None
