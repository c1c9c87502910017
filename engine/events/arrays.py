"""Packed token-level arrays carried inside events.

Token-level data is stored as little-endian packed bytes, never as lists of Python numbers:
token ids int32, logprobs float32 (SGLang returns float32 values, so this is lossless) and
masks uint8. On the wire each array is one msgpack ext value (see ``codec.py``), so a
64k-token trajectory costs one memcpy, not 64k msgpack integers.

The classes are immutable; ``tolist()``, ``numpy()`` (a read-only zero-copy view) and
``torch()`` give the usual views. Pydantic fields typed with them accept an instance,
a list / tuple of numbers, a numpy array or raw bytes of the right width. An array equals
another of its class with the same bytes, and a list / tuple / numpy array that packs to
those bytes (so ``ids == (1, 2)`` reads as it should; hashes agree only between arrays).
Indexing gives a Python number, slicing an array of the same class.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import numpy as np
from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

if TYPE_CHECKING:
    import torch


class PackedArray:
    """An immutable 1-d array of one fixed dtype, stored as little-endian bytes."""

    __slots__ = ("_data",)
    dtype: ClassVar[np.dtype[Any]]
    itemsize: ClassVar[int]
    typecode: ClassVar[str]  # the ``array`` module's code for ``dtype``
    ext_code: ClassVar[int]

    def __init__(self, data: bytes) -> None:
        if len(data) % self.itemsize:
            raise ValueError(
                f"{type(self).__name__}: {len(data)} bytes is not a multiple of "
                f"{self.itemsize} ({self.dtype.name})"
            )
        self._data = data if type(data) is bytes else bytes(data)

    @classmethod
    def from_values(cls, values: Iterable[float] | Iterable[int] | np.ndarray[Any, Any]) -> Self:
        kind = type(values)
        if kind is list or kind is tuple or isinstance(values, list | tuple):
            # The common case (an agent's lists): the C array module packs and range-checks
            # in one pass, twice as fast as numpy's type inference; anything it refuses
            # (integral floats, out-of-range values) takes the numpy path, which accepts
            # or names the problem.
            try:
                native = array.array(cls.typecode, values)
            except (TypeError, OverflowError):
                pass
            else:
                if _SWAP:
                    native.byteswap()
                adopted = _new(cls)
                adopted._data = native.tobytes()  # whole items by construction
                return adopted
        if isinstance(values, np.ndarray):
            arr = values
        else:
            arr = np.asarray(values if isinstance(values, list | tuple) else list(values))
        if arr.ndim != 1:
            raise ValueError(f"{cls.__name__} needs a 1-d sequence, got shape {arr.shape}")
        if arr.dtype == cls.dtype:
            return cls(arr.tobytes())
        if arr.size and arr.dtype.kind not in "biuf":
            raise ValueError(f"{cls.__name__} needs numbers, got dtype {arr.dtype}")
        packed = arr.astype(cls.dtype)
        # An integer class must hold every value exactly: a value that does not survive the
        # cast (out of range, fractional, not finite) is refused, with the reason.
        if arr.size and cls.dtype.kind in "iu" and not np.array_equal(packed, arr):
            if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.round(arr))):
                raise ValueError(f"{cls.__name__} needs integers, got non-integral values")
            info = np.iinfo(cls.dtype)
            raise ValueError(
                f"{cls.__name__} values must lie in [{info.min}, {info.max}], "
                f"got [{arr.min()}, {arr.max()}]"
            )
        return cls(packed.tobytes())

    @classmethod
    def empty(cls) -> Self:
        empty = _new(cls)
        empty._data = b""
        return empty

    @property
    def data(self) -> bytes:
        return self._data

    def __len__(self) -> int:
        return len(self._data) // self.itemsize

    def numpy(self) -> np.ndarray[Any, Any]:
        """A read-only zero-copy view."""
        return np.frombuffer(self._data, dtype=self.dtype)

    def tolist(self) -> list[Any]:
        out: list[Any] = self.numpy().tolist()
        return out

    def torch(self) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.numpy().copy())

    def __iter__(self) -> Any:
        return iter(self.tolist())

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return type(self)(self.numpy()[index].tobytes())
        return self.numpy()[index].item()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return type(self) is type(other) and self._data == other._data
        if isinstance(other, list | tuple | np.ndarray):
            try:
                return self._data == type(self).from_values(other)._data
            except (ValueError, TypeError, OverflowError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._data))

    def __repr__(self) -> str:
        values = self.tolist()
        shown = values if len(values) <= 8 else [*values[:4], "...", *values[-2:]]
        return f"{type(self).__name__}(n={len(values)}, {shown})"

    @classmethod
    def _coerce(cls, value: Any) -> Self:
        kind = type(value)
        if kind is list or kind is tuple:  # an agent's values: checked first, the common case
            return cls.from_values(value)
        if isinstance(value, cls):
            return value
        if isinstance(value, PackedArray):
            raise ValueError(f"expected {cls.__name__}, got {type(value).__name__}")
        if isinstance(value, bytes | bytearray | memoryview):
            return cls(bytes(value))
        if isinstance(value, np.ndarray | list | tuple):
            return cls.from_values(value)
        raise ValueError(f"expected {cls.__name__}, a list of numbers or bytes, got {type(value)}")

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # An instance (what the codec hands over) is accepted by a check in pydantic-core;
        # anything else (lists, numpy arrays, raw bytes from user code) is coerced.
        return core_schema.union_schema(
            [
                core_schema.is_instance_schema(cls),
                core_schema.no_info_plain_validator_function(cls._coerce),
            ],
            mode="left_to_right",
            serialization=core_schema.plain_serializer_function_ser_schema(
                _serialize, info_arg=True
            ),
        )


def _serialize(value: PackedArray, info: core_schema.SerializationInfo) -> Any:
    # Python dumps keep the packed object (the codec turns it into a msgpack ext);
    # JSON dumps (summaries, tail output) get a plain list.
    return value if info.mode == "python" else value.tolist()


class TokenIds(PackedArray):
    """int32 token ids."""

    __slots__ = ()
    dtype = np.dtype("<i4")
    itemsize = dtype.itemsize
    typecode = "i"
    ext_code = 1


class LogProbs(PackedArray):
    """float32 log-probabilities."""

    __slots__ = ()
    dtype = np.dtype("<f4")
    itemsize = dtype.itemsize
    typecode = "f"
    ext_code = 2


class Mask(PackedArray):
    """uint8 0/1 mask (loss masks, action masks)."""

    __slots__ = ()
    dtype = np.dtype("u1")
    itemsize = dtype.itemsize
    typecode = "B"
    ext_code = 3


EXT_TYPES: dict[int, type[PackedArray]] = {c.ext_code: c for c in (TokenIds, LogProbs, Mask)}
_SWAP = sys.byteorder != "little"
assert all(array.array(c.typecode).itemsize == c.dtype.itemsize for c in EXT_TYPES.values())

_ITEMSIZE: dict[type[PackedArray], int] = {c: c.dtype.itemsize for c in EXT_TYPES.values()}
_new = object.__new__


def from_wire(kind: type[PackedArray], data: bytes) -> PackedArray:
    """``kind(data)`` for the decoders' hot path: ``data`` is already an immutable
    ``bytes``, so it is checked and adopted without the constructor's generic path."""
    size = _ITEMSIZE.get(kind)
    if size is None or type(data) is not bytes:
        return kind(data)
    if len(data) % size:
        kind(data)  # raises the constructor's error, naming the class and the length
    array: PackedArray = _new(kind)
    array._data = data
    return array


