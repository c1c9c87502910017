"""Model servers fail; no sample is lost to them while a retry budget remains.

Two real tinylm processes over real sockets behind one worker's pool (started once for the
module and repaired after each test), the engine's own worker and finalizer on a real
redis-server. Faults are made when a generation of the rollout is seen running on the server
(``/get_server_info``), not after a sleep:

* SIGKILL one mid-rollout and restart it on the same port, started without
  ``--weight-version``: every sample completes and none is aborted; the restarted server is
  stale (it reports SGLang's "default") and gets no turn until a sync brings it to the active
  version; every turn recorded ran on the active version.
* SIGSTOP one for longer than ``stall_s``: its stuck generation is given up and retried on the
  other within ``stall_s`` plus the health check's bound, the stall is named in the log, and
  the rollout completes; the server comes back once it answers again.
* SIGKILL both and restart them: the turns wait for a server and complete.
* No retries left (``model_retries=0``): a sample whose generation stalls is aborted as
  ``infra_conn`` naming the spent budget and the server, and its group leaves it out of its
  statistics.
* Every server down past the outage limit: the rollout fails naming the servers, never ready.
* A server started without ``--weight-version`` before any sync: the worker labels it version
  0 before it serves (``/update_weight_version``), so every turn carries version 0; one with
  an admin key refuses the label, and the worker stops with a ``ConfigError`` naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.agents.base import BaseAgent
from engine.backends import HTTPSettings, SGLangBackend, SGLangConfig
from engine.backends.pool import BackendPool
from engine.errors import ConfigError
from engine.events import (
    AbortClass,
    EventLog,
    FilterSpec,
    PolicyVersionActivated,
    RolloutFailed,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    ServerDown,
    ServerStale,
    ServerUp,
    TurnCompleted,
)
from engine.events.ids import id_ms
from engine.events.redis_log import RedisEventLog, RedisSettings
from engine.events.redis_log import connect as redis_connect
from engine.projections.base import fold, start
from engine.projections.control import ControlProjection
from tests.actors.play import play_scheduler
from tests.actors.test_staleness import EVALUATOR, binding
from tests.faults.policy import PolicyTurns
from tests.redis_server import RedisServer
from tinylm.process import ServerProcess, spawn_server

STALL_S = 1.5
ACTIVE = 1


@dataclass
class Fleet:
    """Two tinylm processes; each can be killed, stopped, resumed and restarted on its port."""

    model: Path
    procs: dict[str, ServerProcess] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)

    def spawn(self, url: str | None = None, *, version: int | None = ACTIVE) -> str:
        port = 0 if url is None else int(url.rsplit(":", 1)[1])
        args = [] if version is None else ["--weight-version", str(version)]
        proc = spawn_server(self.model, port=port, extra_args=args)
        self.procs[proc.url] = proc
        return proc.url

    @property
    def urls(self) -> list[str]:
        return list(self.procs)

    def signal(self, url: str, sig: int) -> None:
        os.kill(self.procs[url].process.pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(url)
        elif sig == signal.SIGCONT:
            self.stopped.discard(url)

    def kill(self, url: str) -> None:
        self.signal(url, signal.SIGKILL)
        self.procs[url].process.wait(10)
        self._close_pipe(self.procs[url])

    def heal(self) -> None:
        """Both servers running again, at the active version (after a test's faults)."""
        for url in list(self.stopped):
            self.signal(url, signal.SIGCONT)
        for url, proc in list(self.procs.items()):
            if proc.process.poll() is not None:
                self.spawn(url)
            else:
                httpx.post(url + "/update_weight_version", json={"new_version": str(ACTIVE)},
                           timeout=30).raise_for_status()  # fmt: skip

    def close(self) -> None:
        for url in list(self.stopped):
            self.signal(url, signal.SIGCONT)
        for proc in self.procs.values():
            proc.close()
            self._close_pipe(proc)

    @staticmethod
    def _close_pipe(proc: ServerProcess) -> None:
        if proc.process.stdout is not None:
            with contextlib.suppress(Exception):
                proc.process.stdout.close()


@dataclass
class Rig:
    redis_url: str
    fleet: Fleet
    out: Path
    logs: list[RedisEventLog] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    pool: BackendPool | None = None

    def log(self) -> RedisEventLog:
        log = RedisEventLog(redis_connect(RedisSettings(url=self.redis_url, block_ms=200)),
                            producer="test", block_ms=200)  # fmt: skip
        self.logs.append(log)
        return log

    async def start(
        self,
        agent: BaseAgent,
        *,
        urls: list[str] | None = None,
        retries: int = 4,
        outage_limit_s: float = 60.0,
        concurrency: int = 8,
        active: int | None = ACTIVE,
    ) -> None:
        log = self.log()
        if active is not None:
            await log.append(log.names.control, PolicyVersionActivated(
                version=active, servers=urls or self.fleet.urls))  # what a sync left  # fmt: skip

        def build(url: str) -> SGLangBackend:
            config = SGLangConfig(url=url, stall_s=STALL_S, health_timeout_s=STALL_S,
                                  http=HTTPSettings(connect_retries=0))  # fmt: skip
            return SGLangBackend(config=config)

        self.pool = BackendPool(urls or self.fleet.urls, build=build,
                                outage_limit_s=outage_limit_s)  # fmt: skip
        self.pool.health.probe_every_s = 0.2
        self.pool.health.probe_timeout_s = 3.0
        config = WorkerConfig(worker_id="w1", evaluator_ids=(EVALUATOR,), heartbeat_ms=200,
                              claim_idle_ms=5000, block_ms=200, grace_s=5.0,
                              model_retries=retries, retry_backoff_s=0.2,
                              outage_limit_s=outage_limit_s)  # fmt: skip
        worker = EvaluatorWorker(log, binding(agent, concurrency), config, backends=self.pool)
        finalizer = Finalizer(self.log(), FinalizerConfig(
            consumer="f1", out_dir=self.out, heartbeat_ms=200, claim_idle_ms=5000,
            block_ms=200))  # fmt: skip
        self.tasks += [asyncio.create_task(worker.run(self.stop)),
                       asyncio.create_task(finalizer.run(self.stop))]  # fmt: skip

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 15)
        for log in self.logs:
            await log.aclose()
        if self.pool is not None:
            await self.pool.aclose()


