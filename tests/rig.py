"""The engine rig of the tests: evaluator specs, in-process engine pieces, rollout starts,
and the engine's processes (``engine.ops.processes``) for the tests that run them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.agents.binding import EvaluatorBinding
from engine.config.evaluators import load_evaluators
from engine.events import (
    Envelope,
    Event,
    EventLog,
    FilterSpec,
    RolloutKind,
    RolloutPlanned,
    RolloutRequested,
    TaskFetched,
    TokenAcquired,
    TokenReleased,
)
from engine.events.memory_log import MemoryEventLog
from engine.ops.processes import Process, Processes
from engine.projections.base import fold, start
from engine.projections.control import ControlProjection, ControlState
from engine.projections.readback import Rollout, in_memory
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.follower import Follower
from tests.actors.play import play_scheduler
from tests.redis_server import RedisServer
from workers.cli import ROLLOUT

if TYPE_CHECKING:
    from tests.conftest import LogFactory

FIXTURES = Path(__file__).parent / "actors" / "fixtures"
EVALUATOR_CONFIG = FIXTURES / "evaluators.py"

# Short timings: claims and heartbeats happen within a test's lifetime.
HEARTBEAT_MS = 50
CLAIM_IDLE_MS = 400
BLOCK_MS = 100


def envelopes(events: Sequence[Event]) -> list[Envelope]:
    """``events`` as read from one stream, ids ``1-0``, ``2-0``, ..."""
    return [Envelope("s", f"{i + 1}-0", ev) for i, ev in enumerate(events)]


def control_with(*events: Event) -> Follower[ControlState]:
    """A follower of ``rl:control`` that has folded ``events`` (a guard's view of it)."""
    control = Follower(MemoryEventLog(), "rl:control", ControlProjection())
    control.apply([Envelope("rl:control", f"{i + 1}-0", ev) for i, ev in enumerate(events)])
    return control


def rollout_state(events: Sequence[Event]) -> RolloutState:
    """The rollout fold over ``events``: what the finalizer decides from."""
    projection = RolloutProjection()
    return fold(projection, start(projection), envelopes(events)).state


def rollout_of(events: Sequence[Event]) -> Rollout:
    """The rollout fold over ``events`` with every entry at hand (what samples, rows and
    artifacts are built from, as a replay builds them)."""
    envs = envelopes(events)
    projection = RolloutProjection()
    return in_memory(fold(projection, start(projection), envs).state, envs)


def plan_events(n_groups: int, per_group: int, request: RolloutRequested) -> list[Event]:
    """``request``, then one ``TaskFetched`` per sample (``<rollout>:s<i>``, groups of
    ``per_group``) and ``RolloutPlanned``: a planned rollout, ready for samples to finish."""
    rid = request.rollout_id
    events: list[Event] = [request]
    for g in range(n_groups):
        for c in range(per_group):
            i = g * per_group + c
            events.append(
                TaskFetched(rollout_id=rid, sample_id=f"{rid}:s{i}", index=i, group_index=g,
                            prompt="p", dataset="d", task_type="t")
            )
    events.append(RolloutPlanned(rollout_id=rid, n_samples=n_groups * per_group, n_batches=1))
    return events


@pytest.fixture(scope="session")
def specs() -> Mapping[str, EvaluatorBinding]:
    return load_evaluators(EVALUATOR_CONFIG, None)


@dataclass
class Engine:
    """Workers and finalizers running as tasks of the test's event loop."""

    make_log: Callable[[], EventLog]
    specs: Mapping[str, EvaluatorBinding]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def worker(self, worker_id: str = "w1", **overrides: Any) -> EvaluatorWorker:
        config: dict[str, Any] = {
            "worker_id": worker_id,
            "evaluator_ids": ("scripted",),
            "heartbeat_ms": HEARTBEAT_MS,
            "claim_idle_ms": CLAIM_IDLE_MS,
            "block_ms": BLOCK_MS,
            "grace_s": 5.0,
        }
        extra = {k: overrides.pop(k) for k in list(overrides) if k in ("sandboxes",)}
        config.update(overrides)
        return EvaluatorWorker(self.make_log(), self.specs, WorkerConfig(**config), **extra)

    def start_worker(
        self, worker_id: str = "w1", stop: asyncio.Event | None = None, **overrides: Any
    ) -> EvaluatorWorker:
        worker = self.worker(worker_id, **overrides)
        self.tasks.append(asyncio.create_task(worker.run(stop or self.stop)))
        return worker

    def finalizer(
        self, consumer: str = "f1", out_dir: Path | None = None, max_rollouts: int = 32
    ) -> Finalizer:
        return Finalizer(
            self.make_log(),
            FinalizerConfig(
                consumer=consumer,
                out_dir=out_dir,
                heartbeat_ms=HEARTBEAT_MS,
                claim_idle_ms=CLAIM_IDLE_MS,
                block_ms=BLOCK_MS,
                max_rollouts=max_rollouts,
            ),
        )

    def start_finalizer(
        self, consumer: str = "f1", out_dir: Path | None = None, max_rollouts: int = 32
    ) -> Finalizer:
        finalizer = self.finalizer(consumer, out_dir, max_rollouts)
        self.tasks.append(asyncio.create_task(finalizer.run(self.stop)))
        return finalizer

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 10)


