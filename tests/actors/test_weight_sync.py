"""Weight sync through the log, end to end: real tinylm subprocesses, a real redis-server.

An evaluator worker runs multi-turn episodes against tinylm (each turn one ``/generate``
through the worker's ``BackendPool``, with a pause between turns as a tool call would take);
the weight syncer, the finalizer and the trainer's client run beside it, each on its own
connection. The scheduler's part is played (``tests/actors/play.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.actors.weight_sync import SyncConfig, WeightSyncer
from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.agents.binding import EvaluatorBinding
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.backends.weight_admin import ServerAdmin
from engine.client import RolloutClient
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason
from engine.errors import WeightSyncFailed
from engine.events import (
    EventLog,
    PolicyVersionActivated,
    QuiesceCompleted,
    QuiesceRequested,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    ServerStale,
    ServerUp,
    TurnCompleted,
    WorkerParked,
)
from engine.events import WeightSyncFailed as WeightSyncFailedEvent
from engine.events.redis_log import RedisEventLog, RedisSettings
from engine.events.redis_log import connect as redis_connect
from engine.ops.embedded import free_port
from engine.ops.processes import Process, Processes
from tests.actors.play import play_scheduler
from tests.backends.test_tinylm_weights import perturbed_copy
from tests.redis_server import RedisServer
from tests.rig import events_of

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

ADMIN = "sync-test-admin-key"
PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]
OBSERVATION = [201, 40, 41]
BLOCK_MS = 100


class TurnsAgent(BaseAgent):
    """``turns`` generate calls, each followed by a fixed observation and a short pause
    (a tool call); per token, the version the server reported for its turn."""

    def __init__(self, turns: int, pause_s: float, tokens: int = 6, *, ignore_eos: bool = False
                 ) -> None:
        self.turns = turns
        self.pause_s = pause_s
        self.tokens = tokens
        self.ignore_eos = ignore_eos

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        assert context.backends is not None
        backend = context.backends.get()
        ids = list(PROMPT)
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        records: list[TurnRecord] = []
        params = {"max_new_tokens": self.tokens, "temperature": 0.0,
                  "ignore_eos": self.ignore_eos}
        for turn in range(self.turns):
            gen = await backend.generate(input_ids=ids + response, sampling_params=params)
            assert gen.token_ids is not None and gen.logprobs is not None
            response += [*gen.token_ids, *OBSERVATION]
            logprobs += [*gen.logprobs, *([0.0] * len(OBSERVATION))]
            mask += [1] * len(gen.token_ids) + [0] * len(OBSERVATION)
            versions += [-1 if v is None else v for v in gen.versions()]
            versions += [-1] * len(OBSERVATION)
            records.append(
                TurnRecord(index=turn, prompt_tokens=len(ids), response_tokens=len(gen.token_ids),
                           weight_version=gen.weight_version)
            )
            await asyncio.sleep(self.pause_s)
        return AgentResult(
            prompt_token_ids=ids, response_token_ids=response, response_logprobs=logprobs,
            loss_mask=mask, response_versions=versions, turns=tuple(records),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


class Trace(httpx.AsyncBaseTransport):
    """Real HTTP that appends ``(what, url)`` to a shared list when a request starts and
    ends: ``gen`` for ``/generate``, ``load`` for ``/update_weights_from_disk``. Everything
    runs on one event loop, so the list's order is the order things happened in."""

    def __init__(self, trace: list[tuple[str, str]]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._trace = trace

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        what = {"/generate": "gen", "/update_weights_from_disk": "load"}.get(request.url.path)
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if what:
            self._trace.append((f"{what}-start", url))
        try:
            response = await self._inner.handle_async_request(request)
            await response.aread()
        finally:
            if what:
                self._trace.append((f"{what}-end", url))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class Stack:
    redis_url: str
    trace: list[tuple[str, str]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    logs: list[EventLog] = field(default_factory=list)
    worker: EvaluatorWorker | None = None
    syncer: WeightSyncer | None = None

    def log(self) -> EventLog:
        redis = redis_connect(RedisSettings(url=self.redis_url, block_ms=BLOCK_MS))
        log = RedisEventLog(redis, producer="test", block_ms=BLOCK_MS)
        self.logs.append(log)
        return log

    def start(self, servers: list[str], agent: BaseAgent, *, interrupt: bool = True) -> None:
        profile = EvaluatorProfile(
            evaluator_id="turns", resource=Resource(concurrency=8), batch_size=4
        )
        pool = BackendPool(
            servers,
            build=lambda url: SGLangBackend(config=SGLangConfig(url=url),
                                            transport=Trace(self.trace)),
        )
        self.worker = EvaluatorWorker(
            self.log(),
            {"turns": EvaluatorBinding(profile, agent)},
            WorkerConfig(worker_id="w1", evaluator_ids=("turns",), heartbeat_ms=100,
                         claim_idle_ms=2000, block_ms=BLOCK_MS, grace_s=1.0),
            backends=pool,
        )
        self.syncer = WeightSyncer(
            self.log(),
            SyncConfig(syncer_id="s1", servers=tuple(servers), park_timeout_s=60,
                       live_window_ms=10_000, heartbeat_ms=100, claim_idle_ms=2000,
                       block_ms=BLOCK_MS, interrupt=interrupt),
            admin=lambda url: ServerAdmin(url, admin_key=ADMIN, transport=Trace(self.trace)),
        )
        finalizer = Finalizer(
            self.log(),
            FinalizerConfig(consumer="f1", heartbeat_ms=100, claim_idle_ms=2000,
                            block_ms=BLOCK_MS),
        )
        for actor in (self.worker, self.syncer, finalizer):
            self.tasks.append(asyncio.create_task(actor.run(self.stop)))

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 15)
        for log in self.logs:
            await log.aclose()


@pytest.fixture
async def stack(redis_server: RedisServer) -> AsyncIterator[Stack]:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    s = Stack(redis_server.url)
    yield s
    await s.close()


@pytest.fixture(scope="module")
def v1_dir(tinylm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tinylm_dir, tmp_path_factory.mktemp("v1") / "model", seed=11)


def serve(
    procs: Processes, name: str, model_dir: Path, port: int | None = None, *,
    admin_key: bool = True,
) -> Process:
    """A tinylm server at version 0, holding the admin key unless ``admin_key`` is false."""
    return procs.serve_tinylm(name, model_dir, "--weight-version", "0", port=port,
                              env={"TINYLM_ADMIN_API_KEY": ADMIN} if admin_key else None)


async def request_rollout(
    client: RolloutClient, log: EventLog, rollout_id: str, n: int, version: int
) -> RolloutRequested:
    await client.request(iteration=1, n_prompts=n, policy_version=version, rollout_id=rollout_id)
    request = RolloutRequested(rollout_id=rollout_id, iteration=1, n_prompts=n,
                               policy_version=version)
    await play_scheduler(log, request, evaluator_id="turns", batch_size=4)
    return request


async def until(log: EventLog, stream: str, predicate: Callable[[list[Any]], bool],
                timeout: float = 60) -> list[Any]:
    """Every event of ``stream`` once ``predicate`` holds for them (blocking reads)."""

    async def follow() -> list[Any]:
        seen: list[Any] = []
        position = "0-0"
        while not predicate(seen):
            envs, position = await log.read_after(stream, position, block_ms=BLOCK_MS)
            seen += [env.event for env in envs]
        return seen

    return await asyncio.wait_for(follow(), timeout)


def _segments(mask: list[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        elif m:
            out.append((i, i + 1))
    return out


async def test_a_version_published_mid_rollout_lands_between_turns(
    stack: Stack, procs: Processes, tinylm_dir: Path, v1_dir: Path
) -> None:
    server = serve(procs, "tinylm", tinylm_dir)
    # A sync that waits for the turns in flight (``interrupt=False``).
    stack.start([server.url], TurnsAgent(turns=8, pause_s=0.15), interrupt=False)
    log = stack.log()
    client = RolloutClient(stack.log())
    await request_rollout(client, log, "mid", 4, version=0)
    stream = log.names.rollout("mid")
    # Publish once the trajectories have made two turns each (8 replies), mid-episode.
    while stack.trace.count(("gen-end", server.url)) < 8:
        await asyncio.sleep(0.02)
    await client.publish_version(1, f"file://{v1_dir}")
    activated = await client.wait_version_active(1, timeout=60)
    assert activated.servers == [server.url] and activated.version == 1
    ready = await client.wait_ready("mid", timeout=120)
    assert len(ready.sample_ids) == 4

    # The server really runs version 1 now.
    info = httpx.get(server.url + "/get_model_info", timeout=30).json()
    assert info["weight_version"] == "1"

    # What each turn recorded: version 0, then (once the sync landed) version 1, never
    # back; some trajectory has both -- the update landed in the middle of it.
    turns: dict[str, list[tuple[int, int | None]]] = {}
    for ev in await events_of(log, stream, TurnCompleted):
        turns.setdefault(ev.sample_id, []).append((ev.turn, ev.weight_version))
    versions = {sid: [v for _, v in sorted(ts)] for sid, ts in turns.items()}
    assert all(len(vs) == 8 for vs in versions.values())
    assert all(vs == sorted(vs) and set(vs) <= {0, 1} for vs in versions.values())
    assert any(set(vs) == {0, 1} for vs in versions.values()), versions
    assert 0 in {v for vs in versions.values() for v in vs}

    # Quiesce never split a turn: each turn's tokens carry one version ...
    samples = await client.load("mid")
    for sample in samples:
        mask = sample.loss_mask.tolist()
        token_versions = (sample.token_versions.tolist()
                          if sample.token_versions is not None else [])
        n_prompt = len(sample.tokens) - sample.response_length
        response_versions = token_versions[-sample.response_length:]
        assert len(response_versions) == len(mask) and n_prompt > 0
        for a, b in _segments(mask):
            assert len(set(response_versions[a:b])) == 1
    # ... and while the weights were loading, no generate call was in flight or began:
    # every call that started before the load had ended, none started until it answered.
    load_start = stack.trace.index(("load-start", server.url))
    load_end = stack.trace.index(("load-end", server.url))
    before = stack.trace[:load_start]
    assert before.count(("gen-start", server.url)) == before.count(("gen-end", server.url))
    assert before.count(("gen-start", server.url)) > 0
    assert not [t for t in stack.trace[load_start + 1 : load_end] if t[0].startswith("gen")]

    # The worker said it was parked before the load; the syncer waited for it.
    control = log.names.control
    assert [e.worker for e in await events_of(log, control, WorkerParked)] == ["w1"]
    (done,) = await events_of(log, control, QuiesceCompleted)
    assert done.parked == ["w1"] and done.unparked == [] and done.version == 1

    # The weights really changed: a version-0 turn, scored again now, gets other logprobs.
    sample = next(s for s in samples if 0 in s.token_versions.tolist())
    completed = next(e for e in await events_of(log, stream, SampleCompleted)
                     if e.sample_id == sample.sample_id)
    a, b = _segments(completed.loss_mask.tolist())[0]
    prompt = completed.prompt_ids.tolist()
    turn0 = completed.response_ids.tolist()[a:b]
    rescored = httpx.post(server.url + "/generate", json={
        "input_ids": prompt + turn0, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": len(prompt) - 1,
    }, timeout=60).json()
    assert rescored["meta_info"]["weight_version"] == "1"
    new = np.array([e[0] for e in rescored["meta_info"]["input_token_logprobs"][1:]])
    old = np.array(completed.logprobs.tolist()[a:b])
    assert new.shape == old.shape and float(np.abs(new - old).max()) > 1e-3


LONG_TURN = 400


async def test_an_interrupting_sync_continues_the_turns_in_flight_on_the_new_weights(
    stack: Stack, procs: Processes, tinylm_dir: Path, v1_dir: Path
) -> None:
    # Workers abort their own requests: a server with an admin key would refuse them that
    # (docs/security.md), and the sync would wait for the turns instead.
    server = serve(procs, "tinylm", tinylm_dir, admin_key=False)
    stack.start([server.url], TurnsAgent(turns=2, pause_s=0.0, tokens=LONG_TURN,
                                         ignore_eos=True))
    log = stack.log()
    client = RolloutClient(stack.log())
    await request_rollout(client, log, "long", 2, version=0)
    stream = log.names.rollout("long")
    # Publish while the first turns are generating (each takes a while: LONG_TURN tokens).
    while stack.trace.count(("gen-start", server.url)) < 2:
        await asyncio.sleep(0.02)
    # The syncer waits for the workers it sees on the work streams: this one, once listed.
    while "w1" not in await log.group_consumers(log.names.work("turns"), "evaluators"):
        await asyncio.sleep(0.02)
    await client.publish_version(1, f"file://{v1_dir}")
    await client.wait_version_active(1, timeout=60)
    ready = await client.wait_ready("long", timeout=120)
    assert len(ready.sample_ids) == 2 and not await events_of(log, stream, SampleAborted)

    # The turns in flight were aborted, not waited for: every generate that started before
    # the load had ended, and the load did not wait for a turn to finish its tokens.
    control = log.names.control
    (quiesce,) = await events_of(log, control, QuiesceRequested)
    assert quiesce.interrupt and quiesce.version == 1
    (done,) = await events_of(log, control, QuiesceCompleted)
    assert done.parked == ["w1"] and done.unparked == []
    load_start = stack.trace.index(("load-start", server.url))
    before = stack.trace[:load_start]
    assert before.count(("gen-start", server.url)) == before.count(("gen-end", server.url))

    # Each turn recorded once, whole: LONG_TURN tokens (the partial ones, then the rest),
    # each carrying the version that sampled it; a turn in flight at the swap is split.
    turns = await events_of(log, stream, TurnCompleted)
    assert sorted((t.sample_id, t.turn) for t in turns) == sorted(
        (sid, n) for sid in ready.sample_ids for n in range(2)
    )
    samples = await client.load("long")
    split = []
    for sample in samples:
        mask = sample.loss_mask.tolist()
        assert sample.token_versions is not None
        versions = sample.token_versions.tolist()[-sample.response_length:]
        segments = _segments(mask)
        assert [b - a for a, b in segments] == [LONG_TURN, LONG_TURN]
        generated = [versions[i] for a, b in segments for i in range(a, b)]
        assert generated == sorted(generated) and set(generated) <= {0, 1}
        split += [(sample, a, b) for a, b in segments if len(set(versions[a:b])) == 2]
    assert split, "no turn was in flight when the weights changed"

    # The continuation's logprobs are the new weights' (rescored on version 1 now).
    sample, a, b = split[0]
    completed = next(e for e in await events_of(log, stream, SampleCompleted)
                     if e.sample_id == sample.sample_id)
    versions = completed.token_versions.tolist()
    cut = a + versions[a:b].index(1)
    prompt = completed.prompt_ids.tolist()
    head = prompt + completed.response_ids.tolist()[:cut]
    rest = completed.response_ids.tolist()[cut:b]
    rescored = httpx.post(server.url + "/generate", json={
        "input_ids": head + rest, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": len(head) - 1,
    }, timeout=60).json()
    assert rescored["meta_info"]["weight_version"] == "1"
    new = np.array([e[0] for e in rescored["meta_info"]["input_token_logprobs"][1:]])
    served = np.array(completed.logprobs.tolist()[cut:b])
    assert new.shape == served.shape and float(np.abs(new - served).max()) < 1e-3


async def test_a_sync_failing_on_one_server_poisons_generation_until_a_good_sync(
    stack: Stack, procs: Processes, tinylm_dir: Path, v1_dir: Path
) -> None:
    late_port = free_port()
    late_url = f"http://127.0.0.1:{late_port}"
    first = serve(procs, "first", tinylm_dir)
    stack.start([first.url, late_url], TurnsAgent(turns=2, pause_s=0.0))
    log = stack.log()
    client = RolloutClient(stack.log())

    # Version 1: the second server is not up, so the sync fails there.
    await client.publish_version(1, str(v1_dir))
    with pytest.raises(WeightSyncFailed) as failed:
        await client.wait_version_active(1, timeout=60)
    assert late_url in failed.value.error and "connect" in failed.value.error
    assert failed.value.servers_failed == [late_url]
    (event,) = await events_of(log, log.names.control, WeightSyncFailedEvent)
    assert event.servers_ok == [first.url] and event.servers_failed == [late_url]

    # Poisoned: a rollout requested now cannot run, and waiting for it says why.
    await request_rollout(client, log, "poisoned", 4, version=1)
    with pytest.raises(WeightSyncFailed) as waited:
        await client.wait_ready("poisoned", timeout=60)
    assert waited.value.error == event.error

    # The second server comes up; version 2 syncs on both and generation resumes.
    late = serve(procs, "late", tinylm_dir, port=late_port)
    assert late.url == late_url
    await client.publish_version(2, str(v1_dir))
    activated = await client.wait_version_active(2, timeout=60)
    assert isinstance(activated, PolicyVersionActivated)
    assert activated.servers == [first.url, late_url]
    ready = await client.wait_ready("poisoned", timeout=120)
    assert len(ready.sample_ids) == 4
    # Nothing was generated while the engine was poisoned: the first server had
    # loaded version 1, yet every turn ran on version 2.
    turns = await events_of(log, log.names.rollout("poisoned"), TurnCompleted)
    assert len(turns) == 8 and {t.weight_version for t in turns} == {2}


async def test_a_server_restarted_from_older_weights_is_loaded_again_before_it_serves(
    stack: Stack, procs: Processes, tinylm_dir: Path, v1_dir: Path
) -> None:
    """Version 1 is active on both servers; one is SIGKILLed and restarted from the version-0
    folder. The worker finds it stale, the syncer loads version 1 on it alone, and only then
    does it get turns again: every turn of the next rollout ran on version 1."""
    a, b = serve(procs, "a", tinylm_dir), serve(procs, "b", tinylm_dir)
    stack.start([a.url, b.url], TurnsAgent(turns=3, pause_s=0.05))
    log = stack.log()
    client = RolloutClient(stack.log())
    await client.publish_version(1, str(v1_dir))
    await client.wait_version_active(1, timeout=60)

    # When b dies and comes back with the weights it was started from (version 0),
    procs.kill("b")
    procs.restart("b")
    assert httpx.get(b.url + "/get_model_info", timeout=30).json()["weight_version"] == "0"
    await request_rollout(client, log, "after", 8, version=1)
    ready = await client.wait_ready("after", timeout=120)

    # then the rollout completes on version 1 only, and b was reported stale, loaded again
    # by the syncer (no second quiesce), and readmitted at version 1.
    assert len(ready.sample_ids) == 8
    turns = await events_of(log, log.names.rollout("after"), TurnCompleted)
    assert len(turns) == 24 and {t.weight_version for t in turns} == {1}
    control = await until(log, log.names.control, lambda evs: any(
        isinstance(e, ServerUp) and e.endpoint == b.url and e.weight_version == 1
        and any(isinstance(s, ServerStale) and s.endpoint == b.url for s in evs)
        for e in evs), timeout=60)
    stale = next(e for e in control if isinstance(e, ServerStale) and e.endpoint == b.url)
    assert stale.active == 1 and stale.weight_version == 0
    assert len([e for e in control if isinstance(e, QuiesceRequested)]) == 1
    assert httpx.get(b.url + "/get_model_info", timeout=30).json()["weight_version"] == "1"


async def test_a_syncer_killed_mid_sync_is_replaced_and_a_dead_worker_does_not_block_it(
    redis_server: RedisServer, procs: Processes, tinylm_dir: Path, v1_dir: Path
) -> None:
    """Syncer A opens the sync of version 1 and waits for a live worker that never parks
    ("ghost": it reads its work stream but runs no gate). A is killed (SIGKILL); syncer B
    claims the publication and resumes the same sync -- no second quiesce -- and once the
    ghost has been silent past the live window it is no longer waited for."""
    redis = redis_connect(RedisSettings(url=redis_server.url, block_ms=BLOCK_MS))
    await redis.flushall()
    log = RedisEventLog(redis, producer="test", block_ms=BLOCK_MS)
    client = RolloutClient(log)
    sync_args = ["--live-window-ms", "5000", "--park-timeout-s", "120"]
    ghost_alive = asyncio.Event()
    ghost_alive.set()

    async def ghost() -> None:
        stream = log.names.work("ghost")
        await log.ensure_group(stream, "evaluators")
        while ghost_alive.is_set():
            await log.read_group("evaluators", "ghost", [stream], block_ms=100)

    server = serve(procs, "tinylm", tinylm_dir, admin_key=False)  # the syncers hold no key
    haunting = asyncio.create_task(ghost())
    try:
        procs.start("syncA", "sync", "--worker-id", "syncA", "--sglang-url", server.url,
                    *sync_args)
        await client.publish_version(1, str(v1_dir))
        control = log.names.control
        await until(log, control, lambda evs: any(
            isinstance(e, QuiesceRequested) for e in evs))
        procs.kill("syncA")
        ghost_alive.clear()
        await haunting
        procs.start("syncB", "sync", "--worker-id", "syncB", "--sglang-url", server.url,
                    *sync_args)
        activated = await client.wait_version_active(1, timeout=120)
    finally:
        ghost_alive.clear()
        await asyncio.gather(haunting, return_exceptions=True)
    assert activated.producer == "syncB" and activated.servers == [server.url]
    assert httpx.get(server.url + "/get_model_info", timeout=30).json()[
        "weight_version"] == "1"
    (requested,) = await events_of(log, control, QuiesceRequested)
    assert requested.producer == "syncA" and requested.version == 1
    (done,) = await events_of(log, control, QuiesceCompleted)
    assert done.producer == "syncB" and done.parked == [] and done.unparked == []
    assert len(await events_of(log, control, PolicyVersionActivated)) == 1
    await redis.aclose()