@pytest.fixture(scope="module")
def servers(tinylm_dir: Path) -> Iterator[Fleet]:
    fleet = Fleet(tinylm_dir)
    fleet.spawn()
    fleet.spawn()
    yield fleet
    fleet.close()


@pytest.fixture
def fleet(servers: Fleet) -> Iterator[Fleet]:
    yield servers
    servers.heal()  # what a test broke, the next one finds repaired


@pytest.fixture
async def rig(redis_server: RedisServer, fleet: Fleet, tmp_path: Path) -> AsyncIterator[Rig]:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    rig = Rig(redis_server.url, fleet, tmp_path / "out")
    yield rig
    await rig.close()


async def running(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=5) as client:
        return list((await client.get(url + "/get_server_info")).json()["running_rids"])


async def until_running(url: str, rollout_id: str) -> None:
    """Until a generation of the rollout runs on the server (not the worker's start check)."""
    while not any(r.startswith(f"{rollout_id}:") for r in await running(url)):
        await asyncio.sleep(0.02)


async def request(log: EventLog, rollout_id: str, *, prompts: int = 6, **kw: Any) -> None:
    req = RolloutRequested(rollout_id=rollout_id, n_prompts=prompts, n_samples_per_prompt=2,
                           **kw)  # fmt: skip
    await log.append(log.names.control, req)
    await play_scheduler(log, req, evaluator_id=EVALUATOR, batch_size=16)


async def control_until(log: EventLog, found: Any, timeout: float = 90.0) -> list[Any]:
    """``rl:control``'s events (with their entry ids) once ``found(events)`` holds."""

    async def wait() -> list[Any]:
        while True:
            envs = await log.read_all(log.names.control)
            events = [(e.id, e.event) for e in envs]
            if found([ev for _, ev in events]):
                return events
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(wait(), timeout)


def said(events: list[Any], kind: type, url: str) -> list[Any]:
    return [ev for ev in events if isinstance(ev, kind) and getattr(ev, "endpoint", None) == url]


