from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.config.evaluators import load_evaluators
from engine.errors import ConfigError

HEADER = """
from engine.domain import EvaluatorSpec, Resource, StoppingCriteria
from tests.unit.fakes import FixedAgent
"""


def _write(tmp_path: Path, body: str, name: str = "evaluators.py") -> Path:
    path = tmp_path / name
    path.write_text(HEADER + textwrap.dedent(body), encoding="utf-8")
    return path


def test_loads_specs_in_order_and_passes_args(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        from dataclasses import dataclass

        @dataclass
        class Knobs:  # dataclasses need their module registered while the file runs
            concurrency: int

        def build_evaluators(args):
            knobs = Knobs(args.concurrency)
            return [
                EvaluatorSpec(
                    evaluator_id="swe",
                    handler=FixedAgent(),
                    resource=Resource(cpu=96, memory_gb=320, concurrency=knobs.concurrency),
                    run_resource=Resource(cpu=4, memory_gb=16),
                    batch_size=2,
                    default_stopping=StoppingCriteria(max_turns=100, max_context_len=65536),
                ),
                EvaluatorSpec(evaluator_id="math", handler=FixedAgent()),
            ]
        """,
    )
    specs = load_evaluators(path, SimpleNamespace(concurrency=4))
    assert list(specs) == ["swe", "math"]
    assert specs["swe"].resource.concurrency == 4
    assert specs["swe"].sample_resource.cpu == 4


@pytest.mark.parametrize(
    "body, message",
    [
        ("x = 1\n", "defines no build_evaluators(args) function"),
        ("build_evaluators = 3\n", "build_evaluators is not callable"),
        (
            "def build_evaluators(args):\n    return None\n",
            "must return a list of EvaluatorSpec, got NoneType",
        ),
        ("def build_evaluators(args):\n    return []\n", "returned no evaluators"),
        (
            "def build_evaluators(args):\n    return [1]\n",
            "item 0 must be an EvaluatorSpec, got int",
        ),
        (
            "def build_evaluators(args):\n"
            "    return [EvaluatorSpec(evaluator_id='a', handler=FixedAgent())] * 2\n",
            "evaluator id 'a' is returned more than once",
        ),
        (
            "def build_evaluators(args):\n"
            "    return [EvaluatorSpec(evaluator_id='a', handler=1)]\n",
            "build_evaluators(args) refused its config: evaluator 'a': handler must be a BaseAgent",
        ),
        ("def build_evaluators(args):\n    return args.missing\n", "raised AttributeError"),
        ("import no_such_module_here\n", "importing the evaluator config failed"),
        ("def broken(:\n", "importing the evaluator config failed: SyntaxError"),
    ],
)
def test_errors_name_the_file(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_evaluators(path, SimpleNamespace())


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"{tmp_path / 'x.py'}: evaluator config not found")
    ):
        load_evaluators(tmp_path / "x.py", None)


def test_two_files_do_not_collide(tmp_path: Path) -> None:
    body = (
        "def build_evaluators(args):\n"
        "    return [EvaluatorSpec(evaluator_id={!r}, handler=FixedAgent())]\n"
    )
    first = _write(tmp_path, body.format("one"), "a.py")
    second = _write(tmp_path, body.format("two"), "b.py")
    assert list(load_evaluators(first, None)) == ["one"]
    assert list(load_evaluators(second, None)) == ["two"]
