"""The ``swe`` task type: generated repositories, the bundled data, and its verifier in a real
local sandbox (the planted bug fails the test; the hinted fix makes it pass; editing the test
does not)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.domain import Task
from engine.errors import ConfigError
from engine.sandbox import LocalSandboxProvider, Sandbox
from engine.tasks.swe import DATA, SweTask, fix_command, generate_items, write_dataset
from tests.conftest import local_sandbox_provider

BUNDLED = [("swe_train.jsonl", 24, 1), ("swe_eval.jsonl", 6, 2)]


def task_of(line: dict[str, object], index: int = 0) -> Task:
    return Task(
        sample_id=f"r:s{index}", rollout_id="r", index=index, group_index=index,
        prompt=line["prompt"], label=line["label"], dataset_name="swe_train",  # type: ignore[arg-type]
        task_type="swe", source_line=index + 1,
    )  # fmt: skip


@pytest.mark.parametrize(("name", "n", "seed"), BUNDLED)
def test_bundled_data_is_what_the_generator_writes(
    tmp_path: Path, name: str, n: int, seed: int
) -> None:
    write_dataset(tmp_path / name, n, seed=seed)
    assert (tmp_path / name).read_text() == (DATA / name).read_text()


def test_generation_is_deterministic_and_covers_every_family() -> None:
    a, b = generate_items(9, seed=5), generate_items(9, seed=5)
    assert a == b
    assert generate_items(9, seed=6) != a
    assert {item.fix_file for item in a} == {"calc.sh", "greet.sh", "config.sh"}


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalSandboxProvider]:
    with local_sandbox_provider("rollout-swe-tests-") as prov:
        yield prov


@pytest.fixture
async def sandbox(provider: LocalSandboxProvider) -> AsyncIterator[Sandbox]:
    box = provider.create(labels={"rollout.test": "swe"})
    await box.start()
    yield box
    await box.stop()


@pytest.mark.parametrize("index", [0, 1, 2])
async def test_the_bug_fails_and_the_fix_passes(sandbox: Sandbox, index: int) -> None:
    line = json.loads((DATA / "swe_eval.jsonl").read_text().splitlines()[index])
    task, swe = task_of(line, index), SweTask()
    item = generate_items(6, seed=2)[index]
    await swe.prepare(task, sandbox)
    before = await swe.verify(task, sandbox)
    assert before == {"score": 0.0, "test_exit_code": 1.0}
    assert (await sandbox.exec(fix_command(item))).ok
    assert await swe.verify(task, sandbox) == {"score": 1.0, "test_exit_code": 0.0}
    artifact = await swe.collect(task, sandbox)
    assert item.new in artifact[item.fix_file] and item.old not in artifact[item.fix_file]


async def test_an_edited_test_is_restored_before_scoring(sandbox: Sandbox) -> None:
    line = json.loads((DATA / "swe_eval.jsonl").read_text().splitlines()[0])
    task, swe = task_of(line), SweTask()
    await swe.prepare(task, sandbox)
    await sandbox.write_file("test.sh", "exit 0\n")
    assert (await swe.verify(task, sandbox))["score"] == 0.0


def test_a_malformed_label_is_refused_with_the_task_named() -> None:
    swe_task = task_of({"prompt": "fix", "label": {"repo": {"a.sh": "x"}, "test": "t.sh"}}, 3)
    with pytest.raises(ConfigError, match=r"swe task r:s3 .*line 4.*label.test"):
        asyncio.run(SweTask().prepare(swe_task, None))  # type: ignore[arg-type]


def test_the_swe_profile_pays_for_a_whole_batch() -> None:
    from engine.actors.admission import budget_tokens
    from engine.tasks.swe_evaluators import evaluator_profiles

    (profile,) = evaluator_profiles(None)
    assert profile.evaluator_id == "swe"
    assert profile.batch_size is not None
    assert budget_tokens(profile.resource, profile.sample_resource) >= profile.batch_size