async def ready_of(log: EventLog, rollout_id: str) -> RolloutReady:
    events = await control_until(log, lambda evs: any(
        isinstance(e, RolloutReady) and e.rollout_id == rollout_id for e in evs))  # fmt: skip
    return next(ev for _, ev in events if isinstance(ev, RolloutReady))


async def test_a_killed_server_restarted_on_its_port_is_readmitted_only_at_the_active_version(
    rig: Rig,
) -> None:
    await rig.start(PolicyTurns(tokens=48))
    log = rig.log()
    a, b = rig.fleet.urls
    await request(log, "kill1")
    await until_running(a, "kill1")
    rig.fleet.kill(a)
    await asyncio.to_thread(rig.fleet.spawn, a, version=None)  # from weights of no known version
    events = await control_until(log, lambda evs: said(evs, ServerStale, a))
    (stale,) = said([ev for _, ev in events], ServerStale, a)
    assert stale.weight_version is None and stale.active == ACTIVE and stale.worker == "w1"
    async with httpx.AsyncClient(timeout=10) as client:  # what the syncer's push does
        synced = await client.post(a + "/update_weight_version", json={"new_version": "1"})
        assert synced.status_code == 200, synced.text
    events = await control_until(log, lambda evs: said(evs, ServerUp, a))
    ready = await ready_of(log, "kill1")
    assert (ready.n_completed, ready.n_aborted) == (12, 0) and not ready.dummy
    order = [type(ev).__name__ for _, ev in events if getattr(ev, "endpoint", None) == a]
    assert order[:3] == ["ServerDown", "ServerStale", "ServerUp"]
    assert said([ev for _, ev in events], ServerUp, a)[0].weight_version == ACTIVE
    turns = [e.event for e in await log.read_all(log.names.rollout("kill1"))
             if isinstance(e.event, TurnCompleted)]  # fmt: skip
    assert len(turns) == 12 * 3 and {t.weight_version for t in turns} == {ACTIVE}


async def test_a_stopped_server_stalls_its_generation_which_is_retried_on_the_other(
    rig: Rig,
) -> None:
    await rig.start(PolicyTurns(tokens=96))
    log = rig.log()
    a, b = rig.fleet.urls
    await request(log, "stall1")
    await until_running(b, "stall1")
    rig.fleet.signal(b, signal.SIGSTOP)
    stopped_at = time.time()
    events = await control_until(log, lambda evs: said(evs, ServerDown, b))
    (entry_id, down), *_ = [(i, ev) for i, ev in events
                            if isinstance(ev, ServerDown) and ev.endpoint == b]  # fmt: skip
    assert "stalled" in down.reason and "no event for 1.5 s" in down.reason, down.reason
    # detected within stall_s and the health check's bound (the stall_s + 5 s)
    assert id_ms(entry_id) / 1000 - stopped_at <= STALL_S + 5
    ready = await ready_of(log, "stall1")
    assert (ready.n_completed, ready.n_aborted) == (12, 0)
    rig.fleet.signal(b, signal.SIGCONT)
    await control_until(log, lambda evs: said(evs, ServerUp, b))


async def test_with_both_servers_killed_the_turns_wait_and_complete_once_they_are_back(
    rig: Rig,
) -> None:
    await rig.start(PolicyTurns(tokens=48))
    log = rig.log()
    a, b = rig.fleet.urls
    await request(log, "both")
    await until_running(a, "both")
    rig.fleet.kill(a)
    rig.fleet.kill(b)
    await control_until(log, lambda evs: said(evs, ServerDown, a) and said(evs, ServerDown, b))
    state = fold(ControlProjection(), start(ControlProjection()),
                 await log.read_all(log.names.control)).state  # fmt: skip
    assert state.servers_down and not state.may_generate()  # schedulers admit nothing now
    await asyncio.gather(
        asyncio.to_thread(rig.fleet.spawn, a), asyncio.to_thread(rig.fleet.spawn, b)
    )
    ready = await ready_of(log, "both")
    assert (ready.n_completed, ready.n_aborted) == (12, 0)


