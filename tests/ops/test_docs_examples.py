"""The evaluator config that docs/agents.md walks through loads the way workers load it and
runs a real episode against the tiny model server."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.actors.batch_run import BatchPlan, BatchRun, EpisodeSettings
from engine.backends.pool import BackendPool
from engine.client import collate
from engine.config.evaluators import load_evaluators, load_profiles
from engine.events.catalog import BatchAdmitted, SampleCompleted, TaskFetched
from engine.events.names import StreamNames
from engine.sample import Sample
from tests.agents.test_evaluator_wiring import ListSink
from tinylm.server import TinyLMServer, start_server

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "single_turn_evaluators.py"


@pytest.fixture
def server(math_model_dir: Path) -> Iterator[TinyLMServer]:
    """The agent tests' model (tests/conftest.py), served for this module's one episode."""
    with start_server(math_model_dir, max_running_requests=4) as srv:
        yield srv


def test_the_scheduler_side_needs_no_model() -> None:
    profiles = load_profiles(EXAMPLE, argparse.Namespace())  # no model_dir: never read
    assert list(profiles) == ["qa"]
    assert profiles["qa"].default_stopping.max_new_tokens == 64


async def test_the_example_agent_runs_an_episode(
    math_model_dir: Path, server: TinyLMServer, tmp_path: Path
) -> None:
    specs = load_evaluators(EXAMPLE, argparse.Namespace(model_dir=math_model_dir))
    task = TaskFetched(rollout_id="rx", sample_id="rx:s0", index=0, group_index=0,
                       prompt="What is 6 * 7?", label="42", dataset="qa_train",
                       task_type="qa", source_line=1,
                       stopping=specs["qa"].profile.default_stopping,
                       sampling_params={"temperature": 0.0})
    plan = BatchPlan(
        admitted=BatchAdmitted(rollout_id="rx", batch_id="rx:b0", evaluator_id="qa",
                               sample_ids=["rx:s0"]),
        request=None, tasks={"rx:s0": task}, run_ids=("rx:s0",), attempts={}, tokens=(),
    )
    sink = ListSink()
    async with BackendPool(server.url) as backends:
        await BatchRun(specs["qa"], plan, sink=sink, names=StreamNames("rl"),
                       settings=EpisodeSettings(worker_id="w-doc", tmp_root=tmp_path),
                       backends=backends).run()
    [done] = [e for e in sink.events if isinstance(e, SampleCompleted)]
    n = len(done.response_ids.tolist())
    assert n > 0 and done.loss_mask.tolist() == [1] * n
    assert len(done.logprobs.tolist()) == n
    assert set(done.reward_detail) == {"score", "contains_label"}


def _samples() -> list[Sample]:
    # prompt [5, 6] + response [7, 8, 9] where 8 is tool output; prompt [1] + response [2]
    return [
        Sample(index=0, group_index=0, tokens=[5, 6, 7, 8, 9], response_length=3,
               loss_mask=[1, 0, 1], rollout_log_probs=[-0.5, 0.0, -0.25], reward=1.0),
        Sample(index=1, group_index=0, tokens=[1, 2], response_length=1,
               loss_mask=[1], rollout_log_probs=[-1.0], reward=0.0),
    ]


def test_verl_layout_splits_left_padded_prompts_from_right_padded_responses() -> None:
    from docs.examples.trainer_adapters import to_verl

    out = to_verl(collate(_samples()), pad_token_id=0)
    assert out["prompts"].tolist() == [[5, 6], [0, 1]]
    assert out["responses"].tolist() == [[7, 8, 9], [2, 0, 0]]
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9], [0, 1, 2, 0, 0]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]
    assert out["response_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    assert out["rollout_log_probs"].tolist() == [[-0.5, 0.0, -0.25], [-1.0, 0.0, 0.0]]
    assert out["token_level_scores"].tolist() == [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]


def test_trl_layout_and_group_advantages() -> None:
    from docs.examples.trainer_adapters import to_trl

    samples = _samples()
    out = to_trl(samples, collate(samples))
    assert out["completion_ids"].tolist() == [[7, 8, 9], [2, 0, 0]]
    assert out["completion_mask"].tolist() == [[1, 0, 1], [1, 0, 0]]
    adv = out["advantages"].tolist()
    assert adv[0] > 0 > adv[1] and abs(adv[0] + adv[1]) < 1e-6
