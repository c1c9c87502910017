from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.data_source import (
    DataCursor,
    JsonlDataset,
    MultiDataSource,
    PromptRecord,
    build_eval_tasks,
    expand_groups,
)
from engine.domain import DatasetEntry, EvalDatasetConfig
from engine.errors import ConfigError
from tests.fakes import write_jsonl


def _entry(tmp_path: Path, name: str, n_rows: int, **fields: object) -> DatasetEntry:
    path = write_jsonl(
        tmp_path / f"{name}.jsonl",
        [{"prompt": f"{name}-{i}", "label": i, "extra": {"i": i}} for i in range(n_rows)],
    )
    return DatasetEntry.model_validate({"name": name, "path": path, "task_type": name, **fields})


def _labels(records: list[PromptRecord]) -> list[tuple[str, object]]:
    return [(r.dataset.name, r.label) for r in records]


class TestMultiDataSource:
    def test_fifo_across_datasets_then_next_epoch(self, tmp_path: Path) -> None:
        source = MultiDataSource(
            [_entry(tmp_path, "a", 3), _entry(tmp_path, "b", 2)], shuffle=False
        )
        records, cursor = source.fetch(source.start(seed=0), 7)
        assert _labels(records) == [
            ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1), ("a", 0), ("a", 1)
        ]  # fmt: skip
        assert [r.epoch for r in records] == [0, 0, 0, 0, 0, 1, 1]
        assert (cursor.epoch, cursor.dataset_index, cursor.offset) == (1, 0, 2)

    def test_resume_from_cursor_equals_one_fetch(self, tmp_path: Path) -> None:
        datasets = [_entry(tmp_path, "a", 7), _entry(tmp_path, "b", 5)]
        source = MultiDataSource(datasets)
        start = source.start(seed=1234)
        at_once, end_at_once = source.fetch(start, 30)
        served: list[PromptRecord] = []
        cursor = start
        for n in (10, 1, 0, 6, 13):
            # A restarted scheduler has nothing but the cursor it logged: rebuild everything.
            restarted = MultiDataSource(datasets)
            logged = DataCursor.model_validate(cursor.model_dump(mode="json"))
            chunk, cursor = restarted.fetch(logged, n)
            served.extend(chunk)
        assert _labels(served) == _labels(at_once)
        assert cursor == end_at_once

    def test_shuffle_is_deterministic_per_seed_and_epoch(self, tmp_path: Path) -> None:
        entry = _entry(tmp_path, "a", 20)
        first, _ = MultiDataSource([entry]).fetch(DataCursor(seed=7, datasets=("a",)), 40)
        again, _ = MultiDataSource([entry]).fetch(DataCursor(seed=7, datasets=("a",)), 40)
        other, _ = MultiDataSource([entry]).fetch(DataCursor(seed=8, datasets=("a",)), 40)
        assert _labels(first) == _labels(again)
        assert _labels(first) != _labels(other)
        epoch0 = [r.line - 1 for r in first[:20]]
        epoch1 = [r.line - 1 for r in first[20:]]
        assert sorted(epoch0) == sorted(epoch1) == list(range(20))  # each epoch serves all
        assert epoch0 != epoch1  # and reshuffles
        assert epoch0 != list(range(20))

    def test_records_do_not_alias_across_fetches(self, tmp_path: Path) -> None:
        source = MultiDataSource([_entry(tmp_path, "a", 1, metadata_keys=["extra"])])
        records, cursor = source.fetch(source.start(0), 1)
        tasks = expand_groups(records, rollout_id="r")
        assert isinstance(tasks[0].metadata["extra"], dict)
        tasks[0].metadata["extra"]["i"] = 99  # a careless agent edits its task
        again, _ = source.fetch(cursor, 1)
        assert expand_groups(again, rollout_id="r")[0].metadata == {"extra": {"i": 0}}

    def test_cursor_from_other_datasets_refused(self, tmp_path: Path) -> None:
        source = MultiDataSource([_entry(tmp_path, "a", 2)])
        with pytest.raises(ConfigError, match=r"taken over datasets \['b'\]"):
            source.fetch(DataCursor(seed=0, datasets=("b",)), 1)
        with pytest.raises(ConfigError, match="shuffled=False"):
            source.fetch(DataCursor(seed=0, datasets=("a",), shuffled=False), 1)
        with pytest.raises(ConfigError, match="past the end"):
            source.fetch(DataCursor(seed=0, datasets=("a",), offset=2), 1)

    def test_duplicate_dataset_names_refused(self, tmp_path: Path) -> None:
        entry = _entry(tmp_path, "a", 2)
        with pytest.raises(ConfigError, match=r"dataset names \['a'\] appear twice"):
            MultiDataSource([entry, entry])

    def test_files_are_read_lazily(self, tmp_path: Path) -> None:
        entry = _entry(tmp_path, "a", 2)
        entry.path.unlink()
        source = MultiDataSource([entry])  # nothing read yet
        with pytest.raises(ConfigError, match="cannot read"):
            source.fetch(source.start(0), 1)


