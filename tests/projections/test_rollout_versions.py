"""The rollout fold's count of sampled tokens per weight version (``rollout.versions_of``).

Its byte-level shortcut for one version throughout must give exactly what the numpy
reference gives, and refuse what numpy refuses (arrays of different lengths)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.events import LogProbs, Mask, SampleCompleted, TokenIds
from engine.projections.rollout import UNKNOWN_VERSION, versions_of


def _done(mask: list[int], versions: list[int]) -> SampleCompleted:
    n = len(mask)
    return SampleCompleted(
        rollout_id="r", sample_id="r:s0", prompt_ids=TokenIds.empty(),
        response_ids=TokenIds.from_values(list(range(n))),
        logprobs=LogProbs.from_values([-0.5] * n), loss_mask=Mask.from_values(mask),
        token_versions=TokenIds.from_values(versions),
    )


def _versions(done: SampleCompleted) -> tuple[tuple[int, int], ...]:
    return versions_of(done.loss_mask.data, done.token_versions.data)


def _reference(mask: list[int], versions: list[int]) -> tuple[tuple[int, int], ...]:
    sampled = np.asarray(mask, dtype=np.uint8).astype(bool)
    if not versions:
        n = int(np.count_nonzero(sampled))
        return ((UNKNOWN_VERSION, n),) if n else ()
    kept = np.asarray(versions, dtype=np.int64)[sampled]
    values, counts = np.unique(kept, return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist(), strict=True))


def test_versions_match_the_numpy_reference_on_varied_trajectories() -> None:
    rng = random.Random(7)
    shortcut = 0
    for _ in range(600):
        n = rng.randrange(0, 12)
        mask = [rng.choice([0, 1, 1, 2, 255]) for _ in range(n)]
        kind = rng.random()
        if kind < 0.2:
            versions: list[int] = []
        elif kind < 0.6:  # one version throughout (negative and large ones too)
            v = rng.choice([-1, 0, 3, 70_000, -(2**31), 2**31 - 1])
            versions = [v] * n
            shortcut += n > 0
        else:
            versions = [rng.choice([-1, 0, 1, 2, 2**20]) for _ in range(n)]
        assert _versions(_done(mask, versions)) == _reference(mask, versions), (mask, versions)
    assert shortcut > 100


def test_versions_of_a_different_length_are_refused_as_before() -> None:
    with pytest.raises(IndexError):
        _versions(_done([1, 1, 0], [4, 4]))
    with pytest.raises(IndexError):
        _versions(_done([0], [4, 4]))
    assert _versions(_done([], [4])) == ()  # numpy's empty index of a 1-long array
