"""An evaluator worker's memory for a rollout's tasks follows its batches, not the rollout.

The worker keeps, per rollout, an index of where each task entry is (about two bytes a
task) and a bounded window of entries as read; a batch's tasks are decoded when it needs
them and held by its plan only. Measured with tracemalloc on a real redis-server: what the
worker still holds after serving its share of a rollout, for two rollout sizes.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Mapping
from typing import Any

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.domain import sample_id_for
from engine.events import RolloutRequested, TaskFetched, TaskJoined
from engine.events.base import Event
from engine.events.log import EventLog

GROUP = 4  # samples per prompt: the first's TaskFetched, TaskJoined for the others
BATCH = 32
WORKERS = 4
PROMPT = "x" * 600  # a task entry of about 700 bytes, as a real prompt makes it


def _plan(rollout_id: str, n: int) -> tuple[list[Event], dict[str, TaskFetched]]:
    """The stream's events (request, then tasks in index order) and each sample's task."""
    events: list[Event] = [
        RolloutRequested(rollout_id=rollout_id, iteration=1, n_prompts=n // GROUP)
    ]
    tasks: dict[str, TaskFetched] = {}
    first: TaskFetched | None = None
    for i in range(n):
        task = TaskFetched(
            rollout_id=rollout_id, sample_id=sample_id_for(rollout_id, i), index=i,
            group_index=i // GROUP, prompt=f"{i // GROUP} {PROMPT}", dataset="math",
            task_type="math",
        )  # fmt: skip
        tasks[task.sample_id] = task
        if i % GROUP == 0:
            first = task
            events.append(task)
            continue
        assert first is not None
        joined = TaskJoined.of(task, first)
        assert joined is not None
        events.append(joined)
    return events, tasks


def _same(read: Event, written: Event) -> bool:
    """Equal but for the producer the log stamps on append."""
    return read.model_dump(exclude={"producer"}) == written.model_dump(exclude={"producer"})


async def _held_after_rollout(log: EventLog, specs: Mapping[str, Any], n: int) -> int:
    """Bytes a worker still holds after running its share of an ``n``-sample rollout, then
    the batches of a dead worker claimed in reverse order (re-read from the index)."""
    rollout_id = f"mem{n}"
    events, tasks = _plan(rollout_id, n)
    stream = log.names.rollout(rollout_id)
    for at in range(0, len(events), 2000):
        await log.append_many([(stream, ev) for ev in events[at : at + 2000]])
    ids = list(tasks)
    batches = [ids[at : at + BATCH] for at in range(0, n, BATCH)]
    config = WorkerConfig(worker_id="w1", evaluator_ids=(next(iter(specs)),), task_window=256)
    worker = EvaluatorWorker(log, specs, config)
    gc.collect()
    tracemalloc.start()
    try:
        base, _peak = tracemalloc.get_traced_memory()
        own = batches[0::WORKERS]
        claimed = batches[1::WORKERS][::-1]  # long read and gone from the window
        for batch in [*own, *claimed]:
            request, got = await worker.tasks.batch_tasks(rollout_id, batch)
            assert request is not None and _same(request, events[0])
            assert list(got) == batch
            for sid, task in got.items():  # a TaskJoined: its group's task
                assert _same(task, tasks[sid]), sid
            del got, request
        gc.collect()
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert worker.tasks.cache[rollout_id].count > n - WORKERS * BATCH  # read (nearly) to the end
    return held - base


async def test_a_workers_task_cache_stays_bounded_over_a_rollout(
    real_log: EventLog, specs: Mapping[str, Any]
) -> None:
    small = await _held_after_rollout(real_log, specs, 1000)
    large = await _held_after_rollout(real_log, specs, 5000)
    per_task = (large - small) / 4000
    # holding every entry read (the cache before) grows by ~700 bytes a task here; the
    # index by about two. 64 bytes a task is a generous bound that still tells them apart.
    assert per_task < 64, (small, large, per_task)
    print(f"held: {small} bytes at 1000 samples, {large} at 5000: {per_task:.1f} bytes a task")


def test_the_task_index_places_each_samples_first_entry() -> None:
    from engine.actors.task_reader import MARK_EVERY, _RolloutTasks

    index = _RolloutTasks("r", window=2)
    order = ["r:s0", "r:s1", "carried:s7", "r:s3", "r:s1", "r:s05", "r:s9", *(
        f"r:s{k}" for k in range(7, 7 + MARK_EVERY))]  # fmt: skip
    firsts = [index.add(f"before-{k}", sid, sid.encode()) for k, sid in enumerate(order)]
    assert firsts[:7] == [True, True, True, True, False, True, True]  # r:s1 again: ignored
    assert index.locate("r:s1") == 1  # its first entry, as the rollout fold keeps it
    assert index.locate("carried:s7") == 2 and index.locate("r:s05") == 5
    assert index.locate("r:s5") is None  # ordinal 5 holds r:s05, not r:s5
    assert index.locate("r:s9") == 6 and index.locate("r:s2") is None
    assert index.locate(f"r:s{len(order)}") is None  # not read yet
    # planner ids cost one byte each; the others a dict entry; a mark every MARK_EVERY
    assert sorted(index.others) == ["carried:s7", "r:s05", "r:s9"]
    assert len(index.planned) == index.count == len(order)
    assert index.marks == ["before-0", f"before-{MARK_EVERY}"]
    assert list(index.recent) == order[-2:]  # the window keeps the last two read
