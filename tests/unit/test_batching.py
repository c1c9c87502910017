from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from engine.batching import (
    BatchingStrategy,
    fifo_batching,
    resolve_profile,
    resolve_sampling_params,
    resolve_stopping,
)
from engine.domain import (
    Batch,
    DatasetEntry,
    EvaluatorProfile,
    SamplingParams,
    StoppingCriteria,
    Task,
    sample_id_for,
)
from engine.errors import ConfigError


def _tasks(types: str, rollout_id: str = "r1", first_index: int = 0) -> list[Task]:
    return [
        Task(
            sample_id=sample_id_for(rollout_id, first_index + i),
            rollout_id=rollout_id,
            index=first_index + i,
            group_index=first_index + i,
            prompt=f"p{i}",
            dataset_name=f"ds_{t}",
            task_type=t,
            source_line=1,
        )
        for i, t in enumerate(types)
    ]


def _spec(evaluator_id: str, **fields: Any) -> EvaluatorProfile:
    return EvaluatorProfile(evaluator_id=evaluator_id, **fields)


def _shape(batches: list[Batch]) -> list[tuple[str, list[int]]]:
    return [(b.task_type, [t.index for t in b.tasks]) for b in batches]


class TestFifoBatching:
    def test_groups_by_type_in_encounter_order_and_seals_at_batch_size(self) -> None:
        specs = {"a": _spec("a", batch_size=2), "b": _spec("b", batch_size=3)}
        batches = fifo_batching(_tasks("abaabab"), specs)
        assert _shape(batches) == [
            ("a", [0, 2]),
            ("b", [1, 4, 6]),
            ("a", [3, 5]),
        ]

    def test_no_batch_size_or_no_spec_keeps_one_open_batch(self) -> None:
        specs = {"a": _spec("a")}
        batches = fifo_batching(_tasks("abab"), specs)
        assert _shape(batches) == [("a", [0, 2]), ("b", [1, 3])]

    def test_batch_ids_are_deterministic_and_unique_across_calls(self) -> None:
        specs = {"a": _spec("a", batch_size=2)}
        first = fifo_batching(_tasks("aaa"), specs)
        second = fifo_batching(_tasks("aa", first_index=3), specs)
        ids = [b.batch_id for b in first + second]
        assert ids == ["r1:b0", "r1:b2", "r1:b3"]
        assert [b.batch_id for b in fifo_batching(_tasks("aaa"), specs)] == ids[:2]

    def test_every_task_lands_in_exactly_one_batch(self) -> None:
        tasks = _tasks("abcabcaab")
        batches = fifo_batching(tasks, {"a": _spec("a", batch_size=1)})
        assert sorted(t.index for b in batches for t in b.tasks) == list(range(len(tasks)))

    def test_is_a_batching_strategy(self) -> None:
        strategy: BatchingStrategy = fifo_batching
        assert strategy([], {}) == []


class TestResolveProfile:
    def test_exact_match(self) -> None:
        specs = {"a": _spec("a"), "b": _spec("b")}
        assert resolve_profile("b", specs) is specs["b"]

    def test_fallback_to_first_with_warning(self, caplog: pytest.LogCaptureFixture) -> None:
        specs = {"a": _spec("a"), "b": _spec("b")}
        with caplog.at_level(logging.WARNING, logger="engine.batching"):
            assert resolve_profile("zzz", specs) is specs["a"]
        assert "no evaluator with id 'zzz'" in caplog.text

    def test_no_specs(self) -> None:
        with pytest.raises(ConfigError, match="no evaluator profiles to run task type 'a'"):
            resolve_profile("a", {})


class TestCascade:
    def test_stopping_precedence_field_by_field(self) -> None:
        flags = StoppingCriteria(max_turns=1, max_context_len=1, max_new_tokens=1, timeout_s=1)
        spec = _spec(
            "a", default_stopping=StoppingCriteria(max_turns=2, max_context_len=2, max_new_tokens=2)
        )
        dataset = DatasetEntry(name="d", path=Path("/d.jsonl"), task_type="a", max_turns=3)
        assert resolve_stopping(flags, spec, dataset) == StoppingCriteria(
            max_turns=3,  # dataset (finest) wins
            max_context_len=2,  # spec default over flags
            max_new_tokens=2,
            timeout_s=1,  # only the flags set it
        )

    @pytest.mark.parametrize(
        "field, flag, spec_value, dataset_value, expected",
        [
            ("max_turns", 10, None, None, 10),
            ("max_turns", 10, 20, None, 20),
            ("max_turns", 10, 20, 30, 30),
            ("max_turns", None, None, 30, 30),
            ("max_context_len", 100, None, 300, 300),
            ("max_new_tokens", None, 200, None, 200),
            ("timeout_s", 1.0, 2.0, 3.0, 3.0),
            ("timeout_s", None, None, None, None),
        ],
    )
    def test_stopping_each_field(
        self,
        field: str,
        flag: object,
        spec_value: object,
        dataset_value: object,
        expected: object,
    ) -> None:
        flags = StoppingCriteria.model_validate({field: flag})
        spec = _spec("a", default_stopping=StoppingCriteria.model_validate({field: spec_value}))
        dataset = DatasetEntry.model_validate(
            {"name": "d", "path": "/d.jsonl", "task_type": "a", field: dataset_value}
        )
        assert getattr(resolve_stopping(flags, spec, dataset), field) == expected

    def test_sampling_precedence_field_by_field(self) -> None:
        flags = SamplingParams(temperature=1.0, top_p=1.0, top_k=50, stop=("a",))
        spec = _spec("a", default_sampling_params=SamplingParams(temperature=0.8, top_p=0.9))
        dataset = DatasetEntry(
            name="d",
            path=Path("/d.jsonl"),
            task_type="a",
            sampling_params=SamplingParams(temperature=0.6, min_p=0.05),
        )
        resolved = resolve_sampling_params(flags, spec, dataset)
        assert resolved == SamplingParams(
            temperature=0.6, top_p=0.9, top_k=50, stop=("a",), min_p=0.05
        )
        assert resolved.as_request() == {
            "temperature": 0.6,
            "top_p": 0.9,
            "top_k": 50,
            "min_p": 0.05,
            "stop": ["a"],
        }
