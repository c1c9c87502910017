from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from engine.config.rollout import load_rollout_config
from engine.domain import SamplingParams, StoppingCriteria
from engine.errors import ConfigError
from tests.fakes import write_jsonl


@pytest.fixture
def data_root(tmp_path: Path) -> Path:
    (tmp_path / "data" / "swe").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "swe" / "train.jsonl", [{"prompt": "p", "iid": "x"}])
    write_jsonl(tmp_path / "data" / "retool_math.jsonl", [{"prompt": "p", "label": "1"}])
    write_jsonl(tmp_path / "data" / "aime.jsonl", [{"prompt": "p", "label": "1"}])
    return tmp_path


def _write(directory: Path, text: str) -> Path:
    path = directory / "rollout.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


SEED_CONFIG = """
    rollout:
      defaults:
        task_type: swe
        max_context_len: 65536
        sampling_params: {temperature: 1.0, top_p: 0.95}
      datasets:
        swe_gym_train:
          path: data/swe/train.jsonl
          input_key: prompt
          label_key: iid
        retool_math:
          path: data/retool_math.jsonl
          task_type: retool
          max_context_len: 32768
          n_samples_per_prompt: 8
          sampling_params: {temperature: 0.6}
    eval:
      datasets:
        aime:
          path: data/aime.jsonl
          task_type: retool
          n_samples_per_eval_prompt: 4
          max_prompts: 30
"""


def test_seed_example_with_defaults_and_overrides(data_root: Path) -> None:
    config = load_rollout_config(_write(data_root, SEED_CONFIG), environ={})
    swe, math = config.datasets
    assert [swe.name, math.name] == ["swe_gym_train", "retool_math"]
    assert swe.task_type == "swe"
    assert swe.label_key == "iid"
    assert swe.path == data_root.resolve() / "data/swe/train.jsonl"
    assert swe.stopping == StoppingCriteria(max_context_len=65536)
    assert math.task_type == "retool"
    assert math.stopping == StoppingCriteria(max_context_len=32768)
    assert math.n_samples_per_prompt == 8
    # sampling params merge key by key: the dataset's temperature, the default's top_p
    assert math.sampling_params == SamplingParams(temperature=0.6, top_p=0.95)
    (aime,) = config.eval_datasets
    assert (aime.n_samples_per_eval_prompt, aime.max_prompts) == (4, 30)
    assert aime.sampling_params == SamplingParams()  # eval does not inherit training defaults
    assert config.task_types == {"swe", "retool"}


def test_root_argument_then_env_then_yaml_directory(data_root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "configs"
    elsewhere.mkdir()
    path = _write(elsewhere, SEED_CONFIG)
    with pytest.raises(ConfigError, match="no such file"):
        load_rollout_config(path, environ={})  # anchored at configs/: files are not there
    by_env = load_rollout_config(path, environ={"ROLLOUT_ROOT": str(data_root)})
    assert by_env.datasets[0].path == data_root / "data/swe/train.jsonl"
    by_arg = load_rollout_config(path, root=data_root, environ={"ROLLOUT_ROOT": "/nowhere"})
    assert by_arg.datasets[0].path == data_root / "data/swe/train.jsonl"


def test_absolute_paths_are_kept(data_root: Path, tmp_path: Path) -> None:
    absolute = data_root / "data" / "aime.jsonl"
    path = _write(
        tmp_path,
        f"""
        rollout:
          datasets:
            a: {{path: {absolute}, task_type: m}}
        """,
    )
    assert load_rollout_config(path, root="/elsewhere").datasets[0].path == absolute


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "rollout:\n  datasets:\n    retool_math: {path: data/retool_math.jsonl, task_type: 3}",
            "rollout.yaml: dataset 'retool_math': key 'task_type' must be a string, got 3",
        ),
        (
            "rollout:\n  datasets:\n    retool_math: {path: data/retool_math.jsonl, tasktype: m}",
            "rollout.yaml: dataset 'retool_math': unknown key 'tasktype' "
            "(did you mean 'task_type'?)",
        ),
        (
            "rollout:\n  datasets:\n    m: {path: data/retool_math.jsonl}",
            "rollout.yaml: dataset 'm': key 'task_type' is required",
        ),
        (
            "rollout:\n  datasets:\n    m: {task_type: m}",
            "rollout.yaml: dataset 'm': key 'path' is required",
        ),
        (
            "rollout:\n  datasets:\n    m: {path: data/missing.jsonl, task_type: m}",
            "rollout.yaml: dataset 'm': key 'path': no such file",
        ),
        (
            "rollout:\n  datasets:\n"
            "    m: {path: data/retool_math.jsonl, task_type: m, n_samples_per_prompt: '8'}",
            "rollout.yaml: dataset 'm': key 'n_samples_per_prompt' must be an integer, got '8'",
        ),
        (
            "rollout:\n  datasets:\n"
            "    m: {path: data/retool_math.jsonl, task_type: m, max_context_len: 0}",
            "rollout.yaml: dataset 'm': key 'max_context_len' must be at least 1, got 0",
        ),
        (
            "rollout:\n  datasets:\n"
            "    m: {path: data/retool_math.jsonl, task_type: m, "
            "sampling_params: {temperature: hot}}",
            "rollout.yaml: dataset 'm': key 'sampling_params.temperature' must be a number, "
            "got 'hot'",
        ),
        (
            "rollout:\n  defaults: {task_type: [x]}\n  datasets:\n"
            "    m: {path: data/retool_math.jsonl}",
            "rollout.yaml: dataset 'm': key 'task_type' (from rollout.defaults) must be a "
            "string, got ['x']",
        ),
        (
            "rollout:\n  defaults: {path: x.jsonl}\n  datasets:\n    m: {task_type: m}",
            "rollout.yaml: rollout.defaults: 'path' must be set per dataset",
        ),
        (
            "eval:\n  datasets:\n"
            "    m: {path: data/aime.jsonl, task_type: m, n_samples_per_prompt: 4}",
            "rollout.yaml: dataset 'm': unknown key 'n_samples_per_prompt' "
            "(did you mean 'n_samples_per_eval_prompt'?)",
        ),
        ("rollout:\n  datasets: {}", "rollout.yaml: rollout.datasets must be a non-empty"),
        ("evals: {}", "rollout.yaml: unknown key 'evals' (did you mean 'eval'?)"),
        ("- a\n- b", "rollout.yaml: expected a mapping"),
        ("rollout:\n  datasets:\n    bad name: {}", "rollout.yaml: dataset 'bad name': the name"),
        (
            "rollout:\n  datasets:\n    m: {path: data/aime.jsonl, task_type: m}\n"
            "    m: {path: data/aime.jsonl, task_type: m}",
            "rollout.yaml:4: invalid YAML: duplicate key 'm'",
        ),
        ("rollout: [unclosed", "rollout.yaml:1: invalid YAML"),
    ],
)
def test_bad_config_names_file_dataset_and_key(data_root: Path, body: str, message: str) -> None:
    path = _write(data_root, body)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_rollout_config(path, environ={})


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: rollout config not found"):
        load_rollout_config(tmp_path / "nope.yaml", environ={})
