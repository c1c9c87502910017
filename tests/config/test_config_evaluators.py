from __future__ import annotations

import ast
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config.evaluators import load_evaluators, load_profiles
from engine.errors import ConfigError

HEADER = """
from engine.domain import EvaluatorProfile, Resource, StoppingCriteria
from tests.fakes import FixedAgent
"""


def _write(tmp_path: Path, body: str, name: str = "evaluators.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body), encoding="utf-8")
    return path


def test_loads_profiles_in_order_and_passes_args(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        from dataclasses import dataclass

        @dataclass
        class Knobs:  # dataclasses need their module registered while the file runs
            concurrency: int

        def evaluator_profiles(args):
            knobs = Knobs(args.concurrency)
            return [
                EvaluatorProfile(
                    evaluator_id="swe",
                    resource=Resource(cpu=96, memory_gb=320, concurrency=knobs.concurrency),
                    run_resource=Resource(cpu=4, memory_gb=16),
                    batch_size=2,
                    default_stopping=StoppingCriteria(max_turns=100, max_context_len=65536),
                ),
                EvaluatorProfile(evaluator_id="math"),
            ]

        def build_agents(args):
            return {"math": FixedAgent(), "swe": FixedAgent()}
        """,
    )
    specs = load_profiles(path, SimpleNamespace(concurrency=4))
    assert list(specs) == ["swe", "math"]
    assert specs["swe"].resource.concurrency == 4
    assert specs["swe"].sample_resource.cpu == 4
    bound = load_evaluators(path, SimpleNamespace(concurrency=4))
    assert list(bound) == ["swe", "math"]  # the profiles' order, not the agents'
    assert bound["swe"].profile == specs["swe"]
    assert type(bound["math"].agent).__name__ == "FixedAgent"


def test_the_scheduler_side_never_builds_an_agent(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        def evaluator_profiles(args):
            return [EvaluatorProfile(evaluator_id="math")]

        def build_agents(args):
            raise RuntimeError("the scheduler must not build agents")
        """,
    )
    assert list(load_profiles(path, None)) == ["math"]
    with pytest.raises(ConfigError, match="must not build agents"):
        load_evaluators(path, None)


@pytest.mark.parametrize(
    "body, message",
    [
        ("x = 1\n", "defines no evaluator_profiles(args) function"),
        ("evaluator_profiles = 3\n", "evaluator_profiles is not callable"),
        (
            "def evaluator_profiles(args):\n    return None\n",
            "must return a list of EvaluatorProfile, got NoneType",
        ),
        ("def evaluator_profiles(args):\n    return []\n", "returned no evaluators"),
        (
            "def evaluator_profiles(args):\n    return [1]\n",
            "item 0 must be an EvaluatorProfile, got int",
        ),
        (
            "def evaluator_profiles(args):\n"
            "    return [EvaluatorProfile(evaluator_id='a')] * 2\n",
            "evaluator id 'a' is returned more than once",
        ),
        (
            "def evaluator_profiles(args):\n"
            "    return [EvaluatorProfile(evaluator_id='a', batch_size=0)]\n",
            "evaluator_profiles(args) refused its config: evaluator 'a': batch_size",
        ),
        ("def evaluator_profiles(args):\n    return args.missing\n", "raised AttributeError"),
        ("import no_such_module_here\n", "importing the evaluator config failed"),
        ("def broken(:\n", "importing the evaluator config failed: SyntaxError"),
    ],
)
def test_errors_name_the_file(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_profiles(path, SimpleNamespace())
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_evaluators(path, SimpleNamespace())


PROFILES = (
    "def evaluator_profiles(args):\n"
    "    return [EvaluatorProfile(evaluator_id='a'), EvaluatorProfile(evaluator_id='b')]\n"
)


@pytest.mark.parametrize(
    "agents, message",
    [
        ("", "defines no build_agents(args) function"),
        ("def build_agents(args):\n    return [FixedAgent()]\n", "must return a mapping"),
        (
            "def build_agents(args):\n    return {'a': FixedAgent()}\n",
            "build_agents(args) returned no agent for evaluator(s) ['b']",
        ),
        (
            "def build_agents(args):\n    return {'a': FixedAgent(), 'b': FixedAgent(), 'c': 1}\n",
            "returned agents for ['c'], which evaluator_profiles(args) does not define",
        ),
        (
            "def build_agents(args):\n    return {'a': FixedAgent(), 'b': 1}\n",
            "evaluator 'b': the agent must be a BaseAgent, got int",
        ),
    ],
)
def test_agent_errors_name_the_file(tmp_path: Path, agents: str, message: str) -> None:
    path = _write(tmp_path, PROFILES + agents)
    assert list(load_profiles(path, None)) == ["a", "b"]
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_evaluators(path, None)


def test_missing_file(tmp_path: Path) -> None:
    for load in (load_profiles, load_evaluators):
        with pytest.raises(
            ConfigError, match=re.escape(f"{tmp_path / 'x.py'}: evaluator config not found")
        ):
            load(tmp_path / "x.py", None)


def test_two_files_do_not_collide(tmp_path: Path) -> None:
    body = (
        "def evaluator_profiles(args):\n"
        "    return [EvaluatorProfile(evaluator_id={!r})]\n"
    )
    first = _write(tmp_path, body.format("one"), "a.py")
    second = _write(tmp_path, body.format("two"), "b.py")
    assert list(load_profiles(first, None)) == ["one"]
    assert list(load_profiles(second, None)) == ["two"]


def test_the_domain_does_not_import_the_agents() -> None:
    # engine.domain <-> engine.agents was the one import cycle: the domain holds no agent.
    source = Path(sys.modules["engine.domain"].__file__ or "").read_text(encoding="utf-8")
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {m for m in imported if m and m.startswith("engine.agents")}
    assert "engine.errors" in imported  # the walk does see the module's imports
