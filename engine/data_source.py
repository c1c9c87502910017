"""Serve prompts from JSONL datasets, resumably: the cursor is a plain value in an event.

Training (``MultiDataSource``) serves datasets one after the other, then the next epoch; in an
epoch each dataset's rows come in a permutation derived from ``(seed, epoch, dataset name)``
only (``shuffle=False``: file order). ``fetch(cursor, n)`` is pure in the cursor, so the
scheduler event-sources it (``DataCursorAdvanced``) and a restart resumes exactly:
``fetch(c, 3)`` then ``fetch(c', 7)`` serves what ``fetch(c, 10)`` serves.

Eval (``build_eval_tasks``) serves every prompt (up to ``max_prompts``) of every eval dataset,
interleaved round-robin across datasets so concurrent samples spread over their sandboxes.
Every task holds its own deep copy of its prompt, label and metadata.

Files are read on first use and cached. Each non-blank line must be a JSON object with the
dataset's ``input_key`` (a string or chat messages), its ``label_key`` (when set) and its
``metadata_keys``; anything else is a ``ConfigError`` naming ``file:line`` and the dataset.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import JsonValue, Strict

from engine.domain import (
    DatasetConfig,
    DatasetEntry,
    EvalDatasetConfig,
    FrozenModel,
    NonNegInt,
    Task,
    check_prompt,
    sample_id_for,
)
from engine.errors import ConfigError

__all__ = [
    "DataCursor",
    "JsonlDataset",
    "MultiDataSource",
    "PromptRecord",
    "build_eval_tasks",
    "expand_groups",
]


class DataCursor(FrozenModel):
    """The next prompt is row ``offset`` of dataset ``dataset_index`` in epoch ``epoch``'s order.
    ``datasets`` and ``shuffled`` record what the cursor was taken over, so resuming against
    another config fails instead of drifting."""

    seed: Annotated[int, Strict()]
    datasets: tuple[str, ...]
    shuffled: Annotated[bool, Strict()] = True
    epoch: NonNegInt = 0
    dataset_index: NonNegInt = 0
    offset: NonNegInt = 0


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as read from its dataset; read-only (it shares the dataset's cached rows)."""

    dataset: DatasetConfig
    line: int  # 1-based line in the dataset file
    prompt: str | list[dict[str, JsonValue]]
    label: JsonValue
    metadata: dict[str, JsonValue]
    epoch: int = 0


class JsonlDataset:
    """One dataset file, read and validated on first use, then held in memory."""

    def __init__(self, config: DatasetConfig) -> None:
        self._config = config
        self._rows: list[PromptRecord] | None = None

    @property
    def config(self) -> DatasetConfig:
        return self._config

    def __len__(self) -> int:
        return len(self._load())

    def validate(self) -> int:
        """Read and check every line now; return the number of rows."""
        return len(self._load())

    def record(self, position: int, *, epoch: int = 0) -> PromptRecord:
        """The ``position``-th row in file order."""
        row = self._load()[position]
        return row if row.epoch == epoch else replace(row, epoch=epoch)

    def _load(self) -> list[PromptRecord]:
        if self._rows is None:
            self._rows = self._read()
        return self._rows

    def _read(self) -> list[PromptRecord]:
        cfg = self._config
        try:
            raw = cfg.path.read_bytes()
        except OSError as exc:
            raise ConfigError(f"{cfg.path}: dataset {cfg.name!r}: cannot read: {exc}") from None
        rows = [
            self._parse(number, line)
            for number, line in enumerate(raw.splitlines(), start=1)
            if line.strip()
        ]
        if not rows:
            raise ConfigError(f"{cfg.path}: dataset {cfg.name!r} has no rows")
        return rows

    def _parse(self, number: int, line: bytes) -> PromptRecord:
        cfg = self._config
        where = f"{cfg.path}:{number}: dataset {cfg.name!r}"
        try:
            row = json.loads(line)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8: {exc.reason}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if cfg.input_key not in row:
            raise ConfigError(f"{where}: missing input key {cfg.input_key!r}")
        try:
            prompt = check_prompt(row[cfg.input_key])
        except ValueError as exc:
            raise ConfigError(f"{where}: input key {cfg.input_key!r}: {exc}") from None
        label: JsonValue = None
        if cfg.label_key is not None:
            if cfg.label_key not in row:
                raise ConfigError(f"{where}: missing label key {cfg.label_key!r}")
            label = row[cfg.label_key]
        metadata: dict[str, JsonValue] = {}
        for key in cfg.metadata_keys:
            if key not in row:
                raise ConfigError(f"{where}: missing metadata key {key!r}")
            metadata[key] = row[key]
        return PromptRecord(dataset=cfg, line=number, prompt=prompt, label=label, metadata=metadata)


