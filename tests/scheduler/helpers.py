"""Shared pieces of the scheduler tests: configs on disk, running schedulers, a fake evaluator."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis.asyncio as aioredis

from engine.actors.planning import Planner
from engine.actors.scheduler import Scheduler, SchedulerConfig
from engine.config.evaluators import load_profiles
from engine.config.layout import ClusterLayout, parse_cluster_layout
from engine.config.rollout import load_rollout_config
from engine.domain import EvaluatorProfile
from engine.events import (
    BatchAdmitted,
    Envelope,
    EventLog,
    RolloutPlanned,
    RolloutRequested,
    TokenReleased,
)
from engine.events.redis_log import RedisEventLog
from engine.projections.placement import PoolProjection, PoolState

FIXTURES = Path(__file__).parent / "fixtures"
EVALUATORS = FIXTURES / "evaluators.py"
RANDOM_EVALUATORS = FIXTURES / "evaluators_random.py"


def write_rows(path: Path, dataset: str, n: int) -> Path:
    lines = [
        json.dumps({"prompt": f"{dataset} question {i}", "label": f"{dataset}-{i}", "row": i})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_config(
    tmp: Path,
    train: Mapping[str, tuple[str, int]] | None = None,
    evals: Mapping[str, tuple[str, int]] | None = None,
    *,
    train_extra: Mapping[str, Mapping[str, Any]] | None = None,
    eval_extra: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """A rollout YAML whose datasets map name -> (task_type, rows); rows are generated."""
    import yaml

    doc: dict[str, Any] = {}
    for section, spec, extra in (
        ("rollout", train, train_extra),
        ("eval", evals, eval_extra),
    ):
        if not spec:
            continue
        datasets: dict[str, Any] = {}
        for name, (task_type, rows) in spec.items():
            write_rows(tmp / f"{name}.jsonl", name, rows)
            datasets[name] = {
                "path": f"{name}.jsonl",
                "task_type": task_type,
                "metadata_keys": ["row"],
                **dict((extra or {}).get(name, {})),
            }
        doc[section] = {"datasets": datasets}
    path = tmp / "rollout.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def load_specs(path: Path = EVALUATORS, **args: Any) -> Mapping[str, EvaluatorProfile]:
    return load_profiles(path, SimpleNamespace(**args))


def layout(nodes: Mapping[str, Mapping[str, Any]]) -> ClusterLayout:
    return parse_cluster_layout(json.dumps(nodes))


def make_scheduler(
    log: EventLog,
    config_path: Path,
    specs: Mapping[str, EvaluatorProfile],
    cluster: ClusterLayout | None,
    *,
    scheduler_id: str = "s0",
    plan_chunk: int = 4096,
    claim_idle_ms: int = 60_000,
) -> Scheduler:
    planner = Planner(load_rollout_config(config_path), specs)
    config = SchedulerConfig(
        scheduler_id=scheduler_id,
        block_ms=200,
        heartbeat_ms=min(5_000, claim_idle_ms // 3),
        claim_idle_ms=claim_idle_ms,
        plan_chunk=plan_chunk,
    )
    return Scheduler(log, planner=planner, layout=cluster, config=config)


@asynccontextmanager
async def running(schedulers: Sequence[Scheduler]) -> AsyncIterator[list[asyncio.Task[None]]]:
    """Run schedulers as tasks; stop them (and surface their errors) on exit."""
    stop = asyncio.Event()
    for s in schedulers:
        await s.start()
    tasks = [asyncio.create_task(s.run(stop)) for s in schedulers]
    try:
        yield tasks
    finally:
        stop.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result


def request(rollout_id: str, **fields: Any) -> RolloutRequested:
    return RolloutRequested(rollout_id=rollout_id, **{"n_prompts": 1, **fields})


@dataclass
class FakeEvaluators:
    """Plays the evaluator workers: reads BatchAdmitted from the work streams and gives the
    tokens back with TokenReleased. It keeps up to ``hold`` batches' tokens (so schedulers
    meet a full pool) and releases everything whenever nothing new arrives for a block,
    so admission never stalls on it. Some releases list token ids one at a time."""

    log: EventLog
    evaluator_ids: Sequence[str]
    hold: int = 2
    seed: int = 0
    admitted: list[Envelope] = field(default_factory=list)
    released: bool = True
    positions: dict[str, str] = field(default_factory=dict)
    held: list[BatchAdmitted] = field(default_factory=list)

    async def run(
        self, done: Callable[[list[Envelope]], Awaitable[bool]]
    ) -> list[Envelope]:
        rng = random.Random(self.seed)
        names = self.log.names
        positions = self.positions
        for evaluator_id in self.evaluator_ids:
            positions.setdefault(names.work(evaluator_id), "0-0")
        held = self.held
        while not await done(self.admitted):
            envs = await self.log.tail(positions, block_ms=100)
            for env in envs:
                positions[env.stream] = env.id
                if isinstance(env.event, BatchAdmitted):
                    self.admitted.append(env)
                    held.append(env.event)
            if not self.released:
                continue
            keep = self.hold if envs else 0
            while len(held) > keep:
                await self._release(held.pop(0), rng)
        if self.released:
            while held:
                await self._release(held.pop(0), rng)
        return self.admitted

    async def _release(self, batch: BatchAdmitted, rng: random.Random) -> None:
        pool = self.log.names.pool
        if rng.random() < 0.5 or not batch.token_ids:
            await self.log.append(
                pool, TokenReleased(rollout_id=batch.rollout_id, batch_id=batch.batch_id)
            )
            return
        for token_id in batch.token_ids:
            await self.log.append(
                pool,
                TokenReleased(
                    rollout_id=batch.rollout_id, batch_id=batch.batch_id, token_ids=[token_id]
                ),
            )
        # A repeated release is ignored by the fold.
        await self.log.append(
            pool,
            TokenReleased(
                rollout_id=batch.rollout_id, batch_id=batch.batch_id, token_ids=batch.token_ids
            ),
        )


async def planned(log: EventLog, rollout_id: str) -> RolloutPlanned | None:
    for env in await log.read_all(log.names.rollout(rollout_id)):
        if isinstance(env.event, RolloutPlanned):
            return env.event
    return None


def all_admitted(
    log: EventLog, rollout_ids: Sequence[str]
) -> Callable[[list[Envelope]], Awaitable[bool]]:
    """A ``done`` predicate: every rollout planned and as many BatchAdmitted as batches."""
    plans: dict[str, RolloutPlanned] = {}

    async def done(admitted: list[Envelope]) -> bool:
        for rid in rollout_ids:
            if rid not in plans:
                found = await planned(log, rid)
                if found is None:
                    return False
                plans[rid] = found
        return len(admitted) >= sum(p.n_batches for p in plans.values())

    return done


def check_every_prefix(pool_events: Sequence[Envelope]) -> PoolState:
    """Fold ``rl:pool`` one event at a time (the state at every prefix) and assert that no
    prefix over-allocates; returns the final state."""
    projection = PoolProjection()
    state = projection.initial()
    for i, env in enumerate(pool_events):
        state = projection.evolve(state, env)
        problems = state.over_allocation()
        assert not problems, f"over-allocated after pool event {i} ({env.id}): {problems}"
    return state


def fresh_client_log(factory: Callable[[], aioredis.Redis], producer: str) -> EventLog:
    return RedisEventLog(factory(), producer=producer, block_ms=200, max_deliveries=5)
