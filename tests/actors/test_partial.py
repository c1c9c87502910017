"""Partial rollouts end to end (issue 12, point 6): an over-provisioned request becomes ready
with its first ``n_prompts`` whole groups; its tail is aborted -- on the model server too, with
SGLang's ``/abort_request`` and each generation's exact rid -- and recorded as ``tail_aborted``;
the replayed stream writes the finalizer's files byte for byte.

A real redis-server, a real tinylm subprocess, the engine's worker, finalizer and scheduler.
The tail's generations are made to be in flight when the rollout becomes ready without any
timing: they are submitted, seen running on the server (``/get_server_info``), and the server
is paused in place (its requests keep their slots; aborts still apply) before the other
groups are let finish.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.actors.finalizer import decide_ready
from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.backends.base import FinishReason, GenerationResult
from engine.domain import Task, TerminationReason
from engine.errors import AppendConflict
from engine.events import (
    AbortClass,
    EventLog,
    RolloutRequested,
    SampleAborted,
)
from engine.ops.inspection import status_lines
from engine.ops.replay import archive_rollout, decode_entries, read_archive, replay_state
from engine.projections.summary import render_artifacts
from tests.actors.play import plan_events
from tests.actors.test_staleness import (
    EVALUATOR,
    Rig,
    fold_until_ready,
    rig,  # noqa: F401 - the fixture
    same_decision,
    wait_ready,
)
from tinylm.process import spawn_server


@pytest.fixture
def server(tinylm_dir: Path) -> Any:
    # One tokenizer worker, SGLang's default: an abort reaches a request only by its exact
    # rid (TokenizerManager.abort_request), which is how the worker aborts the tail.
    args = ["--weight-version", "0"]
    with spawn_server(tinylm_dir, extra_args=args) as proc:
        yield proc
    if proc.process.stdout is not None:
        with contextlib.suppress(Exception):
            proc.process.stdout.close()


@dataclass
class TailAgent(BaseAgent):
    """Samples of groups ``slow_groups`` generate a long answer on the real server; the other
    samples wait for ``finish`` and return a canned trajectory."""

    slow_groups: frozenset[int]
    finish: asyncio.Event = field(default_factory=asyncio.Event)
    slow_results: dict[str, GenerationResult] = field(default_factory=dict)
    slow_errors: dict[str, BaseException] = field(default_factory=dict)

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if task.group_index in self.slow_groups:
            assert context.backends is not None
            try:
                gen = await context.backends.get().generate(
                    input_ids=[1, 2, 3],
                    sampling_params={"max_new_tokens": 1500, "ignore_eos": True},
                )
            except BaseException as exc:
                self.slow_errors[task.sample_id] = exc
                raise
            self.slow_results[task.sample_id] = gen
            raise RuntimeError(f"{task.sample_id}: the long generation ended ({gen.finish_reason})")
        await self.finish.wait()
        return AgentResult(
            prompt_token_ids=[1, 2], response_token_ids=[5, 6, 7], response_logprobs=[-0.1] * 3,
            loss_mask=[1, 1, 1], response_versions=[0, 0, 0],
            turns=(TurnRecord(index=0, prompt_tokens=2, response_tokens=3, weight_version=0),),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return float(task.index % 2)


async def play_partial(log: EventLog, request: RolloutRequested, batch_size: int = 16) -> None:
    """The scheduler's part for an over-provisioned request: the plan holds
    ``n_planned_prompts`` groups; every batch admitted at once."""
    planned = request.model_copy(update={"n_prompts": request.n_planned_prompts})
    events, admissions = plan_events(planned, evaluator_id=EVALUATOR, batch_size=batch_size)
    events[0] = request  # the stream opens with the request as it was made
    stream = log.names.rollout(request.rollout_id)
    await log.append_many([(stream, ev) for ev in events])
    for acquired, admitted in admissions:
        while True:
            try:
                await log.append_if_last(
                    log.names.pool, acquired, await log.last_id(log.names.pool),
                    also=[(log.names.work(admitted.evaluator_id), admitted)],
                )
                break
            except AppendConflict:
                continue


async def running_rids(client: httpx.AsyncClient, url: str) -> list[str]:
    reply = await client.get(url + "/get_server_info")
    return list(reply.json()["running_rids"])


async def test_the_tail_is_aborted_on_the_server_and_recorded(rig: Rig, tmp_path: Path) -> None:  # noqa: F811
    agent = TailAgent(slow_groups=frozenset({2}))
    rig.start(agent)
    log = rig.log()
    request = RolloutRequested(rollout_id="part", n_prompts=2, n_samples_per_prompt=2,
                               overprovision=1.5)
    assert request.n_planned_prompts == 3
    await log.append(log.names.control, request)
    await play_partial(log, request)
    assert rig.server is not None
    url = rig.server.url
    async with httpx.AsyncClient(timeout=30) as client:
        # the tail's two generations are running on the server, under their rid prefixes
        while True:
            rids = await running_rids(client, url)
            if len(rids) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(r.split("/a")[0] for r in rids) == ["part:s4", "part:s5"]
        assert all(r.startswith(f"part:s{4 + k}/a1/") for k, r in enumerate(sorted(rids)))
        paused = await client.post(url + "/pause_generation", json={"mode": "in_place"})
        assert paused.status_code == 200
        agent.finish.set()
        ready = await wait_ready(log, "part")
        assert ready.sample_ids == [f"part:s{i}" for i in range(4)]
        assert ready.tail_sample_ids == ["part:s4", "part:s5"] and not ready.tail_carried
        # the worker forwarded the abort: the server ended both generations while paused
        while len(agent.slow_results) + len(agent.slow_errors) < 2:
            await asyncio.sleep(0.05)
        assert not agent.slow_errors, agent.slow_errors
        assert all(g.finish_reason == FinishReason.ABORT for g in agent.slow_results.values())
        assert await running_rids(client, url) == []
        await client.post(url + "/continue_generation")
    before, rollout = await fold_until_ready(log, "part")
    assert same_decision(decide_ready(before), ready)
    # recorded with their own reason, in the same step as the RolloutReady
    envs = await log.read_all(log.names.rollout("part"))
    at = next(i for i, e in enumerate(envs) if e.event.type == "RolloutReady")
    follow = [e.event for e in envs[at + 1 : at + 3]]
    assert all(isinstance(e, SampleAborted) and e.abort_class is AbortClass.TAIL_ABORTED
               for e in follow)
    assert [e.sample_id for e in follow if isinstance(e, SampleAborted)] == ["part:s4", "part:s5"]
    assert "tail 2 aborted" in status_lines(rollout.state)[0]
    # replay byte identity
    archive = tmp_path / "part.archive"
    await archive_rollout(log, "part", archive)
    loaded = read_archive(archive)
    replayed, bad = decode_entries(loaded.stream, loaded.entries)
    assert bad == 0
    for name, data in render_artifacts(replay_state(replayed)).items():
        assert (rig.out / "part" / name).read_bytes() == data, name

