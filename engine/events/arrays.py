"""Packed token-level arrays carried inside events.

Token-level data is stored as little-endian packed bytes, never as lists of Python numbers:
token ids int32, logprobs float32 (SGLang returns float32 values, so this is lossless) and
masks uint8. On the wire each array is one msgpack bin or ext value (see ``codec.py``), so a
64k-token trajectory costs one memcpy, not 64k msgpack integers.

The classes are immutable; ``tolist()``, ``numpy()`` (a read-only zero-copy view) and
``torch()`` give the usual views. Pydantic fields typed with them accept an instance,
a list / tuple of numbers, a numpy array or raw bytes of the right width. An array equals
another of its class with the same values, and a list / tuple / numpy array that packs to
those bytes (so ``ids == (1, 2)`` reads as it should; hashes agree only between arrays).
Indexing gives a Python number, slicing an array of the same class.

An array read from a compact wire value (below) is lazy: it holds the wire bytes and
expands them on first use of its values; ``len()``, equality with another array read from
the same wire bytes and re-encoding need no expansion.
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
    """An immutable 1-d array of one fixed dtype, stored as little-endian bytes.

    ``_data`` holds the bytes, unset while a lazy array is not expanded; ``_wire`` holds the
    compact wire value a lazy array was read from (None for an array built from values)."""

    __slots__ = ("_data", "_wire")
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
        self._wire: bytes | None = None

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
                return _adopt(cls, native.tobytes())  # whole items by construction
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
        """The empty array of this class (one shared instance: arrays are immutable)."""
        empty = _EMPTY.get(cls)
        if empty is None:
            empty = _EMPTY[cls] = _adopt(cls, b"")
        return empty  # type: ignore[return-value]

    @property
    def data(self) -> bytes:
        """The little-endian bytes (a lazy array expands its wire value once, here)."""
        try:
            return self._data
        except AttributeError:  # lazy, not expanded yet
            data = self._data = _expand(self._wire)
            return data

    def __len__(self) -> int:
        wire = self._wire
        return len(self._data) // self.itemsize if wire is None else _compact_len(wire)

    def numpy(self) -> np.ndarray[Any, Any]:
        """A read-only zero-copy view."""
        return np.frombuffer(self.data, dtype=self.dtype)

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
            if type(self) is not type(other):
                return False
            wire = self._wire
            if wire is not None and wire == other._wire:  # one wire value holds one array
                return True
            return len(self) == len(other) and self.data == other.data
        if isinstance(other, list | tuple | np.ndarray):
            try:
                return self.data == type(self).from_values(other).data
            except (ValueError, TypeError, OverflowError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.data))

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

_new = object.__new__
_P = TypeVar("_P", bound=PackedArray)
_EMPTY: dict[type[PackedArray], PackedArray] = {}


def _adopt(kind: type[_P], data: bytes) -> _P:
    """An array of ``kind`` holding ``data`` (immutable bytes of whole items), unchecked."""
    adopted = _new(kind)
    adopted._data = data
    adopted._wire = None
    return adopted


def from_wire(kind: type[PackedArray], data: bytes) -> PackedArray:
    """``kind(data)`` for the decoders: immutable ``bytes`` are adopted, not copied."""
    if type(data) is not bytes or len(data) % kind.itemsize:
        return kind(data)  # copies, or raises the constructor's error naming the length
    return _adopt(kind, data) if data else kind.empty()


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
# A field an event class lists in ``compact_arrays`` travels in a compact, lossless form.
# The wire value is one tag byte, then the body:
#
# * ``0``: the raw little-endian bytes (what a plain array field holds);
# * ``1``: a 0/1 ``Mask`` as bits, least significant first: one byte saying how many bits
#   of the last byte are padding, then ``ceil(n / 8)`` bytes;
# * ``2``: ``TokenIds`` all in ``[0, 65535]`` as uint16;
# * ``3``: ``TokenIds`` all in ``[0, 2**24 - 1]`` as 3 little-endian bytes each (every
#   vocabulary in use is below 16.7M tokens).
#
# ``to_compact`` writes the smallest form that holds the values, and the raw form for
# arrays under ``COMPACT_MIN_BYTES`` raw bytes: packing those saves a few bytes and costs
# more CPU than it saves memory. Packing and expanding are a few C-level passes (bytes
# slicing with a step, numpy strided copies), with no Python loop over the values.
#
# Every malformed value (an empty one, an unknown tag, a tag for another class, a body
# whose length does not fit its tag, bad bit padding) is refused by ``from_compact``,
# which reads only the tag and the length; a value it accepts always expands. So a lazy
# array never fails after it was decoded.

COMPACT_MIN_BYTES = 256
_RAW, _BITS, _U16, _U24 = 0, 1, 2, 3
_BINARY = bytes(range(2))
_DIGITS = bytes((48, 49, *[50] * 254))  # 0 -> "0", 1 -> "1", anything else -> "2"
_DIGITS_MAX = 512
_ZEROS = bytes(1 << 16)
_ONES = b"\x01" * (1 << 16)
_FF = b"\xff" * (len(_ONES) >> 3)
_LOW_BITS = [bytes(((1 << k) - 1,)) if k else b"" for k in range(8)]  # a last, partial byte
_REVERSED = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))  # each byte's bits reversed
_BITS_HEAD = [bytes((_BITS, pad)) for pad in range(8)]
_V3 = np.dtype("V3")  # one 3-byte item: a token id's low three bytes
_U8 = np.dtype("u1")
_LE16 = np.dtype("<u2")


def to_compact(array: PackedArray) -> bytes:
    """The compact wire value of ``array`` (see above): the one it was read from when that
    is the form this function writes, so re-encoding a decoded array copies nothing."""
    wire = array._wire
    if wire is not None and _canonical(wire):
        return wire
    data = array.data
    size = len(data)
    if size >= COMPACT_MIN_BYTES:
        kind = type(array)
        if kind is Mask:
            bits = _mask_bits(data)
            if bits is not None:
                return _BITS_HEAD[-size % 8] + bits
        elif kind is TokenIds:
            # Every value in [0, 2**24) when no high byte is set; in [0, 2**16) when no
            # third byte is either (a set one among the first values says no at once).
            if _zeros(data[3::4]):
                if _zeros(data[2:128:4]) and _zeros(data[2::4]):
                    return b"\x02" + np.frombuffer(data, _LE16)[::2].tobytes()
                return b"\x03" + np.ndarray((size >> 2,), _V3, data, 0, (4,)).tobytes()
    return b"\x00" + data


def _zeros(data: bytes) -> bool:
    """Whether every byte of ``data`` is zero (a compare against zeros, without a copy)."""
    return _ZEROS.startswith(data) if len(data) <= len(_ZEROS) else not data.strip(b"\0")


def _mask_bits(data: bytes) -> bytes | None:
    """A mask's values as bits, least significant first; None unless every value is 0 or 1.

    A mask of ones only (every token sampled in one turn) is sliced from a buffer of set
    bits. Otherwise, up to a few hundred values, reading the values as binary digits (one
    translate, one int parse, the bits of each byte then reversed by a second translate) is
    quicker than numpy's set-up; beyond, ``packbits`` is."""
    size = len(data)
    if size <= len(_ONES) and _ONES.startswith(data):
        return _FF[: size >> 3] + _LOW_BITS[size & 7]
    if size <= _DIGITS_MAX:
        try:
            value = int(data.translate(_DIGITS), 2)  # a byte above 1 is no binary digit
        except ValueError:
            return None
        pad = -size % 8
        return (value << pad).to_bytes((size + 7) >> 3, "big").translate(_REVERSED)
    if data.translate(None, _BINARY):  # a value other than 0 and 1
        return None
    return np.packbits(np.frombuffer(data, _U8), None, "little").tobytes()