_P = TypeVar("_P", bound=PackedArray)


def concat(parts: Sequence[_P]) -> _P:
    """Concatenate arrays of one class."""
    if not parts:
        raise ValueError("concat needs at least one array")
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        raise ValueError("concat needs arrays of one class")
    return kind(b"".join(p.data for p in parts))


# ---------------------------------------------------------------- compact wire form
#
# A field an event class lists in ``compact_arrays`` travels in a compact, lossless form
# (issue 16: bytes per stored token). The wire value is one tag byte, then the body:
#
# * ``0``: the raw little-endian bytes (what a plain array field holds);
# * ``1``: a 0/1 ``Mask`` as bits, least significant first: one byte saying how many bits
#   of the last byte are padding, then ``ceil(n / 8)`` bytes;
# * ``2``: ``TokenIds`` all in ``[0, 65535]`` as uint16;
# * ``3``: ``TokenIds`` all in ``[0, 2**24 - 1]`` as 3 little-endian bytes each (every
#   vocabulary in use is below 16.7M tokens).
#
# Arrays under ``COMPACT_MIN_BYTES`` raw bytes keep the raw form: packing them saves a few
# bytes and costs more CPU than it saves memory (a 16-token response is dominated by the
# event's other fields).

COMPACT_MIN_BYTES = 256
_RAW, _BITS, _U16, _U24 = 0, 1, 2, 3
_BINARY = bytes(range(2))