class MultiDataSource:
    """Training prompts from several datasets, FIFO across them, reshuffled per epoch."""

    def __init__(
        self, datasets: Sequence[DatasetEntry | JsonlDataset], *, shuffle: bool = True
    ) -> None:
        if not datasets:
            raise ConfigError("MultiDataSource needs at least one dataset")
        self._datasets = [d if isinstance(d, JsonlDataset) else JsonlDataset(d) for d in datasets]
        names = [d.config.name for d in self._datasets]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"MultiDataSource: dataset names {duplicates} appear twice")
        self._names = tuple(names)
        self._shuffle = shuffle
        self._orders: dict[tuple[int, int, int], tuple[int, ...]] = {}

    def start(self, seed: int) -> DataCursor:
        """The cursor before the first prompt of epoch 0 for ``seed``."""
        return DataCursor(seed=seed, datasets=self._names, shuffled=self._shuffle)

    def fetch(self, cursor: DataCursor, n_prompts: int) -> tuple[list[PromptRecord], DataCursor]:
        """The next ``n_prompts`` prompts after ``cursor`` and the cursor after them. The data
        never runs out: a caller wanting bounded epochs stops on ``cursor.epoch``."""
        if n_prompts < 0:
            raise ValueError(f"n_prompts must be non-negative, got {n_prompts}")
        if (cursor.datasets, cursor.shuffled) != (self._names, self._shuffle):
            raise ConfigError(
                f"data cursor was taken over datasets {list(cursor.datasets)} "
                f"(shuffled={cursor.shuffled}) but this source serves {list(self._names)} "
                f"(shuffled={self._shuffle})"
            )
        epoch, index, offset = cursor.epoch, cursor.dataset_index, cursor.offset
        if index >= len(self._datasets) or offset >= len(self._datasets[index]):
            raise ConfigError(
                f"data cursor (dataset {index}, offset {offset}) is past the end of the "
                f"datasets; did a dataset file shrink?"
            )
        records: list[PromptRecord] = []
        while len(records) < n_prompts:
            dataset = self._datasets[index]
            order = self._order(cursor.seed, epoch, index)
            take = min(n_prompts - len(records), len(order) - offset)
            window = order[offset : offset + take]
            records.extend(dataset.record(position, epoch=epoch) for position in window)
            offset += take
            if offset == len(order):
                index, offset = index + 1, 0
                if index == len(self._datasets):
                    index, epoch = 0, epoch + 1
        advanced = cursor.model_copy(
            update={"epoch": epoch, "dataset_index": index, "offset": offset}
        )
        return records, advanced

    def _order(self, seed: int, epoch: int, index: int) -> tuple[int, ...]:
        key = (seed, epoch, index)
        order = self._orders.get(key)
        if order is None:
            positions = list(range(len(self._datasets[index])))
            if self._shuffle:
                # An int-seeded private Random: reproducible across processes, untouched by
                # global random state and hash randomization.
                random.Random(_shuffle_seed(seed, epoch, self._names[index])).shuffle(positions)
            order = tuple(positions)
            # One epoch at a time is live; keep the cache from growing with the epochs.
            self._orders = {k: v for k, v in self._orders.items() if k[:2] == (seed, epoch)}
            self._orders[key] = order
        return order


def _shuffle_seed(seed: int, epoch: int, dataset_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{dataset_name}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def expand_groups(
    records: Sequence[PromptRecord],
    *,
    rollout_id: str,
    first_index: int = 0,
    first_group_index: int = 0,
) -> list[Task]:
    """Each record becomes ``copies_per_prompt`` consecutive tasks sharing one group index,
    numbered on from ``first_index`` / ``first_group_index``."""
    tasks: list[Task] = []
    for group_offset, record in enumerate(records):
        group_index = first_group_index + group_offset
        for _ in range(record.dataset.copies_per_prompt):
            tasks.append(_task(record, rollout_id, first_index + len(tasks), group_index))
    return tasks


def build_eval_tasks(
    datasets: Sequence[JsonlDataset],
    *,
    rollout_id: str,
    first_index: int = 0,
    first_group_index: int = 0,
) -> list[Task]:
    """Every eval sample, interleaved round-robin across datasets; group indices number
    (dataset, prompt) pairs dataset by dataset."""
    per_dataset: list[list[tuple[PromptRecord, int]]] = []
    group = first_group_index
    for dataset in datasets:
        config = dataset.config
        n_prompts = len(dataset)
        if isinstance(config, EvalDatasetConfig) and config.max_prompts is not None:
            n_prompts = min(n_prompts, config.max_prompts)
        samples: list[tuple[PromptRecord, int]] = []
        for position in range(n_prompts):
            record = dataset.record(position)
            samples.extend((record, group) for _ in range(config.copies_per_prompt))
            group += 1
        per_dataset.append(samples)
    interleaved = [
        sample
        for round_ in range(max((len(s) for s in per_dataset), default=0))
        for sample in (s[round_] for s in per_dataset if round_ < len(s))
    ]
    return [
        _task(record, rollout_id, first_index + i, group_index)
        for i, (record, group_index) in enumerate(interleaved)
    ]


def _task(record: PromptRecord, rollout_id: str, index: int, group_index: int) -> Task:
    return Task(
        sample_id=sample_id_for(rollout_id, index),
        rollout_id=rollout_id,
        index=index,
        group_index=group_index,
        prompt=_own(record.prompt),
        label=_own(record.label),
        dataset_name=record.dataset.name,
        task_type=record.dataset.task_type,
        source_line=record.line,
        metadata=_own(record.metadata),
    )


_IMMUTABLE = (str, int, float, bool, type(None))


def _own(value: Any) -> Any:
    """The task's own copy of a record's value; immutable values are shared, skipping
    ``deepcopy``'s dispatch per sample."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return value
    if (kind is dict or kind is list) and not value:
        return kind()
    return copy.deepcopy(value)
