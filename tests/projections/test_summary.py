"""Failure classes, pass@k and the summary artifacts, as pure functions of events."""

from __future__ import annotations

import json
from fractions import Fraction
from math import comb
from pathlib import Path

import pytest

from engine.actors.artifacts import write_artifacts
from engine.events import (
    AbortClass,
    Event,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TokenIds,
    TurnCompleted,
)
from engine.outcomes import TerminationReason
from engine.projections.readback import Rollout
from engine.projections.rows import sample_rows
from engine.projections.summary import (
    ARTIFACT_FILES,
    FailureClass,
    build_summary,
    classify_termination,
    dumps,
    eval_details,
    pass_at_k,
    placement_log,
    render_artifacts,
    rows_metrics,
)
from tests.rig import rollout_of, rollout_state


@pytest.mark.parametrize(
    ("reward", "reason", "expected"),
    [
        (1.0, "finish", FailureClass.SUCCESS),
        (0.5, "max_turns", FailureClass.SUCCESS),  # a truncated episode that still scored
        (0.0, "finish", FailureClass.WRONG_ANSWER),
        (-1.0, "finish", FailureClass.WRONG_ANSWER),
        (0.0, None, FailureClass.WRONG_ANSWER),
        (0.0, "max_turns", FailureClass.TRUNCATED_TURNS),
        (0.0, "max_context", FailureClass.TRUNCATED_CONTEXT),
        (0.0, "length", FailureClass.TRUNCATED_CONTEXT),
        (1.0, "agent_timeout", FailureClass.AGENT_TIMEOUT),  # an abort wins over the reward
        (0.0, "infra_conn", FailureClass.INFRA_CONN),
        (0.0, "infra_sandbox", FailureClass.INFRA_SANDBOX),
        (0.0, "infra_other", FailureClass.INFRA_OTHER),
    ],
)
def test_classify_termination(reward: float, reason: str | None, expected: FailureClass) -> None:
    assert classify_termination(reward, reason) is expected


