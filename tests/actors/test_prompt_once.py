"""A group's prompt tokens are stored once (issue 16): the worker writes one
``PromptStored`` per rollout and prompt, each ``SampleCompleted`` refers to it by key, and
every reader (the fold, ``load``) sees the whole trajectory."""

from __future__ import annotations

import asyncio

import pytest

from engine.actors.prompt_store import PromptStore
from engine.client import RolloutClient
from engine.errors import RolloutError
from engine.events import EventLog, PromptStored, SampleCompleted, TaskFetched, TokenIds
from engine.events.base import Envelope
from engine.projections.rollout import RolloutProjection
from tests.actors.fixtures.agents import group_prompt_ids, response_ids
from tests.events.examples import example_events
from tests.rig import Engine, events_of, start_rollout


def test_a_prompt_is_stored_once_per_rollout_and_short_ones_stay_inline() -> None:
    store = PromptStore(inline_bytes=16, max_keys=2)
    long = TokenIds.from_values(list(range(10)))  # 40 bytes
    assert store.refer("r", TokenIds.from_values([1, 2, 3])) == ("", None)
    key, first = store.refer("r", long)
    assert first is not None and first.prompt_key == key and first.prompt_ids == long
    assert store.refer("r", long) == (key, None)  # the group's other samples
    other_key, other = store.refer("s", long)  # another rollout stores its own copy
    assert other_key == key and other is not None and other.rollout_id == "s"
    store.refer("t", long)  # beyond max_keys the oldest mark is forgotten: stored again
    assert store.refer("r", long)[1] is not None


async def test_a_groups_samples_share_one_stored_prompt(engine: Engine, log: EventLog) -> None:
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(log, "r1", n_prompts=2, per_prompt=4,
                        script=lambda i: {"group_prompt": 40})
    client = RolloutClient(log)
    await asyncio.wait_for(client.wait_ready("r1"), 30)
    stream = log.names.rollout("r1")
    stored = await events_of(log, stream, PromptStored)
    assert sorted(p.prompt_ids.tolist() for p in stored) == [
        list(group_prompt_ids(g, 40)) for g in range(2)
    ]
    done = await events_of(log, stream, SampleCompleted)
    assert len(done) == 8
    assert all(len(d.prompt_ids) == 0 and d.prompt_key for d in done)
    assert len({d.prompt_key for d in done}) == 2
    samples = await client.load("r1")
    for s in samples:
        assert s.tokens == (*group_prompt_ids(s.group_index, 40), *response_ids(s.index, 4))
        assert s.response_length == 4


def test_a_reference_to_a_prompt_the_stream_lacks_is_an_error() -> None:
    projection = RolloutProjection()
    state = projection.initial()
    task = next(e for e in example_events() if isinstance(e, TaskFetched))
    state = projection.evolve(state, Envelope("st", "1-0", task))
    done = SampleCompleted(rollout_id=task.rollout_id, sample_id=task.sample_id,
                           prompt_ids=[], prompt_key="nope", response_ids=[1],
                           logprobs=[-0.5], loss_mask=[1])
    with pytest.raises(RolloutError, match="no earlier PromptStored"):
        projection.evolve(state, Envelope("st", "2-0", done))