def _canonical(wire: bytes) -> bool:
    """Whether ``to_compact`` of the values a (well-formed, compact) ``wire`` holds gives
    ``wire`` back: the smallest form, for an array of at least ``COMPACT_MIN_BYTES``."""
    tag, size = wire[0], len(wire) - 1
    if tag == _BITS:
        pad = wire[1]
        return (size - 1) * 8 - pad >= COMPACT_MIN_BYTES and not wire[-1] >> (8 - pad)
    if tag == _U16:
        return size * 2 >= COMPACT_MIN_BYTES
    n = size // 3  # _U24: the smallest form only when some value needs its third byte
    return n * 4 >= COMPACT_MIN_BYTES and wire[3::3].count(0) < n


def _compact_len(wire: bytes) -> int:
    """The number of values a well-formed compact ``wire`` (tags 1-3) holds."""
    tag = wire[0]
    if tag == _BITS:
        return (len(wire) - 2) * 8 - wire[1]
    return (len(wire) - 1) // (2 if tag == _U16 else 3)


def _expand(wire: bytes | None) -> bytes:
    """The little-endian bytes a well-formed compact ``wire`` (tags 1-3) holds."""
    if wire is None:
        raise ValueError("an array with neither values nor a wire value")
    tag, n = wire[0], _compact_len(wire)
    if tag == _BITS:
        bits = np.frombuffer(wire, dtype=_U8, offset=2)
        return np.unpackbits(bits, count=n, bitorder="little").tobytes()
    if tag == _U16:
        return np.frombuffer(wire, dtype="<u2", count=n, offset=1).astype("<i4").tobytes()
    out = bytearray(4 * n)
    np.ndarray((n,), _V3, out, strides=(4,))[:] = np.ndarray((n,), _V3, wire, offset=1)
    return bytes(out)


