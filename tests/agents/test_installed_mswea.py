"""``InstalledAgent`` running the real mini-swe-agent (PyPI) end to end.

A real tinylm subprocess, format-trained on mini-swe-agent's replies for three generated
``swe`` tasks (``engine.tasks.swe_format``; greedy decoding reproduces them: the hinted ``sed``
edit, ``sh test.sh``, the submit command); the recording proxy in front of it; mini-swe-agent
as a subprocess whose commands run in the sample's sandbox (local, and a busybox container when
dockerd answers) through the command bridge; the ``swe`` verifier scoring the edited repo.

Checked: the token-level ``AgentResult`` (mask 1 on generated tokens with their logprobs, mask
0 on observations), the verified reward, capture on vs off, the kept logs, the abort classes
of a missing scaffold / a run past its wall clock, and that nothing is left behind (no process
of the run, the proxy's port closed, the bridge's socket gone, the sandbox reaped).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.agents.base import AgentResult, EpisodeContext, Reward
from engine.agents.installed import InstalledAgent, InstalledAgentConfig
from engine.agents.scaffolds import MiniSweAgent
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig, load_tokenizer
from engine.domain import SamplingParams, StoppingCriteria, Task
from engine.errors import AgentError, ConfigError, EpisodeTimeout
from engine.outcomes import TerminationReason
from engine.sandbox import LocalSandboxProvider
from engine.sandbox.base import SandboxProvider
from engine.tasks.swe import generate_items
from engine.tasks.swe_evaluators import swe_agent_config
from engine.tasks.swe_format import CORPUS_SEED, format_dialogues, init_swe_model
from tests.conftest import local_sandbox_provider
from tests.sandbox.conftest import docker_image  # noqa: F401  (fixture)
from tinylm.process import spawn_server

pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (extra 'scaffolds')")
# Fixture setup (training the format model) counts against a test's timeout: generous, for
# a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ITEMS = generate_items(3, seed=CORPUS_SEED)  # the tasks the fixture model was trained on


@pytest.fixture(scope="module")
def swe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm-swe") / "model"
    init_swe_model(path, dialogues=format_dialogues(3), steps=80, batch_size=3)
    return path


@pytest.fixture(scope="module")
def swe_server(swe_model: Path) -> Iterator[str]:
    with spawn_server(swe_model) as server:
        yield server.url


@pytest.fixture(scope="module")
def tokenizer(swe_model: Path) -> Any:
    return load_tokenizer(swe_model)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalSandboxProvider]:
    with local_sandbox_provider("rollout-installed-tests-") as prov:
        yield prov


@pytest.fixture
async def backends(swe_server: str, tokenizer: Any) -> AsyncIterator[BackendPool]:
    pool = BackendPool(
        swe_server, build=lambda url: SGLangBackend(config=SGLangConfig(url=url),
                                                    tokenizer=tokenizer),
    )  # fmt: skip
    yield pool
    await pool.aclose()


@pytest.fixture
async def idle_backends(tinylm_dir: Path) -> AsyncIterator[BackendPool]:
    """A pool whose server is never reached (the episode ends before any model call)."""
    tokenizer = load_tokenizer(tinylm_dir)
    pool = BackendPool(
        "http://127.0.0.1:9", build=lambda url: SGLangBackend(config=SGLangConfig(url=url),
                                                              tokenizer=tokenizer),
    )  # fmt: skip
    yield pool
    await pool.aclose()


def task_for(index: int, rollout: str = "r-inst") -> Task:
    item = ITEMS[index]
    line = item.line()
    return Task(
        sample_id=f"{rollout}:s{index}", rollout_id=rollout, index=index, group_index=index,
        prompt=line["prompt"], label=line["label"], dataset_name="swe_format",
        task_type="swe", source_line=index + 1,
    )  # fmt: skip


def context_for(task: Task, tmp_path: Path, *, sandboxes: SandboxProvider | None,
                backends: BackendPool, timeout_s: float = 300.0) -> EpisodeContext:  # fmt: skip
    return EpisodeContext(
        rollout_id=task.rollout_id,
        sample_id=task.sample_id,
        attempt=1,
        stopping=StoppingCriteria(max_turns=6, max_new_tokens=96, timeout_s=timeout_s),
        sampling_params=SamplingParams(temperature=0.0),
        tmp_dir=tmp_path / "attempt",
        backends=backends,
        sandboxes=sandboxes,
        seed=3,
    )


async def episode(agent: InstalledAgent, task: Task,
                  context: EpisodeContext) -> tuple[AgentResult, Reward]:  # fmt: skip
    ep = agent.episode(task)
    try:
        await ep.init(context)
        result = await ep.run(context)
        return result, await ep.eval(context, result)
    finally:
        await ep.cleanup(context)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(pid))
    return found


def assert_torn_down(run_dir: Path) -> None:
    """No process of the run, the proxy's port closed, the bridge's socket gone."""
    assert processes_mentioning(str(run_dir)) == []
    config = yaml.safe_load((run_dir / "mini.yaml").read_text())
    bridge = config["environment"]["bridge"].removeprefix("unix:")
    assert not Path(bridge).exists()
    api_base = config["model"]["model_kwargs"]["api_base"]
    host, port = api_base.removeprefix("http://").split("/")[0].split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2):
        pass


def check_token_level(result: AgentResult, tokenizer: Any, task: Task) -> None:
    assert result.termination_reason is TerminationReason.FINISH
    assert result.has_logprobs
    mask = list(result.loss_mask)
    logprobs = list(result.response_logprobs)
    assert set(mask) == {0, 1}
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 0)
    assert any(lp < 0.0 for lp, m in zip(logprobs, mask, strict=True) if m == 1)
    assert len(result.turns) == 3  # fix, test, submit: one model call each
    # every generated run is one mini-swe-agent reply: a THOUGHT and one bash block
    ids = list(result.response_token_ids)
    segments: list[list[int]] = []
    current: list[int] = []
    for tid, m in zip(ids, mask, strict=True):
        if m:
            current.append(tid)
        elif current:
            segments.append(current)
            current = []
    if current:
        segments.append(current)
    replies = [tokenizer.decode(seg, skip_special_tokens=True) for seg in segments]
    assert len(replies) == 3
    assert all(r.startswith("THOUGHT:") and r.count("```bash") == 1 for r in replies)
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in replies[-1]
    prompt = tokenizer.decode(list(result.prompt_token_ids))
    assert str(task.prompt).splitlines()[0] in prompt


async def test_mini_swe_agent_through_the_proxy_in_a_local_sandbox(
    tmp_path: Path, provider: LocalSandboxProvider, backends: BackendPool, tokenizer: Any
) -> None:
    task = task_for(0)
    logs = tmp_path / "logs"
    agent = InstalledAgent(swe_agent_config(tokenizer=tokenizer, logs_dir=logs))
    context = context_for(task, tmp_path, sandboxes=provider, backends=backends)
    result, reward = await episode(agent, task, context)
    check_token_level(result, tokenizer, task)
    assert reward == {"score": 1.0, "test_exit_code": 0.0}
    assert result.metrics["capture_valid"] == 1.0
    assert result.metrics["bridge_commands"] == 3.0
    kept = logs / task.rollout_id / f"{task.sample_id}.1"
    trajectory = json.loads((kept / "trajectory.json").read_text())
    assert trajectory["info"]["exit_status"] == "Submitted"
    artifact = json.loads((kept / "artifact.json").read_text())
    assert ITEMS[0].new in artifact[ITEMS[0].fix_file]
    assert_torn_down(context.tmp_dir / "scaffold")
    assert await provider.reap({"rollout.sample": task.sample_id}) == 0


async def test_capture_off_talks_to_the_model_server_and_keeps_no_tokens(
    tmp_path: Path, provider: LocalSandboxProvider, backends: BackendPool, tokenizer: Any
) -> None:
    task = task_for(1)
    agent = InstalledAgent(swe_agent_config(tokenizer=tokenizer, capture_tokens=False))
    context = context_for(task, tmp_path, sandboxes=provider, backends=backends)
    result, reward = await episode(agent, task, context)
    assert result.termination_reason is TerminationReason.FINISH
    assert len(result.response_token_ids) == 0 and not result.has_logprobs
    assert "capture_valid" not in result.metrics
    assert result.metrics["scaffold_steps"] == 3.0
    assert reward == {"score": 1.0, "test_exit_code": 0.0}
    config = yaml.safe_load((context.tmp_dir / "scaffold" / "mini.yaml").read_text())
    assert config["model"]["model_kwargs"]["api_base"] == backends.default_url + "/v1"


@pytest.mark.docker
async def test_mini_swe_agent_runs_its_commands_in_a_container(
    tmp_path: Path, docker_image: str, backends: BackendPool, tokenizer: Any  # noqa: F811
) -> None:
    from engine.sandbox.docker import DockerSandboxConfig, DockerSandboxProvider

    docker = DockerSandboxProvider(DockerSandboxConfig(image=docker_image))
    task = task_for(2, rollout="r-docker")
    try:
        agent = InstalledAgent(swe_agent_config(tokenizer=tokenizer))
        context = context_for(task, tmp_path, sandboxes=docker, backends=backends)
        result, reward = await episode(agent, task, context)
        check_token_level(result, tokenizer, task)
        assert reward == {"score": 1.0, "test_exit_code": 0.0}
        assert_torn_down(context.tmp_dir / "scaffold")
        assert await docker.reap({"rollout.sample": task.sample_id}) == 0  # container gone
    finally:
        await docker.reap({"rollout.rollout": "r-docker"})
        docker.close()


async def test_a_missing_scaffold_is_a_config_error_and_the_sandbox_goes(
    tmp_path: Path, provider: LocalSandboxProvider, idle_backends: BackendPool
) -> None:
    task = task_for(0, rollout="r-missing")
    config = swe_agent_config(tokenizer=object())
    broken = replace(config, scaffold=MiniSweAgent(python=str(tmp_path / "no-python")))
    context = context_for(task, tmp_path, sandboxes=provider, backends=idle_backends)
    with pytest.raises(ConfigError, match="mini-swe-agent is not installed here.*pip install"):
        await episode(InstalledAgent(broken), task, context)
    assert await provider.reap({"rollout.sample": task.sample_id}) == 0


async def test_a_run_past_its_wall_clock_is_killed_and_aborts_as_a_timeout(
    tmp_path: Path, provider: LocalSandboxProvider, idle_backends: BackendPool, tinylm_dir: Path
) -> None:
    task = task_for(0, rollout="r-clock")
    agent = InstalledAgent(swe_agent_config(tokenizer=load_tokenizer(tinylm_dir)))
    # mini-swe-agent takes seconds just to import LiteLLM: one second is never enough.
    context = context_for(
        task, tmp_path, sandboxes=provider, backends=idle_backends, timeout_s=1.0
    )
    with pytest.raises(EpisodeTimeout, match="ran past its wall clock"):
        await episode(agent, task, context)
    assert_torn_down(context.tmp_dir / "scaffold")
    assert await provider.reap({"rollout.sample": task.sample_id}) == 0


async def test_a_reply_the_scaffold_drops_turns_capture_off(
    tmp_path: Path, tinylm_dir: Path, provider: LocalSandboxProvider
) -> None:
    """An untrained model never writes a bash block: mini-swe-agent drops each malformed reply
    from its history, the proxy's append-only guard fires, and the training episode yields no
    token data (it raises) instead of a corrupt sample. The scaffold still ran to its end."""
    tokenizer = load_tokenizer(tinylm_dir)
    task = task_for(0, rollout="r-drop")
    agent = InstalledAgent(swe_agent_config(tokenizer=tokenizer))
    with spawn_server(tinylm_dir) as server:
        pool = BackendPool(
            server.url, build=lambda url: SGLangBackend(config=SGLangConfig(url=url),
                                                        tokenizer=tokenizer),
        )  # fmt: skip
        try:
            context = context_for(task, tmp_path, sandboxes=provider, backends=pool)
            with pytest.raises(AgentError, match="capture was turned off.*append-only guard"):
                await episode(agent, task, context)
        finally:
            await pool.aclose()
    run_dir = context.tmp_dir / "scaffold"
    trajectory = json.loads((run_dir / "trajectory.json").read_text())
    assert trajectory["info"]["exit_status"] == "RepeatedFormatError"
    assert_torn_down(run_dir)
    assert await provider.reap({"rollout.sample": task.sample_id}) == 0


def test_the_agent_config_is_the_one_the_evaluator_config_builds() -> None:
    config = swe_agent_config(tokenizer=object())
    assert isinstance(config, InstalledAgentConfig)
    assert config.capture_tokens and config.proxy is not None
    assert config.context_cap == 131072
