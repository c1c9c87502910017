"""Packing an agent's values into arrays: the fast path for lists and tuples gives the bytes
the general path gives, and refuses what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from engine.events.arrays import LogProbs, Mask, TokenIds


class _Ids(list[int]):
    """A list subclass: not the exact type the fast check looks for."""


@pytest.mark.parametrize(
    ("kind", "values"),
    [
        (TokenIds, [0, 1, 2**31 - 1, 7]),
        (TokenIds, (5, 6)),
        (TokenIds, _Ids([3, 4])),
        (LogProbs, [-0.5, 0.0, -1.25]),
        (Mask, (1, 0, 1)),
        (TokenIds, []),
    ],
)
def test_lists_and_tuples_pack_to_the_numpy_bytes(kind: type[TokenIds], values: list[int]) -> None:
    packed = kind._coerce(values)
    assert type(packed) is kind
    assert packed.data == np.asarray(list(values), dtype=kind.dtype).tobytes()
    assert packed == kind(np.asarray(list(values), dtype=kind.dtype).tobytes())


def test_values_the_fast_path_refuses_are_named() -> None:
    with pytest.raises(ValueError, match=r"TokenIds values must lie in"):
        TokenIds._coerce([2**31])
    with pytest.raises(ValueError, match="needs numbers"):
        TokenIds._coerce(("a", "b"))
    assert TokenIds._coerce([1.0, 2.0]).tolist() == [1, 2]  # integral floats are accepted