@pytest.fixture
async def engine(
    make_log: LogFactory, specs: Mapping[str, EvaluatorBinding]
) -> AsyncIterator[Engine]:
    eng = Engine(lambda: make_log(producer="test", block_ms=BLOCK_MS, max_deliveries=3), specs)
    yield eng
    await eng.close()


async def start_rollout(
    log: EventLog,
    rollout_id: str,
    *,
    n_prompts: int,
    per_prompt: int = 1,
    kind: RolloutKind = RolloutKind.TRAIN,
    filters: FilterSpec | None = None,
    teacher_capture: bool = False,
    knobs: dict[str, Any] | None = None,
    seed: int = 0,
    **play: Any,
) -> RolloutRequested:
    """Append a request to rl:control (as the client does) and play the scheduler for it."""
    request = RolloutRequested(
        rollout_id=rollout_id,
        iteration=1,
        kind=kind,
        n_prompts=n_prompts,
        n_samples_per_prompt=per_prompt,
        policy_version=3,
        filters=filters or FilterSpec(),
        teacher_capture=teacher_capture,
        knobs=knobs or {},
        seed=seed,
    )
    await log.append(log.names.control, request)
    await play_scheduler(log, request, **play)
    return request


async def wait_state(
    log: EventLog,
    rollout_id: str,
    predicate: Callable[[RolloutState], bool],
    *,
    timeout: float = 30.0,
) -> RolloutState:
    """Fold the rollout stream with blocking reads until ``predicate(state)`` holds."""
    return (await wait_rollout(log, rollout_id, predicate, timeout=timeout)).state


async def wait_rollout(
    log: EventLog,
    rollout_id: str,
    predicate: Callable[[RolloutState], bool],
    *,
    timeout: float = 30.0,
) -> Rollout:
    """:func:`wait_state`, with every entry read kept (to build samples and rows from)."""
    projection = RolloutProjection()
    state = projection.initial()
    position = "0-0"
    stream = log.names.rollout(rollout_id)
    read: list[Envelope] = []

    async def follow() -> Rollout:
        nonlocal state, position
        while True:
            envs, position = await log.read_after(stream, position, block_ms=BLOCK_MS)
            for env in envs:
                state = projection.evolve(state, env)
            read.extend(envs)
            if predicate(state):
                return in_memory(state, read)

    return await asyncio.wait_for(follow(), timeout)


async def events_of(log: EventLog, stream: str, kind: type[Event]) -> list[Any]:
    return [env.event for env in await log.read_all(stream) if isinstance(env.event, kind)]


Ledger = dict[str, tuple[set[str], list[str]]]


async def token_ledger(log: EventLog, rollout_id: str) -> Ledger:
    """Per batch: the tokens acquired and every token id released (with repeats)."""
    ledger: Ledger = {}
    for env in await log.read_all(log.names.pool):
        ev = env.event
        if isinstance(ev, TokenAcquired) and ev.rollout_id == rollout_id:
            ledger[ev.batch_id] = ({t.token_id for t in ev.tokens}, [])
        elif isinstance(ev, TokenReleased) and ev.rollout_id == rollout_id:
            acquired, released = ledger[ev.batch_id]
            released.extend(sorted(acquired) if ev.token_ids is None else ev.token_ids)
    return ledger


async def released_tokens(log: EventLog, rollout_id: str, *, timeout: float = 15.0) -> Ledger:
    """The ledger once every acquired token has been released (a batch releases its last
    tokens after its samples' terminal events, so just after RolloutReady some may still be
    on their way); waits with blocking reads of the pool, fails after ``timeout``."""

    async def settle() -> Ledger:
        position = "0-0"
        while True:
            ledger = await token_ledger(log, rollout_id)
            if all(acquired <= set(released) for acquired, released in ledger.values()):
                return ledger
            _, position = await log.read_after(log.names.pool, position, block_ms=BLOCK_MS)

    return await asyncio.wait_for(settle(), timeout)


def assert_tokens_released_once(ledger: Ledger) -> None:
    for batch, (acquired, released) in ledger.items():
        assert sorted(released) == sorted(acquired), batch


ROOT = Path(__file__).resolve().parents[1]  # the repository
TIMINGS = {"heartbeat_ms": 100, "claim_idle_ms": 1000, "block_ms": 200}


def launcher(url: str, logs: Path, **settings: object) -> Processes:
    """The engine's launcher for a test: processes on ``url`` (in their environment, never
    argv) with short timings, running this checkout's code, logs in ``logs``; what is still
    running at the end gets SIGTERM and, 2 s later, SIGKILL."""
    return Processes(logs, rollout=ROLLOUT, settings={"redis_url": url, **TIMINGS, **settings},
                     env={"PYTHONPATH": str(ROOT)}, grace_s=2.0)


def start_worker(procs: Processes, worker_id: str, *extra: str) -> Process:
    """An evaluator worker serving the scripted evaluator without a sandbox."""
    return procs.start(worker_id, "worker", *extra, settings={
        "worker_id": worker_id, "evaluator_config": EVALUATOR_CONFIG, "evaluators": "scripted",
        "sandbox": "none"})


def start_finalizer(procs: Processes) -> Process:
    return procs.start("fin", "finalizer", settings={"worker_id": "fin"})


@pytest.fixture
def procs(redis_server: RedisServer, tmp_path: Path) -> Iterator[Processes]:
    with launcher(redis_server.url, tmp_path) as processes:
        yield processes
