"""Hostile tool calls: the sandbox contains them, the agent reports them, the worker is fine.

A scripted model (real tokenizer, real ``SGLangBackend`` over a mock transport) issues each
hazard as a tool call in the real local sandbox, then answers. The episode must end normally
(``finish``), the observation must name what happened, the metrics must count it by class, the
sandbox must still work afterwards, and the test process must still fork, exec and allocate.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest

from engine.agents.tool_agent import ToolAgent
from engine.agents.tools import PythonTool, ShellTool
from engine.backends.toolcalls import render_tool_call
from engine.domain import TerminationReason
from engine.sandbox import LocalSandboxProvider, SandboxLimits
from engine.tasks.evaluators import math_agent_config
from engine.tasks.math import MathVerifier
from tests.agents.conftest import Reply, ScriptedGenerate, make_context, make_task, run_episode

LIMITS = SandboxLimits(
    cpu_time_s=5, memory_mb=256, max_procs=32, wall_timeout_s=20, max_output_bytes=4096
)


def assert_worker_healthy() -> None:
    done = subprocess.run(["sh", "-c", "echo ok"], capture_output=True, text=True, timeout=30)
    assert done.stdout == "ok\n"
    assert len(bytearray(64 * 2**20)) == 64 * 2**20


def agent_for(script: ScriptedGenerate, **overrides: Any) -> ToolAgent:
    config = dataclasses.replace(
        math_agent_config(),
        tools=(PythonTool(), ShellTool()),
        sandbox_limits=LIMITS,
        max_observation_chars=300,
        **overrides,
    )
    return ToolAgent(config, verifier=MathVerifier(), tokenizer=script.tokenizer)


async def run_hazard(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path, call: str, **overrides: Any
) -> tuple[Any, str]:
    """Run one episode: the hazardous call, a harmless call, an answer. Returns the result and
    the first observation's text."""
    script = ScriptedGenerate(
        tokenizer,
        [
            Reply(call),
            Reply(render_tool_call("shell", {"cmd": "echo still usable"})),
            Reply("<answer>1</answer>"),
        ],
    )
    task = make_task("What is 1?", "1")
    result, reward = await run_episode(
        agent_for(script, **overrides),
        task,
        make_context(
            task,
            sandboxes=provider,
            backends=script.backends,
            tmp_path=tmp_path,
            max_context_len=2048,
            max_new_tokens=512,
        ),
    )
    assert result.termination_reason is TerminationReason.FINISH
    assert isinstance(reward, dict) and reward["score"] == 1.0
    observations = []
    run: list[int] = []
    for token, bit in zip(result.response_token_ids, result.loss_mask, strict=True):
        if bit == 0:
            run.append(token)
        elif run:
            observations.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    assert len(observations) == 2
    assert "still usable" in observations[1]
    assert result.metrics["n_tool_calls"] == 2
    assert_worker_healthy()
    return result, observations[0]


async def test_fork_bomb(tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path) -> None:
    call = render_tool_call("python", {"code": "import os\nwhile True:\n    os.fork()"})
    result, observation = await run_hazard(tokenizer, provider, tmp_path, call)
    assert "process limit" in observation, observation
    assert result.metrics["tool_pids_limit"] == 1 == result.metrics["n_tool_errors"]


async def test_infinite_loop(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    call = render_tool_call("shell", {"cmd": "while :; do :; done"})
    result, observation = await run_hazard(tokenizer, provider, tmp_path, call, tool_timeout_s=1.0)
    assert "timed out" in observation, observation
    assert result.metrics["tool_timeout"] == 1 == result.metrics["n_tool_errors"]


async def test_ten_gigabyte_allocation(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    call = render_tool_call("python", {"code": "b = bytearray(10 * 1024**3)\nprint(len(b))"})
    result, observation = await run_hazard(tokenizer, provider, tmp_path, call)
    assert "MemoryError" in observation and "memory limit" in observation, observation
    assert result.metrics["tool_memory_limit"] == 1 == result.metrics["n_tool_errors"]


async def test_path_escape(tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path) -> None:
    # A folder of the worker's: commands must not write into it (nor next to the sandbox).
    target = tmp_path / "worker-owned"
    target.mkdir()
    target.chmod(0o755)
    escape = f"echo pwned > ../escaped.txt; echo pwned > {target}/escaped.txt"
    call = render_tool_call("shell", {"cmd": escape})
    result, observation = await run_hazard(tokenizer, provider, tmp_path, call)
    if provider.containment.identity == "inherit":
        pytest.skip(
            "commands run as the worker's own uid here: the local sandbox is not a filesystem "
            "jail (see engine.sandbox.local); only the exit status is checked under a "
            "separate uid"
        )
    assert "Permission denied" in observation and "[exit code" in observation, observation
    assert result.metrics["tool_nonzero_exit"] == 1 == result.metrics["n_tool_errors"]
    assert not (target / "escaped.txt").exists()
    assert not any(p.name == "escaped.txt" for p in Path(provider.config.root).rglob("*"))
