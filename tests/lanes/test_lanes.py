"""The lanes on hand-built trajectories: routing, the sentinel and masks per position, top-K
through collate, the CE cut points, the atomic drop, the shuffle and gbs_scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.actors.finalizer import decide_capture, decide_ready
from engine.client import TEACHER_ALGORITHMS, collate
from engine.errors import ConfigError
from engine.events.catalog import RolloutReady, SampleCompleted
from engine.events.codec import decode, encode
from engine.projections.lanes import (
    CE_ALGORITHMS,
    MIXED_ALGORITHMS,
    PER_TOKEN_ALGORITHMS,
    TEACHER_SENTINEL,
    Lane,
    ce_chunks,
    ce_order,
    lane_of,
    needs_teacher,
)
from engine.projections.samples import ce_plan, trainer_samples
from engine.sample import Sample
from tests.lanes.trajectories import PROMPT, completed, request, state_of

# teacher turn, observation, student turn, observation, teacher turn, observation
MIXED_TURNS = [("t", 2), ("o", 1), ("s", 2), ("o", 1), ("t", 1), ("o", 1)]


def test_every_algorithm_has_one_lane_and_the_client_captures_exactly_the_per_token_ones() -> (
    None
):
    assert lane_of("grpo") is Lane.PLAIN and lane_of("anything-else") is Lane.PLAIN
    assert {lane_of(a) for a in PER_TOKEN_ALGORITHMS} == {Lane.PER_TOKEN}
    assert {lane_of(a) for a in MIXED_ALGORITHMS} == {Lane.MIXED}
    assert {lane_of(a) for a in CE_ALGORITHMS} == {Lane.CE}
    assert TEACHER_ALGORITHMS == PER_TOKEN_ALGORITHMS | MIXED_ALGORITHMS
    assert not PER_TOKEN_ALGORITHMS & MIXED_ALGORITHMS & CE_ALGORITHMS
    # Routing is by algorithm: the mixed lane is captured even if the flag was not set, the
    # CE lane never is, and a plain request that asks for capture gets it.
    assert needs_teacher(request("r", "mixed_ce_k3", 1))
    assert not needs_teacher(request("r", "dagger_ce", 1, teacher_capture=True))
    assert needs_teacher(request("r", "grpo", 1, teacher_capture=True))
    assert not needs_teacher(request("r", "grpo", 1))


def test_sample_completed_v2_round_trips_and_v1_upcasts_to_no_rollin() -> None:
    done = completed("r", 0, MIXED_TURNS)
    again = decode(encode(done))
    assert isinstance(again, SampleCompleted)
    assert again.teacher_mask == [1, 1, 0, 0, 0, 0, 1, 0] and again.student_cut_points == [3]
    old = SampleCompleted(
        rollout_id="r", sample_id="r:s0", prompt_ids=[1], response_ids=[2], logprobs=[-0.1],
        loss_mask=[1],
    )
    import msgpack

    payload = msgpack.unpackb(encode(old), raw=False, ext_hook=_keep_ext)
    for name in ("teacher_mask", "student_cut_points"):
        payload.pop(name)
    for name in ("prompt_ids", "response_ids", "loss_mask"):  # v1 held them raw (v3: compact)
        payload[name] = getattr(old, name).data
    payload["v"] = 1
    v1 = decode(msgpack.packb(payload, use_bin_type=True))
    assert isinstance(v1, SampleCompleted)
    assert len(v1.teacher_mask) == 0 and v1.student_cut_points == []


def test_rollout_ready_v1_upcasts_to_no_scaling() -> None:
    import msgpack

    payload = msgpack.unpackb(
        encode(RolloutReady(rollout_id="r", sample_ids=["r:s0"], gbs_scale=2.5)),
        raw=False, ext_hook=_keep_ext,
    )
    payload.pop("gbs_scale")
    payload["v"] = 1
    v1 = decode(msgpack.packb(payload, use_bin_type=True))
    assert isinstance(v1, RolloutReady) and v1.gbs_scale == 1.0 and v1.sample_ids == ["r:s0"]


def _keep_ext(code: int, data: bytes) -> object:
    import msgpack

    return msgpack.ExtType(code, data)


@pytest.mark.parametrize("algorithm", ["mixed_ce_k3", "dagger_k3"])
def test_the_mixed_lane_writes_the_sentinel_and_keeps_the_is_teacher_mask(algorithm: str) -> None:
    state = state_of(request("r", algorithm, 1), [MIXED_TURNS], teacher=True, ready=["r:s0"])
    (s,) = trainer_samples(state)
    teacher = [TEACHER_SENTINEL, TEACHER_SENTINEL, -0.3, -0.4, -0.5, -0.6, TEACHER_SENTINEL, -0.8]
    assert np.allclose(s.teacher_log_probs.numpy(), teacher)  # type: ignore[union-attr]
    # positions:              t  t  o  s  s  o  t  o
    assert s.is_teacher_mask == [1, 1, 0, 0, 0, 0, 1, 0]
    assert s.action_mask == [0, 0, 0, 1, 1, 0, 0, 0]
    assert s.loss_mask == [1, 1, 0, 1, 1, 0, 1, 0]
    # the kernel's reading of the sign: > 0 is CE (teacher), <= 0 K3 (student), per position
    trained = s.loss_mask.numpy().astype(bool)
    ce = (s.teacher_log_probs.numpy() > 0) & trained  # type: ignore[union-attr]
    assert ce.tolist() == s.is_teacher_mask.numpy().astype(bool).tolist()  # type: ignore[union-attr]


@pytest.mark.parametrize("algorithm", ["opd", "k3", "distill"])
def test_the_per_token_lane_trains_student_actions_only(algorithm: str) -> None:
    state = state_of(request("r", algorithm, 1), [MIXED_TURNS], teacher=True, ready=["r:s0"])
    (s,) = trainer_samples(state)
    assert np.allclose(s.teacher_log_probs.numpy(), [-(i + 1) / 10 for i in range(8)])  # type: ignore[union-attr]
    assert s.loss_mask == s.action_mask == [0, 0, 0, 1, 1, 0, 0, 0]
    assert s.is_teacher_mask == [1, 1, 0, 0, 0, 0, 1, 0]
    assert s.teacher_top_k == 2 and len(s.teacher_topk_ids) == 16  # type: ignore[arg-type]


def test_top_k_ids_and_logprobs_reach_collate_aligned_with_tokens() -> None:
    req = request("r", "opd", 2)
    state = state_of(req, [MIXED_TURNS, [("s", 3)]], teacher=True, ready=["r:s0", "r:s1"])
    samples = [*trainer_samples(state), Sample.masked_dummy()]
    batch = collate(samples)
    b, t = batch["tokens"].shape
    assert (b, t) == (3, len(PROMPT) + 8)
    assert batch["teacher_topk_ids"].shape == (3, t, 2)
    assert batch["teacher_topk_ids"].dtype == torch.int64
    assert batch["teacher_topk_log_probs"].shape == (3, t, 2)
    assert batch["teacher_topk_log_probs"].dtype == torch.float32
    for name in ("teacher_log_probs", "action_mask", "is_teacher_mask"):
        assert batch[name].shape == (3, t), name
    p = len(PROMPT)
    # row 0: response token at position p + i is 100 + i, its top-K ids (100 + i, 101 + i)
    assert batch["teacher_topk_ids"][0, p + 3].tolist() == [103, 104]
    assert batch["teacher_topk_log_probs"][0, p + 3].tolist() == pytest.approx([-0.4, -1.4])
    assert batch["teacher_topk_ids"][0, :p].eq(0).all()  # the prompt carries nothing
    # row 1 is shorter: padding after its 3 response tokens is zero
    assert batch["teacher_topk_ids"][1, p : p + 3, 0].tolist() == [100, 101, 102]
    assert batch["teacher_topk_ids"][1, p + 3 :].eq(0).all()
    assert batch["action_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    # the masked dummy is zero everywhere and removed
    assert batch["remove_sample"].tolist() == [False, False, True]
    assert batch["teacher_topk_log_probs"][2].eq(0).all()
    assert torch.equal(batch["loss_mask"][0], batch["action_mask"][0])


def test_ce_cut_points_give_one_sub_sample_per_segment_with_teacher_tokens() -> None:
    # t t o | s s o t t o | s o   (cuts at the two student turns: 3 and 9)
    turns = [("t", 2), ("o", 1), ("s", 2), ("o", 1), ("t", 2), ("o", 1), ("s", 1), ("o", 1)]
    done = completed("r", 0, turns)
    assert done.student_cut_points == [3, 9]
    chunks = ce_chunks(done)
    # M = 2 student turns: up to 3 sub-samples; the last segment has no teacher token.
    assert [(c.chunk, c.start, c.end) for c in chunks] == [(0, 0, 2), (1, 3, 8)]
    state = state_of(request("r", "dagger_ce", 1), [turns], ready=["r:s0"])
    samples = sorted(trainer_samples(state), key=lambda s: s.sample_id)
    assert [s.sample_id for s in samples] == ["r:s0/ce0", "r:s0/ce1"]
    first, second = samples
    assert first.tokens == [*PROMPT, 100, 101] and first.loss_mask == [1, 1]
    assert second.tokens == [*PROMPT, *range(100, 108)]
    # only the segment's teacher tokens are trained; the first teacher turn is context now
    assert second.loss_mask == [0, 0, 0, 0, 0, 0, 1, 1]
    assert second.is_teacher_mask == [1, 1, 0, 0, 0, 0, 1, 1]
    assert second.rollout_log_probs == [-0.01 * (i + 1) for i in range(8)]
    assert second.metadata["parent_sample_id"] == "r:s0" and second.metadata["ce_chunk"] == 1
    assert second.teacher_log_probs is None and second.index == 0


def test_a_student_first_turn_and_teacher_only_or_student_only_trajectories() -> None:
    assert [(c.start, c.end) for c in ce_chunks(completed("r", 0, [("s", 2), ("t", 3)]))] == [
        (0, 5)
    ]
    # beta 1: every turn the teacher's, no cut point: one sub-sample, the whole response
    teacher_only = completed("r", 0, [("t", 2), ("o", 1), ("t", 2)])
    assert [(c.start, c.end) for c in ce_chunks(teacher_only)] == [(0, 5)]
    # beta 0: nothing to imitate
    assert ce_chunks(completed("r", 0, [("s", 2), ("o", 1), ("s", 2)])) == []


def test_an_over_long_sub_sample_drops_its_whole_trajectory() -> None:
    long_turns = [("t", 2), ("o", 1), ("s", 1), ("t", 6)]  # chunks end at 2 and 10
    short_turns = [("t", 3)]
    limit = len(PROMPT) + 5  # the long trajectory's first chunk fits, its second does not
    req = request("r", "dagger_ce", 3, knobs={"max_seq_len": limit})
    state = state_of(req, [short_turns, long_turns, short_turns])
    plan = ce_plan(state, ["r:s0", "r:s1", "r:s2"])
    assert plan.too_long == ("r:s1",)
    assert {c.sample_id for c in plan.chunks} == {"r:s0", "r:s2"}  # not even its short chunk
    decision = state.state
    ready = decide_ready(decision)
    assert ready is not None
    assert ready.sample_ids == ["r:s0", "r:s2"] and ready.dropped_sample_ids == ["r:s1"]
    assert ready.metrics["ce/n_dropped_too_long"] == 1.0
    assert decide_capture(decision) is None  # the CE lane never asks the teacher
    decision.ready = ready
    loaded = [s.sample_id for s in trainer_samples(state)]
    assert loaded == [f"{c.sample_id}/ce{c.chunk}" for c in plan.chunks]
    assert sorted(loaded) == ["r:s0/ce0", "r:s2/ce0"]


def test_max_seq_len_must_be_a_positive_integer() -> None:
    state = state_of(request("r", "dagger_ce", 1, knobs={"max_seq_len": "4k"}), [[("t", 1)]])
    with pytest.raises(ConfigError, match=r"knobs\['max_seq_len'\].*'4k'"):
        ce_plan(state, ["r:s0"])


def test_the_shuffle_is_deterministic_per_iteration() -> None:
    turns = [("t", 1), ("s", 1), ("t", 1), ("s", 1), ("t", 1)]  # 3 chunks each
    chunks = [c for i in range(6) for c in ce_chunks(completed("r", i, turns))]
    assert len(chunks) == 18
    a = ce_order(chunks, seed=7, iteration=2)
    assert ce_order(list(reversed(chunks)), seed=7, iteration=2) == a  # input order is moot
    assert sorted(a, key=lambda c: (c.sample_id, c.chunk)) == sorted(
        chunks, key=lambda c: (c.sample_id, c.chunk)
    )
    assert a != chunks  # siblings are de-clustered
    assert ce_order(chunks, seed=7, iteration=3) != a  # a new iteration, a new order
    assert ce_order(chunks, seed=8, iteration=2) != a


def test_gbs_scale_is_sub_samples_per_contributing_trajectory() -> None:
    two = [("t", 1), ("s", 1), ("t", 1)]
    one = [("t", 2)]
    none = [("s", 2)]
    state = state_of(request("r", "dagger_ce", 3), [two, one, none])
    ready = decide_ready(state.state)
    assert ready is not None
    assert ready.gbs_scale == pytest.approx(1.5)  # 3 chunks over 2 tasks that gave any
    assert ready.metrics["ce/n_subsamples"] == 3.0
    # the other lanes leave it at 1
    plain = decide_ready(state_of(request("r", "grpo", 3), [two, one, none]).state)
    assert plain is not None and plain.gbs_scale == 1.0


def test_a_ce_rollout_without_any_teacher_token_loads_one_dummy() -> None:
    state = state_of(request("r", "dagger_ce", 1), [[("s", 2)]], ready=["r:s0"])
    (dummy,) = trainer_samples(state)
    assert dummy.remove_sample
