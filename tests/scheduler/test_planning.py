"""The planner, the scheduler's pure core: same request + same cursor -> same events."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from engine.actors.planning import Plan, Planner
from engine.config.rollout import load_rollout_config
from engine.domain import (
    Batch,
    EvaluatorProfile,
    SamplingParams,
    StoppingCriteria,
    Task,
    batch_id_for,
)
from engine.errors import ConfigError
from engine.events import BatchSealed, Envelope, RolloutPlanned, RolloutRequested, TaskFetched
from engine.events.catalog import TaskJoined
from engine.projections.base import fold, start
from engine.projections.data_cursor import DataCursorProjection, DataState
from engine.projections.readback import in_memory
from engine.projections.rollout import RolloutProjection
from tests.scheduler.helpers import load_specs, request, write_config


def planner(tmp_path: Path, **kwargs: object) -> Planner:
    config = write_config(
        tmp_path,
        {"gsm": ("math", 7), "py": ("code", 5)},
        {"aime": ("math", 2), "he": ("code", 3)},
    )
    return Planner(load_rollout_config(config), load_specs(), **kwargs)  # type: ignore[arg-type]


def after(plan: Plan) -> DataState:
    projection = DataCursorProjection()
    return projection.evolve(projection.initial(), Envelope("rl:data", "1-0", plan.cursor))


def test_every_range_of_rollout_events_is_a_slice_of_the_whole(tmp_path: Path) -> None:
    plan = planner(tmp_path).plan(request("r", n_prompts=6, n_samples_per_prompt=2), DataState())
    whole = plan.rollout_events()
    assert len(whole) == plan.n_events == 1 + 12 + len(plan.batches) + 1
    assert isinstance(whole[0], RolloutRequested) and isinstance(whole[-1], RolloutPlanned)
    # A group's prompt is stored once: its first sample's TaskFetched, then a TaskJoined on it.
    assert [type(e) for e in whole[1:13]] == [TaskFetched, TaskJoined] * 6
    assert all(isinstance(e, BatchSealed) for e in whole[13:-1])
    for chunk in (1, 2, 3, 5, 7, 100):
        pieces = [plan.rollout_events(i, i + chunk) for i in range(0, plan.n_events, chunk)]
        assert [e for piece in pieces for e in piece] == whole
    joined = whole[6]  # sample 5: the second of group 2
    assert isinstance(joined, TaskJoined) and joined.same_as == plan.tasks(4, 5)[0].sample_id
    # Folded, the stream holds every sample's whole task, as the plan built it.
    envs = [Envelope("rl:{rollout:r}", f"1-{i}", ev) for i, ev in enumerate(whole)]
    projection = RolloutProjection()
    rollout = in_memory(fold(projection, start(projection), envs).state, envs)
    assert [rollout.task(r) for r in rollout.state.ordered()] == plan.tasks()


def test_planning_is_deterministic_and_replan_reproduces_the_plan(tmp_path: Path) -> None:
    p = planner(tmp_path)
    first = p.plan(request("r1", n_prompts=5, seed=3), DataState())
    again = planner(tmp_path).plan(request("r1", n_prompts=5, seed=3), DataState())
    assert first.rollout_events() == again.rollout_events()
    second = p.plan(request("r2", n_prompts=4, seed=3), after(first))
    assert second.cursor.previous == first.cursor.cursor
    assert p.replan(second.request, second.cursor).rollout_events() == second.rollout_events()
    other_seed = p.plan(request("r1", n_prompts=5, seed=4), DataState())
    assert [t.metadata["row"] for t in other_seed.tasks()] != [
        t.metadata["row"] for t in first.tasks()
    ]


def test_dataset_subsets_overrides_and_eval_selection(tmp_path: Path) -> None:
    p = planner(tmp_path)
    only_py = p.plan(request("r", n_prompts=3, datasets=["py"], n_samples_per_prompt=3),
                     DataState())
    assert {t.dataset for t in only_py.tasks()} == {"py"}
    assert [t.group_index for t in only_py.tasks()] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # the request's group size overrides the dataset's: three copies of each prompt
    assert [t.source_line for t in only_py.tasks()][:3] == [only_py.tasks()[0].source_line] * 3
    assert only_py.cursor.cursor["datasets"] == ["py"]
    ev = p.plan(request("e", kind="eval", datasets=["he"], n_samples_per_prompt=2), DataState())
    assert [t.metadata["row"] for t in ev.tasks()] == [0, 0, 1, 1, 2, 2]
    assert [t.group_index for t in ev.tasks()] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ConfigError, match="'aime'.* not training datasets"):
        p.plan(request("x", datasets=["aime"]), DataState())
    with pytest.raises(ConfigError, match="stopping: max_turns: must be at least 1"):
        p.plan(request("x", stopping={"max_turns": 0}), DataState())


def test_a_batching_strategy_that_loses_or_repeats_samples_is_refused(tmp_path: Path) -> None:
    def drop_last(tasks: list[Task], specs: Mapping[str, EvaluatorProfile]) -> list[Batch]:
        return [Batch(batch_id=batch_id_for(t.rollout_id, t.index), task_type=t.task_type,
                      tasks=(t,)) for t in tasks[:-1]]

    def twice(tasks: list[Task], specs: Mapping[str, EvaluatorProfile]) -> list[Batch]:
        one = [Batch(batch_id=f"b{i}", task_type=t.task_type, tasks=(t,))
               for i, t in enumerate(tasks)]
        return [*one, Batch(batch_id="again", task_type=tasks[0].task_type, tasks=(tasks[0],))]

    with pytest.raises(ConfigError, match="drop_last placed 3 of 4 samples"):
        planner(tmp_path, batching=drop_last).plan(request("r", n_prompts=4), DataState())
    with pytest.raises(ConfigError, match="twice placed sample 'r:s0' in two batches"):
        planner(tmp_path, batching=twice).plan(request("r", n_prompts=4), DataState())


def test_one_sample_batches_with_a_custom_strategy_keep_seq_order(tmp_path: Path) -> None:
    def singles(tasks: list[Task], specs: Mapping[str, EvaluatorProfile]) -> list[Batch]:
        return [Batch(batch_id=batch_id_for(t.rollout_id, t.index), task_type=t.task_type,
                      tasks=(t,)) for t in reversed(tasks)]

    plan = planner(tmp_path, batching=singles).plan(request("r", n_prompts=3), DataState())
    assert [b.seq for b in plan.batches] == [0, 1, 2]
    assert [b.sample_ids for b in plan.batches] == [["r:s2"], ["r:s1"], ["r:s0"]]
    assert plan.largest_batches() == {"math": 1}


def test_the_cascade_is_resolved_once_into_typed_settings(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        {"gsm": ("math", 3), "py": ("code", 3)},
        train_extra={"gsm": {"max_new_tokens": 64, "sampling_params": {"temperature": 0.2}}},
    )
    plan = Planner(load_rollout_config(config), load_specs()).plan(
        request(
            "r",
            n_prompts=6,
            stopping={"max_turns": 99, "timeout_s": 30.0},
            sampling_params={"temperature": 1.0, "top_k": 5},
            knobs={"dagger_beta": 0.5},
        ),
        DataState(),
    )
    tasks = plan.tasks()
    gsm = [t for t in tasks if t.dataset == "gsm"]
    py = [t for t in tasks if t.dataset == "py"]
    assert gsm and py
    # request (coarsest) < evaluator profile default < dataset (finest), as typed models
    assert gsm[0].stopping == StoppingCriteria(
        max_turns=4, max_context_len=2048, max_new_tokens=64, timeout_s=30.0
    )
    assert gsm[0].sampling_params == SamplingParams(temperature=0.2, top_p=0.9, top_k=5)
    assert py[0].stopping == StoppingCriteria(max_turns=10, timeout_s=30.0)
    assert py[0].sampling_params == SamplingParams(temperature=1.0, top_k=5)
    # resolved once per dataset: its samples share the very same records
    assert all(t.stopping is gsm[0].stopping for t in gsm)
    assert all(t.sampling_params is gsm[0].sampling_params for t in gsm)
    # the knobs and the dataset config are not copied into each sample
    assert "knobs" not in TaskFetched.model_fields
    assert "dataset_cfg" not in TaskFetched.model_fields
    assert plan.request.knobs == {"dagger_beta": 0.5}
    assert all(t.source_line is not None and t.source_line >= 1 for t in tasks)
    assert all("_source_line" not in t.metadata for t in tasks)


def test_each_planned_sample_owns_its_dataset_values(tmp_path: Path) -> None:
    # The data source shares a record's immutable values (strings, numbers, None) between
    # the samples of a group and copies the rest: no sample's task holds a list or dict
    # another one holds (or the record).
    import json

    import yaml

    rows = [
        {"prompt": [{"role": "user", "content": f"hi {i}"}], "label": {"a": [i, 2.5]},
         "row": i, "tags": ["x", {"y": None}]}
        if i % 2 else {"prompt": f"q{i}", "label": None, "row": i, "tags": []}
        for i in range(6)
    ]  # fmt: skip
    (tmp_path / "mix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {"rollout": {"datasets": {"mix": {
        "path": "mix.jsonl", "task_type": "math", "metadata_keys": ["row", "tags"],
        "n_samples_per_prompt": 3,
    }}}}  # fmt: skip
    (tmp_path / "rollout.yaml").write_text(yaml.safe_dump(doc))
    p = Planner(load_rollout_config(tmp_path / "rollout.yaml"), load_specs())
    tasks = p.plan(request("r", n_prompts=6), DataState()).tasks()
    chat = [t for t in tasks if isinstance(t.prompt, list)]
    plain = [t for t in tasks if isinstance(t.prompt, str)]
    assert len(chat) == len(plain) == 9 and chat[1].group_index == chat[0].group_index
    assert chat[1].prompt == chat[0].prompt and chat[1].prompt is not chat[0].prompt
    assert chat[1].label == chat[0].label and chat[1].label is not chat[0].label
    assert chat[1].metadata["tags"] == chat[0].metadata["tags"]
    assert chat[1].metadata["tags"] is not chat[0].metadata["tags"]
    assert plain[1].metadata["tags"] == []
    assert plain[1].metadata["tags"] is not plain[0].metadata["tags"]
    assert plain[1].label is None and plain[1].prompt == plain[0].prompt
