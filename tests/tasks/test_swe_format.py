"""The format corpus speaks mini-swe-agent's language exactly (checked with mini-swe-agent's
own parser and renderer), and the demo's trajectory view shows what the trainer receives."""

from __future__ import annotations

from typing import Any

import pytest

from engine.agents.scaffolds.mini_swe_agent import ACTION_REGEX, OBSERVATION_TEMPLATE
from engine.domain import TerminationReason
from engine.ops.swe_demo import trajectory_lines
from engine.sample import Sample
from engine.tasks.swe import fix_command, generate_items
from engine.tasks.swe_format import CORPUS_SEED, format_dialogues, observation

actions_text = pytest.importorskip(
    "minisweagent.models.utils.actions_text", reason="mini-swe-agent is not installed"
)


def test_every_reply_is_one_action_mini_swe_agent_accepts() -> None:
    dialogues = format_dialogues(6)
    items = generate_items(6, seed=CORPUS_SEED)
    for dialogue, item in zip(dialogues, items, strict=True):
        replies = [m["content"] for m in dialogue.messages if m["role"] == "assistant"]
        commands = [
            actions_text.parse_regex_actions(
                r, action_regex=ACTION_REGEX, format_error_template="{{error}}"
            )[0]["command"]
            for r in replies
        ]
        assert commands == [
            fix_command(item), "sh test.sh", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
        ]
        assert all(r.startswith("THOUGHT: ") for r in replies)


@pytest.mark.parametrize(("code", "output"), [(0, ""), (0, "PASS\n"), (1, "FAIL: x\n")])
def test_observations_are_rendered_as_mini_swe_agent_renders_them(code: int, output: str) -> None:
    (theirs,) = actions_text.format_observation_messages(
        [{"output": output, "returncode": code, "exception_info": ""}],
        observation_template=OBSERVATION_TEMPLATE,
    )
    assert observation(code, output) == theirs["content"]


def test_the_corpus_is_deterministic() -> None:
    assert [d.messages for d in format_dialogues(4)] == [d.messages for d in format_dialogues(4)]


def test_the_demo_shows_replies_with_logprobs_and_observations() -> None:
    sample = Sample(
        index=0, group_index=0, sample_id="r:s0", tokens=[1, 2, 10, 11, 20, 21, 22, 12],
        response_length=6, loss_mask=[1, 1, 0, 0, 0, 1],
        rollout_log_probs=[-0.5, -1.5, 0.0, 0.0, 0.0, -0.25], reward=1.0,
        termination_reason=TerminationReason.FINISH,
    )  # fmt: skip

    def decode(ids: list[int]) -> str:
        return " ".join(f"t{i}" for i in ids)

    lines: list[Any] = trajectory_lines(sample, decode)
    assert "2 prompt tokens, 6 response tokens (3 generated" in lines[0]
    assert lines[1].split() == ["model", "2", "tok", "mean", "logprob", "-1.000", "t10", "t11"]
    assert lines[2].split() == ["obs", "3", "tok", "t20", "t21", "t22"]
    assert lines[3].split() == ["model", "1", "tok", "mean", "logprob", "-0.250", "t12"]