def to_compact(array: PackedArray) -> bytes:
    """The compact wire value of ``array`` (see above)."""
    data = array._data
    if len(data) >= COMPACT_MIN_BYTES:
        kind = type(array)
        if kind is Mask:
            if not data.translate(None, _BINARY):  # only 0 and 1
                n = len(data)
                bits = np.packbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
                return bytes((_BITS, -n % 8)) + bits.tobytes()
        elif kind is TokenIds:
            values = np.frombuffer(data, dtype="<i4")
            low, high = int(values.min()), int(values.max())
            if low >= 0 and high < 1 << 16:
                return bytes((_U16,)) + values.astype("<u2").tobytes()
            if low >= 0 and high < 1 << 24:
                triples = np.frombuffer(data, dtype=np.uint8).reshape(-1, 4)[:, :3]
                return bytes((_U24,)) + triples.tobytes()
    return bytes((_RAW,)) + data


def from_compact(kind: type[_P], wire: bytes) -> _P:
    """The array a compact wire value holds; ``ValueError`` naming what is wrong."""
    if not wire:
        raise ValueError(f"{kind.__name__}: an empty compact value (it needs its tag byte)")
    tag, body = wire[0], wire[1:]
    if tag == _RAW:
        out: _P = from_wire(kind, body)  # type: ignore[assignment]
        return out
    if tag == _BITS and kind is Mask:
        if not body or body[0] > 7 or (body[0] and len(body) == 1):
            raise ValueError(f"Mask: bad bit padding in a compact value of {len(wire)} bytes")
        n = (len(body) - 1) * 8 - body[0]
        bits = np.unpackbits(
            np.frombuffer(body, dtype=np.uint8, offset=1), count=n, bitorder="little"
        )
        return kind(bits.tobytes())
    if tag == _U16 and kind is TokenIds:
        if len(body) % 2:
            raise ValueError(f"TokenIds: {len(body)} bytes is not a multiple of 2 (uint16)")
        return kind(np.frombuffer(body, dtype="<u2").astype("<i4").tobytes())
    if tag == _U24 and kind is TokenIds:
        if len(body) % 3:
            raise ValueError(f"TokenIds: {len(body)} bytes is not a multiple of 3 (uint24)")
        wide = np.zeros((len(body) // 3, 4), dtype=np.uint8)
        wide[:, :3] = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3)
        return kind(wide.tobytes())
    raise ValueError(f"{kind.__name__}: unknown compact form (tag {tag})")


def compact_size(kind: type[PackedArray], wire: bytes) -> int:
    """``len(from_compact(kind, wire))`` without building the array, refusing (with a
    ``ValueError``) exactly what :func:`from_compact` refuses: for a reader that needs only
    an array's length (the finalizer's fold of a ``SampleCompleted``)."""
    if not wire:
        raise ValueError(f"{kind.__name__}: an empty compact value (it needs its tag byte)")
    tag, n = wire[0], len(wire) - 1
    if tag == _RAW:
        size = kind.dtype.itemsize
        if n % size:
            kind(wire[1:])  # raises the constructor's error, naming the class and the length
        return n // size
    if tag == _BITS and kind is Mask:
        pad = wire[1] if n else 8
        if pad > 7 or (pad and n == 1):
            raise ValueError(f"Mask: bad bit padding in a compact value of {len(wire)} bytes")
        return (n - 1) * 8 - pad
    if tag == _U16 and kind is TokenIds:
        if n % 2:
            raise ValueError(f"TokenIds: {n} bytes is not a multiple of 2 (uint16)")
        return n // 2
    if tag == _U24 and kind is TokenIds:
        if n % 3:
            raise ValueError(f"TokenIds: {n} bytes is not a multiple of 3 (uint24)")
        return n // 3
    raise ValueError(f"{kind.__name__}: unknown compact form (tag {tag})")