def test_eight_classes() -> None:
    # the eight of every summary, plus the engine's own two (issue 12: stale, tail_aborted),
    # which a summary lists only when a sample has one
    assert len([c for c in FailureClass if not c.engine_ended]) == 8
    assert [c.value for c in FailureClass if c.engine_ended] == ["stale", "tail_aborted"]


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 0.4),  # c / n
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # n - c < k
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (10, 3, 5, 1 - comb(7, 5) / comb(10, 5)),
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n() -> None:
    # C(1000, 500) overflows a float; the product form does not.
    n, c, k = 1000, 7, 500
    exact = 1 - Fraction(comb(n - c, k), comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


# ---------------------------------------------------------------- a hand-built rollout


def _task(rid: str, index: int, group: int, dataset: str) -> TaskFetched:
    return TaskFetched(
        rollout_id=rid,
        sample_id=f"{rid}:s{index}",
        index=index,
        group_index=group,
        prompt="p",
        dataset=dataset,
        task_type="scripted",
    )


def _done(rid: str, index: int, reward: float, reason: str = "finish") -> SampleCompleted:
    return SampleCompleted(
        rollout_id=rid,
        sample_id=f"{rid}:s{index}",
        attempt=1,
        prompt_ids=TokenIds.from_values([1, 2]),
        response_ids=TokenIds.from_values([3, 4, 5]),
        logprobs=LogProbs.from_values([-0.5, -0.25, -0.125]),
        loss_mask=Mask.from_values([1, 1, 1]),
        reward=reward,
        termination_reason=reason,
        n_turns=1,
        elapsed_s=0.1234567891,
    )


def _eval_rollout(
    pinned: int | None = None, version_tokens: dict[str, int] | None = None
) -> Rollout:
    """Dataset a: 2 prompts x 3 samples (2 and 0 correct); dataset b: 1 prompt x 3 (1 abort)."""
    rid = "r"
    events: list[Event] = [
        RolloutRequested(rollout_id=rid, n_prompts=3, n_samples_per_prompt=3, kind="eval",
                         pinned_version=pinned)  # fmt: skip
    ]
    layout = [(0, "a"), (0, "a"), (0, "a"), (1, "a"), (1, "a"), (1, "a"), (2, "b"), (2, "b"),
              (2, "b")]
    events += [_task(rid, i, g, d) for i, (g, d) in enumerate(layout)]
    events.append(RolloutPlanned(rollout_id=rid, n_samples=9, n_batches=1))
    rewards = {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0, 5: 0.0, 6: 1.0, 7: 0.0}
    for i, r in rewards.items():
        events.append(SampleStarted(rollout_id=rid, sample_id=f"{rid}:s{i}", attempt=1))
        events.append(
            TurnCompleted(rollout_id=rid, sample_id=f"{rid}:s{i}", attempt=1, turn=0,
                          node="n1", gpu=i % 2, prompt_tokens=2, response_tokens=3)
        )
        events.append(_done(rid, i, r, "max_turns" if i == 7 else "finish"))
    events.append(
        SampleAborted(rollout_id=rid, sample_id=f"{rid}:s8", attempt=1,
                      abort_class=AbortClass.INFRA_SANDBOX, phase="run", error="boom")
    )
    events.append(RolloutReady(rollout_id=rid, sample_ids=[f"{rid}:s{i}" for i in range(9)],
                               version_tokens=version_tokens or {}))  # fmt: skip
    return rollout_of(events)


def test_eval_metrics_per_dataset() -> None:
    metrics = rows_metrics(_eval_rollout().state.ordered())
    assert metrics["eval/a/accuracy"] == pytest.approx(2 / 6)
    # prompt 0: n=3 c=2, prompt 1: n=3 c=0
    assert metrics["eval/a/pass@1"] == pytest.approx((2 / 3 + 0) / 2)
    assert metrics["eval/a/pass@2"] == pytest.approx((1 - comb(1, 2) / comb(3, 2) + 0) / 2)
    assert metrics["eval/a/pass@3"] == pytest.approx((1.0 + 0.0) / 2)
    assert metrics["eval/b/accuracy"] == pytest.approx(1 / 3)
    assert metrics["eval/b/pass@2"] == pytest.approx(1 - comb(2, 2) / comb(3, 2))
    assert set(metrics) == {
        "eval/a/accuracy", "eval/a/pass@1", "eval/a/pass@2", "eval/a/pass@3",
        "eval/b/accuracy", "eval/b/pass@1", "eval/b/pass@2", "eval/b/pass@3",
    }


def test_no_pass_at_k_with_one_sample_per_prompt() -> None:
    rid = "r1"
    events: list[Event] = [_task(rid, 0, 0, "a"), _task(rid, 1, 1, "a"),
                           _done(rid, 0, 1.0), _done(rid, 1, 0.0)]
    assert rows_metrics(rollout_state(events).ordered()) == {"eval/a/accuracy": 0.5}


def test_summary_counts_and_task_list() -> None:
    summary = build_summary(_eval_rollout())
    a = summary["datasets"]["a"]
    assert a["n"] == 6
    assert a["counts"]["success"] == 2 and a["counts"]["wrong_answer"] == 4
    b = summary["datasets"]["b"]["counts"]
    assert (b["success"], b["truncated_turns"], b["infra_sandbox"]) == (1, 1, 1)
    assert sum(summary["counts"].values()) == 9
    assert summary["tasks"][8] == {
        "sample_id": "r:s8", "dataset": "b", "group": 2, "reward": 0.0,
        "class": "infra_sandbox", "turns": 0,
    }


def test_the_summary_of_a_pinned_eval_records_its_version() -> None:
    assert "pinned" not in build_summary(_eval_rollout())  # other summaries keep their bytes
    summary = build_summary(_eval_rollout(pinned=4, version_tokens={"4": 24}))
    assert summary["pinned"] == {"version": 4, "version_tokens": {"4": 24}}


def test_placement_log_has_node_and_gpu_per_turn() -> None:
    rows = placement_log(_eval_rollout())
    assert len(rows) == 8
    assert rows[1]["sample_id"] == "r:s1" and rows[1]["node"] == "n1" and rows[1]["gpu"] == 1


def test_artifacts_are_deterministic_bytes() -> None:
    first = render_artifacts(_eval_rollout())
    second = render_artifacts(_eval_rollout())
    assert first == second
    summary = first["summary.json"].decode()
    assert json.loads(summary)["rollout_id"] == "r"
    details = [json.loads(line) for line in first["eval_details.jsonl"].decode().splitlines()]
    assert details[0]["elapsed_s"] == 0.123457  # fixed 6-decimal formatting
    assert len(first["samples.jsonl"].decode().splitlines()) == 9


def test_dumps_sorts_keys_and_rounds() -> None:
    assert dumps({"b": 1 / 3, "a": [-0.0, 2]}) == '{"a":[0.0,2],"b":0.333333}'
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})


def test_written_artifacts_are_the_rendered_bytes(tmp_path: Path) -> None:
    state = _eval_rollout()
    written = write_artifacts(state, tmp_path / "out")
    rendered = render_artifacts(state)
    assert sorted(written) == sorted(ARTIFACT_FILES) == sorted(rendered)
    for name, path in written.items():
        assert path.read_bytes() == rendered[name]
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_one_row_per_sample_feeds_summary_details_and_samples() -> None:
    state = _eval_rollout()
    rows = sample_rows(state)
    details = eval_details(state)
    samples = [json.loads(line) for line in
               render_artifacts(state)["samples.jsonl"].decode().splitlines()]
    assert [r.sample_id for r in rows] == [d["sample_id"] for d in details]
    assert [s["sample_id"] for s in samples] == [r.sample_id for r in rows]
    aborted = rows[8]
    assert aborted.aborted and aborted.abort_class is AbortClass.INFRA_SANDBOX
    assert aborted.termination_reason is TerminationReason.INFRA_SANDBOX
    assert details[8]["termination_reason"] == samples[8]["termination_reason"] == "infra_sandbox"
    assert samples[8]["status"] == details[8]["status"] == aborted.status == "aborted"
    assert rows[7].completed and rows[7].failure_class is FailureClass.TRUNCATED_TURNS