class TestGroups:
    def test_each_prompt_becomes_a_group_of_copies(self, tmp_path: Path) -> None:
        source = MultiDataSource(
            [_entry(tmp_path, "a", 2, n_samples_per_prompt=3), _entry(tmp_path, "b", 1)],
            shuffle=False,
        )
        records, _ = source.fetch(source.start(0), 3)
        tasks = expand_groups(records, rollout_id="r9", first_index=10, first_group_index=4)
        assert [(t.index, t.group_index, t.dataset_name, t.label) for t in tasks] == [
            (10, 4, "a", 0), (11, 4, "a", 0), (12, 4, "a", 0),
            (13, 5, "a", 1), (14, 5, "a", 1), (15, 5, "a", 1),
            (16, 6, "b", 0),
        ]  # fmt: skip
        assert tasks[0].sample_id == "r9:s10"
        assert tasks[0].task_type == "a"
        assert tasks[0].source_line == 1
        assert (tasks[0].dataset_name, tasks[0].task_type) == (
            records[0].dataset.name, records[0].dataset.task_type)
        assert tasks[0].prompt == "a-0"

    def test_copies_do_not_share_mutable_prompts(self, tmp_path: Path) -> None:
        path = write_jsonl(
            tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": 1}]
        )
        entry = DatasetEntry(name="c", path=path, task_type="c", n_samples_per_prompt=2)
        records, _ = MultiDataSource([entry]).fetch(DataCursor(seed=0, datasets=("c",)), 1)
        first, second = expand_groups(records, rollout_id="r")
        assert isinstance(first.prompt, list)
        first.prompt[0]["content"] = "changed"
        assert second.prompt == [{"role": "user", "content": "hi"}]
        assert records[0].prompt == [{"role": "user", "content": "hi"}]


class TestEval:
    def test_round_robin_across_datasets_with_copies(self, tmp_path: Path) -> None:
        def eval_entry(name: str, n_rows: int, **fields: object) -> JsonlDataset:
            train = _entry(tmp_path, name, n_rows)
            return JsonlDataset(
                EvalDatasetConfig.model_validate(
                    {"name": name, "path": train.path, "task_type": "m", **fields}
                )
            )

        tasks = build_eval_tasks(
            [
                eval_entry("a", 2, n_samples_per_eval_prompt=2),
                eval_entry("b", 1, n_samples_per_eval_prompt=2),
                eval_entry("c", 5, max_prompts=2),
            ],
            rollout_id="eval-3",
        )
        assert [(t.dataset_name, t.label, t.group_index) for t in tasks] == [
            ("a", 0, 0), ("b", 0, 2), ("c", 0, 3),
            ("a", 0, 0), ("b", 0, 2), ("c", 1, 4),
            ("a", 1, 1),
            ("a", 1, 1),
        ]  # fmt: skip
        assert [t.index for t in tasks] == list(range(8))
        assert tasks[0].sample_id == "eval-3:s0"
        assert (tasks[0].dataset_name, tasks[0].task_type) == ("a", "m")


class TestMalformedLines:
    @pytest.mark.parametrize(
        "line, message",
        [
            ('{"prompt": "p", "label": 1', "invalid JSON"),
            ("[1, 2]", "expected a JSON object, got list"),
            ('{"question": "p", "label": 1}', "missing input key 'prompt'"),
            ('{"prompt": "p"}', "missing label key 'label'"),
            ('{"prompt": 5, "label": 1}', "input key 'prompt': a prompt must be a string"),
            ('{"prompt": [{"content": "x"}], "label": 1}', "input key 'prompt': chat message 0"),
            ('{"prompt": "p", "label": 1}', "missing metadata key 'repo'"),
        ],
    )
    def test_error_names_file_line_and_dataset(
        self, tmp_path: Path, line: str, message: str
    ) -> None:
        path = write_jsonl(
            tmp_path / "d.jsonl", [{"prompt": "ok", "label": 0, "repo": "r"}, "", line]
        )
        entry = DatasetEntry(name="d", path=path, task_type="d", metadata_keys=("repo",))
        source = MultiDataSource([entry])
        with pytest.raises(ConfigError, match=re.escape(f"{path}:3: dataset 'd': {message}")):
            source.fetch(source.start(0), 1)

    def test_empty_file(self, tmp_path: Path) -> None:
        path = write_jsonl(tmp_path / "e.jsonl", ["", "  "])
        source = MultiDataSource([DatasetEntry(name="e", path=path, task_type="e")])
        with pytest.raises(ConfigError, match="dataset 'e' has no rows"):
            source.fetch(source.start(0), 1)

    def test_no_label_key(self, tmp_path: Path) -> None:
        path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "p"}])
        entry = DatasetEntry(name="n", path=path, task_type="n", label_key=None)
        records, _ = MultiDataSource([entry]).fetch(DataCursor(seed=0, datasets=("n",)), 1)
        assert records[0].label is None
