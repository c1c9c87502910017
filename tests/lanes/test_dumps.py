"""The analysis dumps: they load back with torch.load, and a dump that cannot be written is
logged without failing the rollout."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from engine.actors.dumps import DumpConfig, write_dumps
from engine.events.catalog import RolloutKind
from engine.projections.lanes import TEACHER_SENTINEL
from tests.lanes.test_lanes import MIXED_TURNS
from tests.lanes.trajectories import request, state_of


def test_the_opd_dump_holds_the_pair_the_k3_estimator_consumes(tmp_path: Path) -> None:
    state = state_of(
        request("r1", "opd", 2), [MIXED_TURNS, [("s", 3)]], teacher=True, ready=["r1:s0", "r1:s1"]
    )
    (path,) = write_dumps(state, DumpConfig(distill_dir=tmp_path / "opd"))
    assert path == tmp_path / "opd" / "iter_000002-r1.pt"
    dump = torch.load(path)
    assert dump["sample_ids"] == ["r1:s0", "r1:s1"] and dump["algorithm"] == "opd"
    assert dump["teacher_log_probs"].shape == dump["rollout_log_probs"].shape == (2, 8)
    assert dump["response_lengths"].tolist() == [8, 3]
    assert dump["teacher_log_probs"][1].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, 0, 0, 0])
    assert dump["rollout_log_probs"][0, 3].item() == pytest.approx(-0.04)
    assert dump["action_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert [p.name for p in (tmp_path / "opd").iterdir()] == [path.name]  # no temp file left


def test_the_mixed_dump_holds_the_sentinel_and_the_original_is_teacher_mask(
    tmp_path: Path,
) -> None:
    state = state_of(request("r2", "mixed_ce_k3", 1), [MIXED_TURNS], teacher=True, ready=["r2:s0"])
    config = DumpConfig(distill_dir=tmp_path / "opd", mixed_dir=tmp_path / "mixed")
    (path,) = write_dumps(state, config)
    assert path.parent == tmp_path / "mixed" and not (tmp_path / "opd").exists()
    dump = torch.load(path)
    teacher = dump["teacher_log_probs"][0]
    is_teacher = dump["is_teacher_mask"][0]
    assert is_teacher.tolist() == [1, 1, 0, 0, 0, 0, 1, 0]
    assert teacher[is_teacher.bool()].eq(TEACHER_SENTINEL).all()
    assert teacher[~is_teacher.bool()].le(0).all()
    assert dump["loss_mask"][0].tolist() == [1, 1, 0, 1, 1, 0, 1, 0]


def test_the_student_dump_writes_one_file_per_eval_sample_and_a_manifest(tmp_path: Path) -> None:
    req = request("ev", "grpo", 2, kind=RolloutKind.EVAL)
    state = state_of(req, [[("s", 2)], [("s", 1), ("o", 1), ("s", 1)]], ready=["ev:s0", "ev:s1"])
    written = write_dumps(state, DumpConfig(student_dir=tmp_path / "student"))
    folder = tmp_path / "student" / "iter_000002"
    assert sorted(p.name for p in written) == ["ev_s0.pt", "ev_s1.pt", "manifest.json"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert [e["file"] for e in manifest["samples"]] == ["ev_s0.pt", "ev_s1.pt"]
    one = torch.load(folder / manifest["samples"][1]["file"])
    assert one["tokens"].tolist() == [1, 2, 3, 100, 101, 102]
    assert one["loss_mask"].tolist() == [1, 0, 1] and one["prompt_length"] == 3
    assert one["reward"] == 1.0 and one["rollout_log_probs"].shape == (3,)
    # a training rollout is not dumped
    train = state_of(request("tr", "grpo", 1), [[("s", 2)]], ready=["tr:s0"])
    assert write_dumps(train, DumpConfig(student_dir=tmp_path / "student")) == []


def test_a_dump_dir_that_cannot_be_made_is_logged_and_the_others_still_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the dump directory should be")
    req = request("ev", "opd", 1, kind=RolloutKind.EVAL)
    state = state_of(req, [MIXED_TURNS], teacher=True, ready=["ev:s0"])
    config = DumpConfig(distill_dir=blocker / "opd", student_dir=tmp_path / "student")
    with caplog.at_level(logging.WARNING, logger="engine.actors.dumps"):
        written = write_dumps(state, config)
    assert [p.name for p in written] == ["ev_s0.pt", "manifest.json"]
    assert "OPD discrepancy dump of rollout ev failed" in caplog.text
    assert blocker.read_text().startswith("a file")
