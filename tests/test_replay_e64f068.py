"""An archive written by e64f068 (before the issue-10 redesign) replays byte-identically.

``tests/fixtures/e64f068`` holds what ``rollout demo`` wrote at that commit: the archives of
its training and eval rollouts, the artifacts the live finalizer wrote, and the digests of
the tensors ``collate`` built from the samples loaded from the log. Replaying the archives
with today's code must give the same files, byte for byte, and the same tensors; an event
schema that changes has to upcast the old versions so that this stays true.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine.client import collate
from engine.ops import cli
from engine.ops.replay import decode_entries, read_archive, replay_state
from engine.projections.samples import trainer_samples

FIXTURES = Path(__file__).parent / "fixtures" / "e64f068"
ARTIFACTS = ["summary.json", "samples.jsonl", "eval_details.jsonl", "placement.jsonl"]


@pytest.mark.parametrize("name", ["train", "eval"])
def test_replay_of_an_e64f068_archive_is_byte_identical(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = FIXTURES / f"{name}.rollout"
    rollout_id = read_archive(archive).rollout_id
    out = tmp_path / "replay"
    assert cli.main(["replay", rollout_id, "--from", str(archive), "--out", str(out)]) == 0
    for artifact in ARTIFACTS:
        expected = (FIXTURES / name / artifact).read_bytes()
        assert (out / artifact).read_bytes() == expected, f"{name}/{artifact} differs"


@pytest.mark.parametrize("name", ["train", "eval"])
def test_samples_loaded_from_an_e64f068_archive_collate_to_the_same_tensors(name: str) -> None:
    expected = json.loads((FIXTURES / "collate.json").read_text())[name]
    archive = read_archive(FIXTURES / f"{name}.rollout")
    envelopes, _undecodable = decode_entries(archive.stream, archive.entries)
    samples = trainer_samples(replay_state(envelopes))
    assert len(samples) == expected["n_samples"]
    batch = collate(samples)
    # e64f068 recorded no weight versions: every token of its samples is of unknown version
    # (-1); the tensor came after it, as did ``stale``; the others are held to its digests.
    versions = batch.pop("token_versions")
    assert versions.shape == batch["tokens"].shape and bool((versions == -1).all())
    # Nor had it a staleness policy that keeps stale samples: none of its samples is one.
    stale = batch.pop("stale")
    assert stale.shape == batch["rewards"].shape and not bool(stale.any())
    got = {
        key: {
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "sha256": hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest(),
        }
        for key, t in sorted(batch.items())
    }
    assert got == expected["tensors"]
