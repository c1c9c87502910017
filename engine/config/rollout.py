"""The rollout YAML: which datasets feed training and eval, and their per-dataset overrides.

Schema::

    rollout:
      defaults: {task_type: swe, max_context_len: 65536}   # optional, shared by the datasets
      datasets:
        swe_gym_train: {path: data/swe/train.jsonl, input_key: prompt, label_key: instance_id}
        retool_math: {path: data/retool_math.jsonl, task_type: retool}
    eval:                                                   # optional
      defaults: {...}
      datasets:
        aime: {path: data/aime.jsonl, task_type: retool, n_samples_per_eval_prompt: 4}

A dataset's keys are the fields of ``DatasetEntry`` (training) or ``EvalDatasetConfig`` (eval).
A section's ``defaults`` supply any key but ``path`` (the dataset's own value wins,
``sampling_params`` merge key by key); eval datasets do not inherit the training defaults.
Relative paths resolve against ``root`` (argument, else ``ROLLOUT_ROOT``, else the YAML's
directory); every dataset file must exist; unknown and duplicate keys are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import ValidationError

from engine.domain import DatasetEntry, EvalDatasetConfig, FrozenModel, check_identifier
from engine.errors import ConfigError
from engine.messages import explain, unknown_key_message
from engine.settings import Settings

__all__ = ["RolloutConfig", "load_rollout_config", "parse_rollout_config"]

_SECTIONS = ("rollout", "eval")
_Dataset = TypeVar("_Dataset", DatasetEntry, EvalDatasetConfig)
_SECTION_KEYS = ("defaults", "datasets")


class RolloutConfig(FrozenModel):
    """The datasets of a run, in the order the YAML lists them (the serving order)."""

    datasets: tuple[DatasetEntry, ...] = ()
    eval_datasets: tuple[EvalDatasetConfig, ...] = ()

    @property
    def task_types(self) -> frozenset[str]:
        return frozenset(d.task_type for d in (*self.datasets, *self.eval_datasets))


def load_rollout_config(
    path: str | Path,
    *,
    root: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> RolloutConfig:
    source = str(path)
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: rollout config not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read rollout config: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{line}: invalid YAML: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    if root is None:
        root = Settings.from_env(environ).root
    anchor = Path(root) if root is not None else file.resolve().parent
    return parse_rollout_config(data, source=source, root=anchor)


def parse_rollout_config(data: object, *, source: str, root: Path) -> RolloutConfig:
    """Validate an already-loaded rollout document; ``source`` prefixes every error."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}: expected a mapping with a 'rollout' and/or 'eval' section, "
            f"got {type(data).__name__}"
        )
    for key in data:
        if key not in _SECTIONS:
            raise ConfigError(f"{source}: {unknown_key_message(key, _SECTIONS)}")
    train = _parse_section(data.get("rollout"), "rollout", DatasetEntry, source, root)
    evals = _parse_section(data.get("eval"), "eval", EvalDatasetConfig, source, root)
    if not train and not evals:
        raise ConfigError(f"{source}: no datasets: define rollout.datasets or eval.datasets")
    return RolloutConfig(datasets=tuple(train), eval_datasets=tuple(evals))


def _parse_section(
    section: object,
    name: str,
    model: type[_Dataset],
    source: str,
    root: Path,
) -> list[_Dataset]:
    if section is None:
        return []
    if not isinstance(section, dict):
        raise ConfigError(f"{source}: {name} must be a mapping, got {type(section).__name__}")
    for key in section:
        if key not in _SECTION_KEYS:
            raise ConfigError(f"{source}: {name}: {unknown_key_message(key, _SECTION_KEYS)}")
    known = [field for field in model.model_fields if field not in ("kind", "name")]
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(
            f"{source}: {name}.defaults must be a mapping, got {type(defaults).__name__}"
        )
    for key in defaults:
        if key == "path":
            raise ConfigError(f"{source}: {name}.defaults: 'path' must be set per dataset")
        if key not in known:
            raise ConfigError(f"{source}: {name}.defaults: {unknown_key_message(key, known)}")
    datasets = section.get("datasets")
    if not isinstance(datasets, dict) or not datasets:
        raise ConfigError(
            f"{source}: {name}.datasets must be a non-empty mapping of dataset name to "
            f"settings, got {datasets!r}"
        )
    return [
        _parse_dataset(
            dataset_name, settings, defaults, model=model, section=name, source=source, root=root
        )
        for dataset_name, settings in datasets.items()
    ]


def _parse_dataset(
    dataset_name: object,
    settings: object,
    defaults: dict[str, Any],
    *,
    model: type[_Dataset],
    section: str,
    source: str,
    root: Path,
) -> _Dataset:
    if not isinstance(dataset_name, str):
        raise ConfigError(
            f"{source}: {section}.datasets: dataset name {dataset_name!r} must be a string"
        )
    where = f"{source}: dataset {dataset_name!r}"
    try:
        check_identifier(dataset_name)
    except ValueError as exc:
        raise ConfigError(f"{where}: the name {exc}") from None
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: expected a mapping of settings, got {settings!r}")
    known = [field for field in model.model_fields if field not in ("kind", "name")]
    for key in settings:
        if key not in known:
            raise ConfigError(f"{where}: {unknown_key_message(key, known)}")
    merged = {**defaults, **settings}
    base_sampling = defaults.get("sampling_params")
    own_sampling = settings.get("sampling_params")
    if isinstance(base_sampling, dict) and isinstance(own_sampling, dict):
        merged["sampling_params"] = {**base_sampling, **own_sampling}
    if "path" not in merged:
        raise ConfigError(f"{where}: key 'path' is required")
    raw_path = merged["path"]
    if not isinstance(raw_path, str) or not raw_path:
        raise ConfigError(f"{where}: key 'path' must be a non-empty string, got {raw_path!r}")
    path = Path(raw_path)
    if not path.is_absolute():
        path = root / path
    if not path.is_file():
        raise ConfigError(f"{where}: key 'path': no such file {str(path)!r}")
    merged["path"] = path
    try:
        return model.model_validate({**merged, "name": dataset_name})
    except ValidationError as exc:
        problems = []
        for key, problem in explain(exc):
            top = key.split(".")[0].split("[")[0]
            origin = ""
            if top in defaults and top not in settings:
                origin = f" (from {section}.defaults)"
            problems.append(f"key {key!r}{origin} {problem}" if key else problem)
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe loader refusing duplicate keys, which PyYAML overwrites (a second dataset of the
    same name would replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, list | dict):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
