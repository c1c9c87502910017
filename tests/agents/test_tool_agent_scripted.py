"""The tool agent's loop, driven by a scripted ``/generate`` (real tokenizer, real SGLangBackend
over ``httpx.MockTransport``) and the real local sandbox.

Scripted generations are the tokenizer's own tokens for the text, so a full re-render of the
conversation must reproduce the agent's token series exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.actors.sandbox_labels import LabelledProvider, sandbox_labels
from engine.agents.tool_agent import ToolAgent, ToolAgentConfig, derive_turn_seed
from engine.agents.tools import PythonTool, ShellTool
from engine.backends.toolcalls import render_tool_call
from engine.domain import SamplingParams, TerminationReason
from engine.errors import AgentError, GenerationAborted, SandboxError
from engine.sandbox import MANAGED_LABEL, LocalSandboxProvider, SandboxLimits
from engine.tasks.evaluators import math_agent_config, shell_agent_config
from engine.tasks.math import MathVerifier
from engine.tasks.shell import ShellVerifier
from tests.agents.conftest import (
    Reply,
    ScriptedGenerate,
    check_trajectory,
    make_context,
    make_task,
    run_episode,
)

SHELL_TASK = "Create a file named memo.txt that contains exactly the word lemon."
SHELL_CHECK = 'test "$(cat memo.txt)" = "lemon"'


def agent_for(script: ScriptedGenerate, *, shell: bool = False, **overrides: Any) -> ToolAgent:
    base = shell_agent_config() if shell else math_agent_config()
    config = dataclasses.replace(base, **overrides)
    verifier = ShellVerifier() if shell else MathVerifier()
    return ToolAgent(config, verifier=verifier, tokenizer=script.tokenizer)


def python_call(code: str) -> str:
    return render_tool_call("python", {"code": code})


def observation_texts(result: Any, tokenizer: Any) -> list[str]:
    """The decoded observation runs (loss mask 0) of a trajectory, in order."""
    runs: list[list[int]] = []
    previous = 1
    for token, bit in zip(result.response_token_ids, result.loss_mask, strict=True):
        if bit == 0:
            if previous == 1:
                runs.append([])
            runs[-1].append(token)
        previous = bit
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


async def test_series_equals_a_full_rerender(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer,
        [Reply(python_call("print(6 * 7)")), Reply("The answer is <answer>42</answer>")],
    )
    agent = agent_for(script)
    task = make_task("What is 6 * 7?", "42")
    result, reward = await run_episode(
        agent,
        task,
        make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
    )
    assert result.termination_reason is TerminationReason.FINISH
    assert isinstance(reward, dict) and reward["score"] == 1.0
    check_trajectory(result, script.outputs)

    messages = [
        *agent.initial_messages(task),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": {"code": "print(6 * 7)"}},
                }
            ],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is <answer>42</answer>"},
    ]
    full = tokenizer.apply_chat_template(messages, tools=[PythonTool().schema()], tokenize=False)
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    series = [*result.prompt_token_ids, *result.response_token_ids]
    # The re-render ends with the newline after the last <|im_end|>; nothing else differs.
    assert full_ids[: len(series)] == series
    assert tokenizer.decode(full_ids[len(series) :]) == "\n"

    # Each request carried the whole series so far and the turn's budget.
    first_gen = script.outputs[0][0]
    obs_len = len(result.response_token_ids) - len(first_gen) - len(script.outputs[1][0])
    assert script.requests[0]["input_ids"] == list(result.prompt_token_ids)
    assert (
        script.requests[1]["input_ids"]
        == series[: len(result.prompt_token_ids) + len(first_gen) + obs_len]
    )
    assert [r["sampling_params"]["max_new_tokens"] for r in script.requests] == [96, 96]
    assert all(r["return_logprob"] is True for r in script.requests)
    assert all("sampling_seed" not in r["sampling_params"] for r in script.requests)


async def test_answer_without_tool_call_and_plain_stop_finish(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    task = make_task("What is 6 * 7?", "42")
    for text, score in (("<answer>42</answer>", 1.0), ("I think it is 41.", 0.0)):
        script = ScriptedGenerate(tokenizer, [Reply(text)])
        result, reward = await run_episode(
            agent_for(script),
            task,
            make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
        )
        assert result.termination_reason is TerminationReason.FINISH
        assert len(result.turns) == 1 and result.turns[0].tool_calls == ()
        assert isinstance(reward, dict) and reward["score"] == score
        check_trajectory(result, script.outputs)


async def test_failing_tool_call_is_an_observation(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer,
        [
            Reply(python_call("import sys\nprint('partial')\nsys.exit(3)")),
            Reply(python_call("1 / 0")),
            Reply("<answer>0</answer>"),
        ],
    )
    task = make_task("What is 0 * 5?", "0")
    result, reward = await run_episode(
        agent_for(script),
        task,
        make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
    )
    assert result.termination_reason is TerminationReason.FINISH
    assert isinstance(reward, dict) and reward["score"] == 1.0
    first, second = observation_texts(result, tokenizer)
    assert "partial\n[exit code 3]" in first
    assert "ZeroDivisionError" in second and "[exit code 1]" in second
    assert result.metrics["n_tool_calls"] == 2
    assert result.metrics["n_tool_errors"] == 2
    assert result.metrics["tool_nonzero_exit"] == 2
    check_trajectory(result, script.outputs)


async def test_invalid_tool_calls_get_error_observations(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer,
        [
            Reply(render_tool_call("browser", {"url": "http://example.com"})),
            Reply('<tool_call>\n{"name": "python", "arguments": {"code": 5}}\n</tool_call>'),
            Reply("<tool_call>\nnot json\n</tool_call>"),
            Reply("<answer>1</answer>"),
        ],
    )
    task = make_task("What is 1 * 1?", "1")
    result, _ = await run_episode(
        agent_for(script),
        task,
        make_context(
            task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path, max_turns=6
        ),
    )
    assert result.termination_reason is TerminationReason.FINISH
    unknown, bad_args, malformed = observation_texts(result, tokenizer)
    assert "unknown tool 'browser'" in unknown and "python" in unknown
    assert "needs a string argument 'code'" in bad_args
    assert "not JSON" in malformed
    assert result.metrics["n_tool_calls"] == 0
    assert result.metrics["tool_invalid_call"] == 3 == result.metrics["n_tool_errors"]
    assert [t.tool_calls for t in result.turns] == [("browser",), ("python",), (), ()]
    check_trajectory(result, script.outputs)


async def test_generation_without_end_token_is_length(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer, [Reply("Let me think about this for a very long time", eos=False)]
    )
    task = make_task()
    result, _ = await run_episode(
        agent_for(script),
        task,
        make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
    )
    assert result.termination_reason is TerminationReason.LENGTH
    check_trajectory(result, script.outputs)


async def test_budget_never_exceeds_the_context(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer, [Reply(python_call("print(1)")), Reply("a long answer " * 40)]
    )
    agent = agent_for(script)
    task = make_task()
    prompt_len = len(agent.chat.prompt_ids(agent.initial_messages(task)))
    limit = prompt_len + 80
    result, _ = await run_episode(
        agent,
        task,
        make_context(
            task,
            sandboxes=provider,
            backends=script.backends,
            tmp_path=tmp_path,
            max_context_len=limit,
        ),
    )
    budgets = [r["sampling_params"]["max_new_tokens"] for r in script.requests]
    lengths = [len(r["input_ids"]) for r in script.requests]
    assert budgets[0] == 80 and budgets[1] == limit - lengths[1] < 96
    assert result.termination_reason is TerminationReason.MAX_CONTEXT
    assert len(result.prompt_token_ids) + len(result.response_token_ids) == limit
    check_trajectory(result, script.outputs)


async def test_seeds_are_derived_per_sample_and_turn(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    sent: dict[str, list[int]] = {}
    for index in (0, 1):
        script = ScriptedGenerate(
            tokenizer, [Reply(python_call("print(2)")), Reply("<answer>2</answer>")]
        )
        task = make_task("What is 1 + 1?", "2", index=index)
        ctx = make_context(
            task,
            sandboxes=provider,
            backends=script.backends,
            tmp_path=tmp_path,
            sampling=SamplingParams(temperature=0.8, sampling_seed=99),
        )
        await run_episode(agent_for(script), task, ctx)
        sent[task.sample_id] = [r["sampling_params"]["sampling_seed"] for r in script.requests]
        assert all(r["sampling_params"]["temperature"] == 0.8 for r in script.requests)
    assert sent == {
        sid: [derive_turn_seed(99, episode_seed=0, sample_id=sid, turn=t) for t in (0, 1)]
        for sid in sent
    }
    seeds = [s for pair in sent.values() for s in pair]
    assert len(set(seeds)) == 4


async def test_aborted_generation_raises_and_cleanup_stops_the_sandbox(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(tokenizer, [Reply("", finish="abort")])
    agent = agent_for(script)
    task = make_task()
    ctx = make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path)
    episode = agent.episode(task)
    await episode.init(ctx)
    labels = {"rollout.rollout": "r1", "rollout.sample": task.sample_id, "rollout.attempt": "1"}
    assert len(await provider.find(labels)) == 1
    with pytest.raises(GenerationAborted):
        await episode.run(ctx)
    await episode.cleanup(ctx)
    assert await provider.find(labels) == []
    with pytest.raises(AgentError, match="before init"):
        await episode.run(ctx)


async def test_sandbox_carries_the_episode_and_worker_labels(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(tokenizer, [Reply("<answer>42</answer>")])
    agent = agent_for(script)
    task = make_task()
    labelled = LabelledProvider(
        provider,
        sandbox_labels(
            worker="w7", rollout_id="r1", batch_id="r1:b0", sample_id=task.sample_id, attempt=3
        ),
    )
    ctx = make_context(
        task, sandboxes=labelled, backends=script.backends, tmp_path=tmp_path, attempt=3
    )
    episode = agent.episode(task)
    await episode.init(ctx)
    try:
        found = await provider.find(
            {
                "rollout.worker": "w7",
                "rollout.rollout": "r1",
                "rollout.sample": task.sample_id,
                "rollout.attempt": "3",
                MANAGED_LABEL: "1",
            }
        )
        assert len(found) == 1
    finally:
        await episode.cleanup(ctx)
    assert await provider.find({"rollout.worker": "w7"}) == []


async def test_init_without_a_sandbox_provider_is_a_sandbox_error(
    tokenizer: Any, tmp_path: Path
) -> None:
    script = ScriptedGenerate(tokenizer, [])
    agent = agent_for(script)
    task = make_task()
    ctx = make_context(task, sandboxes=None, backends=script.backends, tmp_path=tmp_path)
    episode = agent.episode(task)
    with pytest.raises(SandboxError, match="sandbox provider"):
        await episode.init(ctx)
    await episode.cleanup(ctx)


@pytest.mark.parametrize(
    ("label", "score", "exit_code"),
    [(SHELL_CHECK, 1.0, 0), ('test "$(cat memo.txt)" = "lime"', 0.0, 1)],
)
async def test_shell_task_is_checked_in_the_episode_sandbox(
    tokenizer: Any,
    provider: LocalSandboxProvider,
    tmp_path: Path,
    label: str,
    score: float,
    exit_code: int,
) -> None:
    script = ScriptedGenerate(
        tokenizer,
        [
            Reply(render_tool_call("shell", {"cmd": "echo lemon > memo.txt"})),
            Reply("<answer>done</answer>"),
        ],
    )
    agent = agent_for(script, shell=True)
    task = make_task(SHELL_TASK, label, task_type="shell")
    result, reward = await run_episode(
        agent,
        task,
        make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
    )
    assert result.termination_reason is TerminationReason.FINISH
    assert result.turns[0].tool_calls == ("shell",)
    assert observation_texts(result, tokenizer)[0].count("(no output)") == 1
    assert reward == {"score": score, "exit_code": float(exit_code), "passed": score}
    check_trajectory(result, script.outputs)


async def test_too_many_calls_in_one_turn_are_refused(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    calls = "\n".join(python_call(f"print({i})") for i in range(3))
    script = ScriptedGenerate(tokenizer, [Reply(calls), Reply("<answer>0</answer>")])
    agent = agent_for(script, max_tool_calls_per_turn=2)
    task = make_task("What is 0?", "0")
    result, _ = await run_episode(
        agent,
        task,
        make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path),
    )
    [obs] = observation_texts(result, tokenizer)
    assert obs.count("<tool_response>") == 3
    assert "\n0\n" in obs and "\n1\n" in obs and "at most 2 tool calls" in obs
    assert result.metrics["n_tool_calls"] == 2 and result.metrics["tool_invalid_call"] == 1


def test_config_is_validated(tokenizer: Any) -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="distinct"):
        ToolAgentConfig(tools=(ShellTool(), ShellTool()))
    with pytest.raises(ConfigError, match="answer_pattern"):
        ToolAgentConfig(answer_pattern="(")
    with pytest.raises(ConfigError, match="default_max_turns"):
        ToolAgentConfig(default_max_turns=0)
    with pytest.raises(ConfigError, match="tokenizer"):
        ToolAgent(ToolAgentConfig(), verifier=MathVerifier())
    limits = SandboxLimits(memory_mb=128)
    assert ToolAgentConfig(sandbox_limits=limits).sandbox_limits is limits


async def test_a_trajectory_that_would_span_too_many_versions_ends_before_its_next_turn(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(
        tokenizer,
        [Reply(python_call("print(6 * 7)"), version="0"), Reply("<answer>42</answer>")],
    )
    # Version 1 is active once the first turn (on version 0) came back.
    script.backends.health.expected = lambda: 1 if script.requests else 0
    agent = agent_for(script)
    task = make_task("What is 6 * 7?", "42")
    view = script.backends.bind(f"{task.sample_id}/a1", max_version_span=1)
    result, _ = await run_episode(
        agent, task, make_context(task, sandboxes=provider, backends=view, tmp_path=tmp_path)
    )
    assert result.termination_reason is TerminationReason.VERSION_SPAN
    assert len(script.requests) == 1  # the second turn was not generated
    first, last = result.turns
    assert first.weight_version == 0 and last.finish_reason == "version_span"
    assert last.response_tokens == 0
    generated = [v for v, m in zip(result.response_versions, result.loss_mask, strict=True) if m]
    assert generated and set(generated) == {0}
