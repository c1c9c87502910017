"""The plan's wire events: a joined sample built from its task, not from its TaskFetched.

``Plan.wire_tasks`` writes a group's first sample as ``TaskFetched`` and every other sample
that shares its group fields as ``TaskJoined``. For the planner's own tasks the joined
event is built from the task (``Plan.make_joined``) without building the sample's
``TaskFetched``; every other sample (a group's first, a carried one) is built and compared
as ``TaskJoined.of`` compares. The reference below is the rule itself -- each sample's
``TaskFetched`` built and joined on its group's first when ``TaskJoined.of`` says so -- and
the plan's events must equal it field for field, byte for byte, in any chunking.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import yaml

from engine.actors.finalizer import decide_ready
from engine.actors.planning import Plan, Planner
from engine.config.rollout import load_rollout_config
from engine.events import Event, RolloutRequested, TaskFetched
from engine.events.catalog import TaskJoined
from engine.events.codec import encode
from engine.projections.data_cursor import DataState
from tests.actors.test_partial_carry import _data, _decide, _done, _tail_carried
from tests.scheduler.helpers import load_specs, request, write_config


def _reference(plan: Plan) -> list[Event]:
    """The rule: every sample's TaskFetched, joined on its group's first when it can be."""
    out: list[Event] = []
    for at in range(len(plan.sample_ids)):
        ev = plan.tasks(at, at + 1)[0]
        pos = plan.group_first.get(ev.group_index)
        if pos is None or pos == at:
            out.append(ev)
            continue
        joined = TaskJoined.of(ev, plan.tasks(pos, pos + 1)[0])
        out.append(ev if joined is None else joined)
    return out


def _check(plan: Plan) -> int:
    """The plan's task events equal the reference in every chunking; returns how many of
    them are joined."""
    want = _reference(plan)
    n = len(plan.sample_ids)
    for chunk in (1, 3, 7, 500):
        for wire in (plan, replace(plan, make_joined=None)):
            got = [ev for i in range(0, n, chunk) for ev in wire.wire_tasks(i, i + chunk)]
            assert got == want
            assert [encode(ev) for ev in got] == [encode(ev) for ev in want]
            assert [ev.model_fields_set for ev in got] == [ev.model_fields_set for ev in want]
    events = plan.rollout_events()
    assert events[1 : n + 1] == want
    return sum(isinstance(ev, TaskJoined) for ev in want)


def test_planned_tasks_are_joined_exactly_as_the_rule_joins_them(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        {"gsm": ("math", 7), "py": ("code", 5)},
        {"aime": ("math", 2), "he": ("code", 3)},
    )
    planner = Planner(load_rollout_config(config), load_specs())
    joined = 0
    for per in (1, 2, 3):
        for kind in ("train", "eval"):
            plan = planner.plan(
                request(f"r{per}{kind}", n_prompts=6, n_samples_per_prompt=per, kind=kind,
                        seed=per),
                DataState(),
            )
            joined += _check(plan)
    assert joined > 10


def test_rich_prompts_labels_and_metadata_join_as_the_rule_says(tmp_path: Path) -> None:
    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "label": {"a": [i, 2.5], "b": None},
         "row": {"i": i, "x": [1.0, -0.0, 1e300] if i % 2 else "s"}, "flag": i % 3 == 0}
        for i in range(9)
    ]
    (tmp_path / "rich.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = {"rollout": {"datasets": {"rich": {
        "path": "rich.jsonl", "task_type": "math", "metadata_keys": ["row", "flag"],
        "n_samples_per_prompt": 4}}}}
    (tmp_path / "rollout.yaml").write_text(yaml.safe_dump(doc))
    planner = Planner(load_rollout_config(tmp_path / "rollout.yaml"), load_specs())
    plan = planner.plan(request("rich", n_prompts=5, seed=2), DataState())
    assert _check(plan) == 5 * 3


def test_carried_samples_are_compared_as_events(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 20)}, {"aime": ("math", 2)})
    planner = Planner(load_rollout_config(config), load_specs())
    req_a = RolloutRequested(rollout_id="A", n_prompts=2, n_samples_per_prompt=2, seed=1,
                             overprovision=2.0, tail="carry", request_stream="run")
    plan_a = planner.plan(req_a, DataState())
    a_events: list[Event] = plan_a.rollout_events()
    a_events += [_done("A", plan_a.sample_ids[i]) for i in (6, 7, 0, 2, 1)]
    state_a = _decide(a_events)
    ready_a = decide_ready(state_a)
    assert ready_a is not None
    carried = _tail_carried(a_events, ready_a)
    assert carried is not None
    req_b = RolloutRequested(rollout_id="B", n_prompts=3, n_samples_per_prompt=2, seed=1,
                             request_stream="run")
    plan_b = planner.plan(req_b, _data(plan_a.cursor, carried))
    assert any(isinstance(t, TaskFetched) and t.carried_from == "A" for t in plan_b.tasks())
    assert plan_b.make_joined is not None
    assert all(plan_b.make_joined(at) is None for at in range(2, 6))  # carried: events
    _check(plan_b)