def from_compact(kind: type[_P], wire: bytes) -> _P:
    """The array a compact wire value holds (lazy: expanded on first use of its values);
    ``ValueError`` naming what is wrong with a malformed one."""
    return wire_array(kind, wire if type(wire) is bytes else bytes(wire), True)


def _malformed(kind: type[PackedArray], wire: bytes) -> str:
    """What is wrong with ``wire``, a compact value of ``kind`` that is not well formed."""
    tag, size = (wire[0], len(wire) - 1) if wire else (-1, 0)
    if tag < 0:
        return f"{kind.__name__}: an empty compact value (it needs its tag byte)"
    if tag == _BITS and kind is Mask:
        return f"Mask: bad bit padding in a compact value of {len(wire)} bytes"
    if tag == _U16 and kind is TokenIds:
        return f"TokenIds: {size} bytes is not a multiple of 2 (uint16)"
    if tag == _U24 and kind is TokenIds:
        return f"TokenIds: {size} bytes is not a multiple of 3 (uint24)"
    return f"{kind.__name__}: unknown compact form (tag {tag})"


def wire_array(kind: type[_P], wire: bytes, compact: bool) -> _P:
    """The array of ``kind`` a field's wire bytes hold (the compiled decoder's hot path): raw
    bytes are adopted; a ``compact`` value is checked by its tag and length only, and becomes
    a lazy array (a raw-tagged one is adopted). ``ValueError`` naming what is wrong with a
    malformed value."""
    if compact:
        tag = wire[0] if wire else -1
        if tag:  # a compact form (or -1: an empty value); its tag and length fit
            size = len(wire) - 1
            if kind is TokenIds:
                ok = not size % 3 if tag == _U24 else tag == _U16 and not size % 2
            else:
                pad = wire[1] if size > 0 else 8
                ok = tag == _BITS and kind is Mask and pad < 8 and (size > 1 or not pad)
            if not ok:
                raise ValueError(_malformed(kind, wire))
            lazy = _new(kind)
            lazy._wire = wire
            return lazy
        wire = wire[1:]
    if not wire:
        empty = _EMPTY.get(kind)
        return kind.empty() if empty is None else empty  # type: ignore[return-value]
    if len(wire) % kind.itemsize:
        kind(wire)  # raises the constructor's error, naming the class and the length
    array = _new(kind)  # _adopt, inline: this runs for every array field decoded
    array._data = wire
    array._wire = None
    return array