async def test_a_spent_budget_aborts_naming_the_server_and_its_group_leaves_it_out(
    rig: Rig,
) -> None:
    await rig.start(PolicyTurns(tokens=96), retries=0)
    log = rig.log()
    a, _ = rig.fleet.urls
    await request(log, "spent", filters=FilterSpec(reject_equal_rewards=True))
    await until_running(a, "spent")
    rig.fleet.signal(a, signal.SIGSTOP)  # its generations stall; no retry is left for them
    ready = await ready_of(log, "spent")
    aborts = [e.event for e in await log.read_all(log.names.rollout("spent"))
              if isinstance(e.event, SampleAborted)]  # fmt: skip
    assert aborts and ready.n_aborted == len(aborts)
    for abort in aborts:
        assert abort.abort_class is AbortClass.INFRA_CONN
        assert "retry budget of 0 spent" in abort.error and a in abort.error, abort.error
    # a group with an infra-aborted sample has one reward left: no signal, dropped whole
    for abort in aborts:
        index = int(abort.sample_id.rsplit("s", 1)[1])
        group = {f"spent:s{index - index % 2}", f"spent:s{index - index % 2 + 1}"}
        assert group <= set(ready.dropped_sample_ids)
    assert len(ready.sample_ids) + len(ready.dropped_sample_ids) == 12


async def test_every_server_down_past_the_outage_limit_fails_the_rollout(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    dead = ["http://127.0.0.1:9", "http://127.0.0.1:10"]  # nothing listens there
    rig = Rig(redis_server.url, Fleet(tmp_path), tmp_path / "out")
    try:
        await rig.start(PolicyTurns(tokens=48), urls=dead, outage_limit_s=1.0)
        log = rig.log()
        await request(log, "gone", prompts=1)
        events = await control_until(log, lambda evs: any(
            isinstance(e, RolloutFailed) for e in evs))  # fmt: skip
        failed = next(ev for _, ev in events if isinstance(ev, RolloutFailed))
        assert failed.rollout_id == "gone"
        assert "every policy server has been down for" in failed.reason
        assert all(url in failed.reason for url in dead)
        assert not any(isinstance(ev, RolloutReady) for _, ev in events)
    finally:
        await rig.close()


async def test_a_server_started_without_a_version_serves_the_first_policy_as_version_0(
    redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    # Given a tinylm started without --weight-version (it reports "default") and no sync yet,
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    fleet = Fleet(tinylm_dir)
    url = fleet.spawn(version=None)
    rig = Rig(redis_server.url, fleet, tmp_path / "out")
    try:
        # when a worker serves a rollout on it,
        await rig.start(PolicyTurns(turns=2, tokens=8), active=None)
        log = rig.log()
        await request(log, "first", prompts=2)
        ready = await ready_of(log, "first")
        # then every turn, and so every sampled token, carries version 0.
        turns = [e.event for e in await log.read_all(log.names.rollout("first"))
                 if isinstance(e.event, TurnCompleted)]  # fmt: skip
        assert (ready.n_completed, ready.n_aborted) == (4, 0)
        assert len(turns) == 4 * 2 and {t.weight_version for t in turns} == {0}
        assert set(ready.version_tokens) == {"0"}
        async with httpx.AsyncClient(timeout=10) as client:
            info = (await client.get(url + "/get_model_info")).json()
        assert info["weight_version"] == "0"
    finally:
        try:
            await rig.close()
        finally:
            fleet.close()


async def test_a_server_that_refuses_its_first_label_stops_the_worker_naming_it(
    redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    fleet = Fleet(tinylm_dir)
    proc = spawn_server(tinylm_dir, env={"TINYLM_ADMIN_API_KEY": "admin-secret"})
    fleet.procs[proc.url] = proc
    rig = Rig(redis_server.url, fleet, tmp_path / "out")
    try:
        await rig.start(PolicyTurns(turns=3, tokens=48), active=None)
        worker = rig.tasks.pop(0)  # ended here, not by close
        with pytest.raises(ConfigError) as refused:
            await asyncio.wait_for(worker, 60)
        message = str(refused.value)
        assert proc.url in message and "HTTP 401" in message and "--weight-version 0" in message
    finally:
        try:
            await rig.close()
        finally:
            fleet.close()
