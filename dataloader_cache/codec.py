"""A small, safe, checksummed serialization format for batches and samples.

Why not pickle: cache files live in a node-shared directory that outlives the process that
wrote them, and a replacement worker reads what a dead one wrote. Unpickling such a file
would execute whatever it names. This codec only knows tensors, numpy arrays, python
scalars, strings, bytes and nested ``dict``/``list``/``tuple`` of them, so reading a cache
entry can never run code, and anything else fails loudly at write time with a
:class:`TypeError` naming the offending type and where it sits in the batch.

Frame layout (little endian)::

    prefix   32 bytes  magic "CKLC", version u16, flags u16, header_len u32,
                       payload_len u64, xxh3_64 checksum u64, 4 bytes padding
    header   header_len bytes of UTF-8 JSON describing the tree (dtypes, shapes, offsets)
    pad      to a multiple of 64 bytes
    payload  payload_len bytes: raw tensor/array/bytes data, each buffer 64-byte aligned

The checksum covers everything after the prefix, and the total length must match the
prefix exactly, so a truncated (partially written) or bit-flipped frame is reported as
:class:`CorruptEntryError` and never decoded into something the model would consume.

Decoding is zero-copy with respect to the frame: tensors and arrays are views into the
(writable) buffer the frame was read into, so reading an entry costs one read plus one
hash pass.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import torch
import xxhash

from replication.errors import CheckpointlessError

MAGIC = b"CKLC"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIQQ4x")
PREFIX_SIZE = _PREFIX.size  # 32

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dt
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NP_KINDS = frozenset("biufcmM")  # bool, ints, uints, floats, complex, timedelta, datetime
_SCALARS = (bool, int, float, str, type(None))

SUPPORTED = (
    "torch.Tensor (dense, strided), numpy.ndarray / numpy scalar (numeric), bool, int, "
    "float, str, bytes, None, and dict/list/tuple of these"
)


class CorruptEntryError(CheckpointlessError, ValueError):
    """A frame failed validation (truncated, wrong magic, bad checksum, bad header)."""


@dataclass
class Frame:
    """An encoded object: a list of buffers whose concatenation is the frame.

    Kept as parts (not one ``bytes``) so a multi-megabyte batch is hashed and written
    straight from the tensors' memory without an intermediate copy.
    """

    parts: list[bytes | memoryview]
    nbytes: int

    def write(self, f: BinaryIO) -> None:
        """Write the frame to an open binary file."""
        for part in self.parts:
            f.write(part)

    def tobytes(self) -> bytes:
        """The frame as one ``bytes`` object (used to ship it between processes)."""
        return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in self.parts)


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _type_name(obj: Any) -> str:
    t = type(obj)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self.offset = 0

    def _add(self, mv: memoryview) -> tuple[int, int]:
        off = self.offset
        n = mv.nbytes
        self.buffers.append(mv)
        self.offset += n + _pad(n)
        return off, n

    def node(self, obj: Any, path: str) -> dict[str, Any]:
        t = type(obj)
        if t in _SCALARS:
            return {"T": "v", "v": obj}
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj, path, "n")
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return self._ndarray(np.asarray(obj), path, "ns")
        if t is bytes or t is bytearray:
            off, n = self._add(memoryview(bytes(obj)))
            return {"T": "b", "o": off, "n": n}
        if t is list or t is tuple:
            return {
                "T": "l" if t is list else "u",
                "c": [self.node(v, f"{path}[{i}]") for i, v in enumerate(obj)],
            }
        if t is dict:
            keys, vals = [], []
            for k, v in obj.items():
                if type(k) not in _SCALARS:
                    raise TypeError(
                        f"dataloader_cache codec: dict key of type {_type_name(k)} at {path} "
                        "is not supported (keys must be str, int, float, bool or None)"
                    )
                keys.append(k)
                vals.append(self.node(v, f"{path}[{k!r}]"))
            return {"T": "d", "k": keys, "c": vals}
        raise TypeError(
            f"dataloader_cache codec cannot serialize an object of type {_type_name(obj)} at "
            f"{path}; supported: {SUPPORTED}. Convert it in the dataset or collate_fn "
            "(pickle is deliberately not used: cache files are shared between processes)."
        )

    def _tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        if t.layout != torch.strided:
            raise TypeError(
                f"dataloader_cache codec: tensor with layout {t.layout} at {path} is not "
                "supported (only dense strided tensors)"
            )
        name = str(t.dtype).removeprefix("torch.")
        if t.is_quantized or name not in _TORCH_DTYPES:
            raise TypeError(f"dataloader_cache codec: tensor dtype {t.dtype} at {path}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        off, n = self._add(memoryview(raw))
        return {"T": "t", "d": name, "s": list(t.shape), "o": off, "n": n}

    def _ndarray(self, a: np.ndarray, path: str, tag: str) -> dict[str, Any]:
        if a.dtype.kind not in _NP_KINDS or a.dtype.fields is not None:
            raise TypeError(
                f"dataloader_cache codec: numpy dtype {a.dtype} at {path} is not supported "
                "(only numeric, bool and datetime dtypes)"
            )
        shape = list(a.shape)  # ascontiguousarray would turn a 0-d array into 1-d
        raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        off, n = self._add(memoryview(raw))
        return {"T": tag, "d": a.dtype.str, "s": shape, "o": off, "n": n}


def encode(obj: Any) -> Frame:
    """Encode ``obj`` into a checksummed frame; :class:`TypeError` for unsupported types."""
    enc = _Encoder()
    tree = enc.node(obj, "batch")
    header = json.dumps(tree, separators=(",", ":")).encode()
    hpad = b"\0" * _pad(PREFIX_SIZE + len(header))
    payload_len = enc.offset
    body: list[bytes | memoryview] = [header, hpad]
    for mv in enc.buffers:
        body.append(mv)
        if p := _pad(mv.nbytes):
            body.append(b"\0" * p)
    h = xxhash.xxh3_64()
    for part in body:
        h.update(part)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header), payload_len, h.intdigest())
    nbytes = PREFIX_SIZE + len(header) + len(hpad) + payload_len
    return Frame([prefix, *body], nbytes)


def frame_length(prefix: bytes | bytearray | memoryview) -> int:
    """Total frame size announced by a prefix (validates magic and version)."""
    if len(prefix) < PREFIX_SIZE:
        raise CorruptEntryError(f"truncated prefix ({len(prefix)} < {PREFIX_SIZE} bytes)")
    magic, version, _flags, hlen, plen, _ck = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptEntryError(f"bad magic {magic!r}")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported codec version {version}")
    start = PREFIX_SIZE + hlen
    return start + _pad(start) + plen


def decode(buf: bytearray | memoryview | bytes) -> Any:
    """Verify and decode a frame. Raises :class:`CorruptEntryError` on any mismatch.

    Pass a ``bytearray`` (or a writable memoryview) so the returned tensors are writable
    views of it; a read-only ``bytes`` is copied first.
    """
    if isinstance(buf, bytes):
        buf = bytearray(buf)
    mv = memoryview(buf)
    total = frame_length(mv[:PREFIX_SIZE])
    if mv.nbytes != total:
        raise CorruptEntryError(f"frame length {mv.nbytes} != announced {total} (partial write?)")
    _magic, _v, _f, hlen, _plen, checksum = _PREFIX.unpack_from(mv, 0)
    if xxhash.xxh3_64_intdigest(mv[PREFIX_SIZE:]) != checksum:
        raise CorruptEntryError("checksum mismatch")
    start = PREFIX_SIZE + hlen
    try:
        tree = json.loads(bytes(mv[PREFIX_SIZE:start]))
        return _Decoder(buf, start + _pad(start)).node(tree)
    except CorruptEntryError:
        raise
    except (ValueError, KeyError, TypeError, IndexError) as e:  # pragma: no cover - codec bug
        raise CorruptEntryError(f"malformed header: {e}") from e


class _Decoder:
    def __init__(self, buf: bytearray | memoryview, data_start: int) -> None:
        self.buf = buf
        self.start = data_start

    def node(self, n: dict[str, Any]) -> Any:
        tag = n["T"]
        if tag == "v":
            return n["v"]
        if tag == "t":
            return self._tensor(n)
        if tag in ("n", "ns"):
            dt = np.dtype(n["d"])
            if dt.kind not in _NP_KINDS:
                raise CorruptEntryError(f"numpy dtype {dt} not allowed")
            count = n["n"] // dt.itemsize if dt.itemsize else 0
            a = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.start + n["o"])
            a = a.reshape(n["s"])
            return a[()] if tag == "ns" else a
        if tag == "b":
            o = self.start + n["o"]
            return bytes(self.buf[o : o + n["n"]])
        if tag == "l":
            return [self.node(c) for c in n["c"]]
        if tag == "u":
            return tuple(self.node(c) for c in n["c"])
        if tag == "d":
            return dict(zip(n["k"], (self.node(c) for c in n["c"])))
        raise CorruptEntryError(f"unknown node tag {tag!r}")

    def _tensor(self, n: dict[str, Any]) -> torch.Tensor:
        dt = _TORCH_DTYPES.get(n["d"])
        if dt is None:
            raise CorruptEntryError(f"tensor dtype {n['d']!r} not allowed")
        shape = n["s"]
        if n["n"] == 0:
            return torch.empty(shape, dtype=dt)
        itemsize = dt.itemsize
        t = torch.frombuffer(
            self.buf, dtype=dt, count=n["n"] // itemsize, offset=self.start + n["o"]
        )
        return t.reshape(shape)
