"""The bundled ``math`` and ``shell`` evaluators, built directly and as workers load them."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

import pytest

from engine.agents.dagger import DAggerAgent
from engine.agents.tool_agent import ToolAgent
from engine.agents.tools import PythonTool, ShellTool
from engine.config.evaluators import load_evaluators, load_profiles
from engine.errors import ConfigError
from engine.tasks import DATA_DIR, EVALUATOR_CONFIG, ROLLOUT_CONFIG
from engine.tasks.evaluators import build_agents, evaluator_profiles
from engine.tasks.math import MathVerifier
from engine.tasks.shell import ShellVerifier
from tinylm.corpus import PYTHON_TOOL, SHELL_TOOL


def test_the_config_returns_both_profiles_and_agents(model_dir: Path) -> None:
    args = argparse.Namespace(model_dir=str(model_dir), sglang_url="http://127.0.0.1:30000")
    specs = {spec.evaluator_id: spec for spec in evaluator_profiles(args)}
    agents = build_agents(args)
    assert list(specs) == ["math", "shell", "dagger"] == list(agents)
    for evaluator_id, tool, verifier in (
        ("math", PythonTool, MathVerifier),
        ("shell", ShellTool, ShellVerifier),
        ("dagger", PythonTool, MathVerifier),
    ):
        spec = specs[evaluator_id]
        agent = agents[evaluator_id]
        assert isinstance(agent, ToolAgent)
        assert [type(t) for t in agent.config.tools] == [tool]
        assert isinstance(agent.verifier, verifier)
        assert agent.config.sglang_url == "http://127.0.0.1:30000"
        assert spec.sample_resource.gpu == 0 and spec.sample_resource.cpu > 0
        assert spec.batch_size is not None and spec.resource.concurrency >= spec.batch_size
        stop = spec.default_stopping
        assert stop.max_turns and stop.max_context_len and stop.max_new_tokens and stop.timeout_s
    # One tokenizer, loaded once, serves every agent.
    assert agents["math"].tokenizer is agents["shell"].tokenizer  # type: ignore[attr-defined]
    assert agents["dagger"].tokenizer is agents["math"].tokenizer  # type: ignore[attr-defined]
    # The DAgger binding: the math agent with the worker's teacher (none given here).
    assert isinstance(agents["dagger"], DAggerAgent) and agents["dagger"].teacher is None


def test_worker_loads_the_config_file(model_dir: Path) -> None:
    specs = load_evaluators(EVALUATOR_CONFIG, argparse.Namespace(tokenizer_path=model_dir))
    assert set(specs) == {"math", "shell", "dagger"}
    assert specs["math"].agent.config.sglang_url is None  # type: ignore[attr-defined]


def test_the_scheduler_loads_profiles_without_a_tokenizer() -> None:
    profiles = load_profiles(EVALUATOR_CONFIG, argparse.Namespace())
    assert list(profiles) == ["math", "shell", "dagger"]


@pytest.mark.parametrize("args", [argparse.Namespace(), {"model_dir": None}, object()])
def test_missing_tokenizer_is_a_config_error(args: Any) -> None:
    with pytest.raises(ConfigError, match="tokenizer_path"):
        build_agents(args)
    with pytest.raises(ConfigError, match=str(EVALUATOR_CONFIG)):
        load_evaluators(EVALUATOR_CONFIG, args)


def test_unloadable_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=str(tmp_path)):
        build_agents({"tokenizer_path": str(tmp_path)})


def test_tool_schemas_are_the_ones_tinylm_learns() -> None:
    assert PythonTool().schema() == PYTHON_TOOL
    assert ShellTool().schema() == SHELL_TOOL


def test_bundled_files_ship_with_the_package() -> None:
    assert ROLLOUT_CONFIG.is_file()
    assert sorted(p.name for p in DATA_DIR.glob("*.jsonl")) == [
        "math_eval.jsonl",
        "math_train.jsonl",
        "shell_eval.jsonl",
        "shell_train.jsonl",
        "swe_eval.jsonl",
        "swe_train.jsonl",
    ]
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["engine"]
    assert "tasks/data/*.jsonl" in data and "tasks/*.yaml" in data
