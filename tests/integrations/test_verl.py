"""verl's agent loop over the engine (integrations.verl).

verl 0.9.1's agent loop needs Ray, Hydra and tensordict, which are not installed here: the
tests hold the adapter to a contract taken from the wheel's source
(``verl/experimental/agent_loop/agent_loop.py``):

* ``AgentLoopOutput`` and ``AgentLoopMetrics``: the fields and types, mirrored below by
  pydantic models that refuse unknown fields;
* ``AgentLoopWorker._postprocess``: ``reward_score`` set on every output becomes
  ``rm_scores`` on the last response token; every ``extra_fields`` key is kept, with
  ``turn_scores``, ``tool_rewards``, ``min_global_steps``, ``max_global_steps`` and
  ``extras`` always present;
* ``register(agent_name)``: the registry key a row's ``agent_name`` routes to;
* ``verl/trainer/ppo/ray_trainer.py``: a ``uid`` per prompt, repeated ``rollout.n`` times
  (interleaved) before ``generate_sequences``.

Where verl imports, the last test builds verl's own ``AgentLoopOutput`` from the adapter.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from engine.client import RolloutClient
from engine.config.evaluators import load_evaluators
from engine.events import RolloutRequested
from engine.events.memory_log import MemoryEventLog, MemoryStore
from engine.sample import Sample
from integrations.verl import AGENT_NAME, EngineGroups, agent_loop_fields, turns_of
from tests.actors.play import play_scheduler
from tests.integrations.conftest import tool_episode
from tests.rig import EVALUATOR_CONFIG, Engine


class AgentLoopMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid")
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    compute_score: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any | None = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics
    extra_fields: dict[str, Any] = {}
    mm_processor_kwargs: dict[str, Any] | None = None
    mm_processor_output: list[dict[str, Any]] | None = None


POSTPROCESS_KEYS = {"turn_scores", "tool_rewards", "min_global_steps", "max_global_steps",
                    "extras"}


def test_an_engine_sample_is_an_agent_loop_output() -> None:
    sample = tool_episode(0, 0, reward=1.0, version=4)
    out = AgentLoopOutput(**agent_loop_fields(sample, rollout_id="r"))
    assert out.prompt_ids == [11, 12, 13]
    assert out.response_ids == [20, 21, 30, 31, 32, 22, 23]
    assert out.response_mask == [1, 1, 0, 0, 0, 1, 1]  # tool output is not trained on
    assert out.response_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.5, -0.125]
    assert out.reward_score == 1.0
    assert out.num_turns == 4 == turns_of(sample)  # user, assistant, tool, assistant
    extra = out.extra_fields
    assert extra["token_versions"] == [4, 4, -1, -1, -1, 4, 4]
    assert (extra["min_global_steps"], extra["max_global_steps"]) == (4, 4)
    assert extra["engine_sample_id"] == "r:s0" and extra["engine_rollout_id"] == "r"
    # What _postprocess reads of every output is there (extras defaults to None there).
    assert POSTPROCESS_KEYS - {"extras"} <= set(extra)
    assert AGENT_NAME == "rollout_engine"


def test_the_response_is_cut_to_verls_response_length_and_a_removed_sample_scores_zero() -> None:
    out = AgentLoopOutput(**agent_loop_fields(tool_episode(0, 0), response_length=3))
    assert out.response_ids == [20, 21, 30] and out.response_mask == [1, 1, 0]
    assert out.response_logprobs == [-0.5, -0.25, 0.0]
    assert out.extra_fields["token_versions"] == [3, 3, -1]
    dummy = AgentLoopOutput(**agent_loop_fields(Sample.masked_dummy(policy_version=2)))
    assert dummy.reward_score == 0.0 and dummy.response_mask == [0, 0]
    assert dummy.extra_fields["engine_removed"] is True
    assert (dummy.extra_fields["min_global_steps"], dummy.extra_fields["max_global_steps"]) == (
        2, 2)


async def test_the_runs_of_one_uid_share_one_engine_rollout() -> None:
    store = MemoryStore()
    engine = Engine(lambda: MemoryEventLog(store, producer="test", block_ms=100,
                                           max_deliveries=3),
                    load_evaluators(EVALUATOR_CONFIG, None))
    engine.start_worker()
    engine.start_finalizer()
    log = MemoryEventLog(store, producer="test", block_ms=100)
    played: set[str] = set()

    async def scheduler() -> None:  # the scheduler's part, for each request as it comes
        while len(played) < 2:
            for e in await log.read_all(log.names.control):
                ev = e.event
                if isinstance(ev, RolloutRequested) and ev.rollout_id not in played:
                    played.add(ev.rollout_id)
                    await play_scheduler(log, ev, script=lambda i: {"turns": 2, "version": 0,
                                                                   "reward": float(i)})
            await asyncio.sleep(0.02)

    groups = EngineGroups(RolloutClient(MemoryEventLog(store, producer="verl", block_ms=100)),
                          timeout_s=30)
    rows = [{"uid": u, "index": i} for i, u in enumerate(["a", "a", "a", "b", "b", "b"])]
    try:
        playing = asyncio.create_task(scheduler())
        got = await asyncio.gather(*(groups.sample(row, 3) for row in rows))
        await playing
    finally:
        await groups.client.aclose()
        await engine.close()
    requests = [e.event for e in await log.read_all(log.names.control)
                if isinstance(e.event, RolloutRequested)]
    assert len(requests) == 2  # one rollout per uid
    assert all((r.n_prompts, r.n_samples_per_prompt, r.policy_version) == (1, 3, 0)
               for r in requests)
    by_uid: dict[str, list[tuple[str, Sample]]] = {}
    for row, (rid, sample) in zip(rows, got, strict=True):
        by_uid.setdefault(row["uid"], []).append((rid, sample))
    for runs in by_uid.values():
        assert len({rid for rid, _ in runs}) == 1  # one rollout
        assert [s.index for _, s in runs] == [0, 1, 2]  # each run its own sample
        assert [s.reward for _, s in runs] == [0.0, 1.0, 2.0]
    outputs = [AgentLoopOutput(**agent_loop_fields(s, rollout_id=rid)) for rid, s in got]
    assert all(o.extra_fields["max_global_steps"] == 0 for o in outputs)


async def test_verls_own_agent_loop_runs_on_the_engine(tinylm_dir: Any) -> None:
    """Where verl imports: its ``AgentLoopOutput`` takes the adapter's fields, the loop is in
    verl's registry under ``rollout_engine``, and ``EngineAgentLoop.run`` built as
    ``AgentLoopWorker._run_agent_loop`` builds it returns one engine sample."""
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (pip install 'rollout-engine[verl]')")
    try:
        from omegaconf import OmegaConf
        from verl.experimental.agent_loop.agent_loop import AgentLoopOutput as VerlOutput
        from verl.experimental.agent_loop.agent_loop import (
            DictConfigWrap,
            _agent_loop_registry,
        )
    except ImportError as exc:  # verl is there, its own dependencies are not
        pytest.skip(f"verl's agent loop does not import here: {exc}")
    from transformers import AutoTokenizer

    from integrations import verl_agent_loop

    as_dict = VerlOutput(**agent_loop_fields(tool_episode(0, 0))).as_dict()
    assert as_dict["response_mask"].tolist() == [1, 1, 0, 0, 0, 1, 1]
    assert as_dict["rm_scores"].tolist()[-1] == 1.0
    loop_class = verl_agent_loop.EngineAgentLoop
    assert _agent_loop_registry[AGENT_NAME]["_target_"] == (
        f"{loop_class.__module__}.{loop_class.__qualname__}")

    store = MemoryStore()
    engine = Engine(lambda: MemoryEventLog(store, producer="test", block_ms=100,
                                           max_deliveries=3),
                    load_evaluators(EVALUATOR_CONFIG, None))
    engine.start_worker()
    engine.start_finalizer()
    log = MemoryEventLog(store, producer="test", block_ms=100)
    groups = EngineGroups(RolloutClient(MemoryEventLog(store, producer="verl", block_ms=100)),
                          timeout_s=30)
    verl_agent_loop._GROUPS[id(asyncio.get_running_loop())] = groups
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"n": 2, "response_length": 6}},
                               "data": {}})
    loop = loop_class(trainer_config=DictConfigWrap(config), server_manager=None,
                      tokenizer=AutoTokenizer.from_pretrained(tinylm_dir), processor=None,
                      dataset_cls=None, data_config=DictConfigWrap(config.data))

    async def scheduler() -> None:
        while True:
            found = [e.event for e in await log.read_all(log.names.control)
                     if isinstance(e.event, RolloutRequested)]
            if found:
                await play_scheduler(log, found[0], script=lambda i: {"turns": 2, "version": 0})
                return
            await asyncio.sleep(0.02)

    try:
        playing = asyncio.create_task(scheduler())
        outs = await asyncio.gather(*(loop.run({}, uid="u", raw_prompt=[]) for _ in range(2)))
        await playing
    finally:
        del verl_agent_loop._GROUPS[id(asyncio.get_running_loop())]
        await groups.client.aclose()
        await engine.close()
    assert all(isinstance(o, VerlOutput) for o in outs)
    assert [len(o.response_ids) for o in outs] == [6, 6]  # cut to rollout.response_length
    assert {o.extra_fields["engine_sample_id"] for o in outs} == {
        f"{outs[0].extra_fields['engine_rollout_id']}:s{i}" for i in range(2)}
