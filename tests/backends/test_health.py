"""``ServerHealth`` and the retries of a bound view (``RoutedBackend``), on servers faked as
``ModelBackend`` adapters: each fake answers, refuses to connect, aborts, reports a version or
fails its health check as a test tells it, so every state change and retry is driven exactly.

The state machine is also driven by hypothesis: whatever the sequence of failed calls,
stalls, gate changes and probes, the tracker's count of servers up, its gauges and what it
announced agree with its states, a stall while the gate is closed marks nothing, and only a
probe at the active version (any known one while none is active: a server reporting none is
labelled version 0 first) brings a server back.

The label goes through ``ServerAdmin`` on an ``httpx.MockTransport`` answering as SGLang
0.5.23's ``/update_weight_version`` does (``srt/entrypoints/http_server.py``: 200 ``{"success":
true, "message", "new_version"}``; ``UpdateWeightVersionReqInput`` in
``srt/managers/io_struct.py``: ``new_version``, ``abort_all_requests``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import metrics
from engine.backends.base import Capabilities, GenerationResult, ModelBackend
from engine.backends.gate import TurnGate
from engine.backends.health import HealthChange, RetryBudget, ServerHealth, ServerState
from engine.backends.hooks import CallKind, ModelCall
from engine.backends.pool import BackendPool
from engine.backends.weight_admin import ServerAdmin
from engine.errors import (
    BackendHTTPError,
    BackendUnavailable,
    ConfigError,
    ServersDown,
    ServerStalled,
)


class FakeServer(ModelBackend):
    """One model server: ``mode`` says how its next generations end."""

    capabilities = Capabilities(token_ids=True, abort=True, weight_version=True, health=True)

    def __init__(self, url: str) -> None:
        self.base_url = url
        self.mode = "ok"  # ok | refuse | abort | stall
        self.version: int | None = 1
        self.healthy = True
        self.calls: list[tuple[str | None, tuple[int, ...]]] = []
        self.aborted: list[str | None] = []

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        self.calls.append((rid, tuple(input_ids or ())))
        if self.mode == "refuse":
            raise BackendUnavailable(f"POST {self.base_url}/generate: could not connect")
        if self.mode == "stall":
            raise ServerStalled(f"POST {self.base_url}/generate: no event for 1 s")
        if self.mode == "abort":
            return GenerationResult(
                text="",
                token_ids=(),
                logprobs=(),
                finish_reason="abort",
                weight_version=self.version,
            )
        return GenerationResult(
            text="x", token_ids=(7, 8), logprobs=(-0.1, -0.2), weight_version=self.version
        )

    async def abort(self, rid: str | None = None) -> None:
        self.aborted.append(rid)

    async def weight_version(self) -> int | None:
        return self.version

    async def health(self, *, generate: bool = False) -> None:
        if not self.healthy:
            raise BackendHTTPError(self.base_url + "/health_generate", 503, "")


URLS = ("http://a:1", "http://b:2")
PARAMS = {"max_new_tokens": 2}


def fleet(
    urls: Sequence[str] = URLS, *, outage_limit_s: float | None = 30.0
) -> tuple[BackendPool, dict[str, FakeServer], list[HealthChange]]:
    servers: dict[str, FakeServer] = {}

    def build(url: str) -> FakeServer:
        servers[url] = FakeServer(url)
        return servers[url]

    pool = BackendPool(list(urls), build=build, outage_limit_s=outage_limit_s)
    for url in urls:
        pool.get(url)  # build each server now, so a test can script it
    heard: list[HealthChange] = []
    pool.health.listen(heard.append)
    return pool, servers, heard


def labeller(
    servers: Mapping[str, FakeServer], posted: list[Any], *, status: int = 200
) -> Callable[[str], ServerAdmin]:
    """``ServerHealth.admin``: the weight routes of the fakes, answering ``status`` as SGLang
    does (a 200 sets the fake's version)."""

    def admin(url: str) -> ServerAdmin:
        def handle(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            posted.append((url, request.url.path, body))
            if status != 200:
                return httpx.Response(status, json={"detail": "Unauthorized"})
            servers[url].version = int(body["new_version"])
            return httpx.Response(200, json={"success": True, "new_version": body["new_version"],
                                             "message": "Weight version updated"})  # fmt: skip

        return ServerAdmin(url, transport=httpx.MockTransport(handle))

    return admin


def budget(tries: int = 4) -> RetryBudget:
    return RetryBudget(tries=tries, backoff_s=0.0)


# -- the tracker ----------------------------------------------------------------------------


async def test_a_failed_call_marks_its_server_down_and_a_probe_at_the_active_version_readmits() -> (
    None
):
    pool, servers, heard = fleet()
    health = pool.health
    health.expected = lambda: 3
    call = ModelCall(CallKind.GENERATE, URLS[0], servers[URLS[0]], "r/t0")
    health.after(call, None, BackendUnavailable("connection refused"))
    assert health.states[URLS[0]] is ServerState.DOWN and health.up_urls() == (URLS[1],)
    assert heard == [HealthChange(URLS[0], ServerState.DOWN, "connection refused", None, 3)]
    assert metrics.SERVER_UP.labels(URLS[0])._value.get() == 0
    servers[URLS[0]].version = None  # back, but started without --weight-version
    await health.probe(URLS[0])
    assert health.states[URLS[0]] is ServerState.STALE and heard[-1].version is None
    await health.probe(URLS[0])  # the same report again: nothing new to say
    assert len(heard) == 2
    servers[URLS[0]].version = 3  # synced
    await health.probe(URLS[0])
    assert health.states[URLS[0]] is ServerState.UP and heard[-1].state is ServerState.UP
    assert heard[-1].version == 3 and metrics.SERVER_UP.labels(URLS[0])._value.get() == 1


async def test_a_stall_while_the_gate_is_closed_marks_nothing() -> None:
    pool, servers, heard = fleet()
    call = ModelCall(CallKind.GENERATE, URLS[1], servers[URLS[1]], "r/t0")
    pool.gate.close("weight sync to version 2 in progress")
    pool.health.after(call, None, ServerStalled("no event for 20 s"))
    servers[URLS[0]].healthy = False
    await pool.health.probe(URLS[0])  # a paused server fails its check: not a dead one
    assert pool.health.up_urls() == URLS and heard == []
    pool.gate.open()
    pool.health.after(call, None, ServerStalled("no event for 20 s"))
    assert pool.health.states[URLS[1]] is ServerState.DOWN


async def test_a_result_at_another_version_makes_its_server_stale() -> None:
    pool, servers, heard = fleet()
    pool.health.expected = lambda: 2
    call = ModelCall(CallKind.GENERATE, URLS[0], servers[URLS[0]], "r/t0")
    result = await servers[URLS[0]].generate(input_ids=[1], sampling_params=PARAMS)
    pool.health.after(call, result, None)  # version 1, the active one is 2
    assert pool.health.states[URLS[0]] is ServerState.STALE and heard[-1].expected == 2


async def test_the_probe_loop_readmits_a_server_that_comes_back() -> None:
    pool, servers, heard = fleet()
    pool.health.probe_every_s = 0.01
    servers[URLS[0]].healthy = False
    pool.health.mark(URLS[0], ServerState.DOWN, "connection refused")
    stop = asyncio.Event()
    probing = asyncio.create_task(pool.health.run(stop))
    await asyncio.sleep(0.05)
    assert pool.health.states[URLS[0]] is ServerState.DOWN
    servers[URLS[0]].healthy = True
    while not pool.health.is_up(URLS[0]):
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(probing, 5)
    assert [c.state for c in heard] == [ServerState.DOWN, ServerState.UP]


async def test_with_every_server_down_calls_wait_and_past_the_outage_limit_fail() -> None:
    pool, servers, _ = fleet(outage_limit_s=0.3)
    for url in URLS:
        pool.health.mark(url, ServerState.DOWN, f"{url} refused")
    view = pool.bind("r:s0/a1", budget=budget())
    call = asyncio.create_task(view.get().generate(input_ids=[1, 2], sampling_params=PARAMS))
    await asyncio.sleep(0.05)
    assert not call.done()
    pool.health.mark(URLS[1], ServerState.UP, "it answers")  # one comes back: the turn runs
    result = await asyncio.wait_for(call, 5)
    assert result.token_ids == (7, 8) and servers[URLS[1]].calls
    for url in URLS:
        pool.health.mark(url, ServerState.DOWN, f"{url} refused")
    with pytest.raises(ServersDown, match=r"every policy server has been down for .* http://a:1"):
        await view.get().generate(input_ids=[1, 2], sampling_params=PARAMS)


# -- admission: every server at a known version before it serves ---------------------------


async def test_admission_labels_a_server_reporting_no_version_as_the_first_one() -> None:
    # Given two servers, one started without --weight-version, and no version active,
    pool, servers, heard = fleet()
    posted: list[Any] = []
    pool.health.admin = labeller(servers, posted)
    servers[URLS[0]].version = None
    # when the worker admits them,
    await pool.health.admit()
    # then the unlabelled one is labelled 0 (aborting nothing) and both serve, as they were.
    assert posted == [(URLS[0], "/update_weight_version",
                       {"new_version": "0", "abort_all_requests": False})]  # fmt: skip
    assert servers[URLS[0]].version == 0 and servers[URLS[1]].version == 1
    assert pool.health.up_urls() == URLS and heard == []
    result = await pool.bind("r:s0/a1").get(URLS[0]).generate(input_ids=[1],
                                                              sampling_params=PARAMS)
    assert result.weight_version == 0


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_a_server_refusing_its_label_is_a_config_error_at_admission(status: int) -> None:
    pool, servers, _ = fleet()
    pool.health.admin = labeller(servers, [], status=status)
    servers[URLS[1]].version = None
    with pytest.raises(ConfigError) as refused:
        await pool.health.admit()
    message = str(refused.value)
    assert URLS[1] in message and f"HTTP {status}" in message
    assert "--weight-version 0" in message and servers[URLS[1]].version is None


async def test_admission_leaves_versions_alone_while_a_sync_is_open_or_one_is_active() -> None:
    # Given a sync open (the gate closed): nothing is labelled, the sync loads every server.
    pool, servers, heard = fleet()
    posted: list[Any] = []
    pool.health.admin = labeller(servers, posted)
    servers[URLS[0]].version = None
    pool.gate.close("weight sync to version 1 in progress")
    await pool.health.admit()
    assert posted == [] and pool.health.up_urls() == URLS
    # Given version 2 active: the unlabelled server and the one at 1 are stale (the syncer
    # re-pushes), and nothing is labelled either.
    pool.gate.open()
    pool.health.expected = lambda: 2
    await pool.health.admit()
    assert posted == [] and pool.health.up_urls() == ()
    assert [(c.endpoint, c.state, c.version, c.expected) for c in heard] == [
        (URLS[0], ServerState.STALE, None, 2), (URLS[1], ServerState.STALE, 1, 2)]


async def test_admission_marks_an_unreachable_server_down_for_the_probes() -> None:
    pool, servers, heard = fleet()

    async def refused() -> int | None:
        raise BackendUnavailable("GET http://a:1/get_model_info: could not connect")

    servers[URLS[0]].weight_version = refused  # type: ignore[method-assign]
    await pool.health.admit()
    assert pool.health.up_urls() == (URLS[1],)
    assert heard[0].state is ServerState.DOWN and "could not connect" in heard[0].reason


async def test_a_server_back_unlabelled_and_refusing_the_label_stays_down_saying_why() -> None:
    # Given a server down, back without --weight-version and with an admin key,
    pool, servers, heard = fleet()
    pool.health.admin = labeller(servers, [], status=401)
    pool.health.mark(URLS[0], ServerState.DOWN, "connection refused")
    servers[URLS[0]].version = None
    # when it is probed (twice),
    await pool.health.probe(URLS[0])
    await pool.health.probe(URLS[0])
    # then it stays down, and the log hears why once.
    assert pool.health.states[URLS[0]] is ServerState.DOWN
    assert [c.state for c in heard] == [ServerState.DOWN, ServerState.DOWN]
    assert "refused to be labelled version 0" in heard[1].reason
    assert "HTTP 401" in pool.health.reasons[URLS[0]]


Step = tuple[str, int, Any]
steps = st.lists(
    st.one_of(
        st.tuples(st.just("fail"), st.integers(0, 2), st.sampled_from(["refuse", "stall", "http"])),
        st.tuples(st.just("gate"), st.just(0), st.booleans()),
        st.tuples(
            st.just("probe"),
            st.integers(0, 2),
            st.tuples(st.booleans(), st.sampled_from([None, 1, 2])),
        ),
        st.tuples(st.just("expect"), st.just(0), st.sampled_from([None, 1, 2])),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(steps)
def test_the_tracker_keeps_its_states_counts_and_announcements_consistent(
    plan: list[Step],
) -> None:
    async def drive() -> None:
        urls = ("http://h0:1", "http://h1:1", "http://h2:1")
        servers = {u: FakeServer(u) for u in urls}
        gate = TurnGate()
        health = ServerHealth(urls, servers.__getitem__, gate)
        health.admin = labeller(servers, [])
        expected: list[int | None] = [None]
        health.expected = lambda: expected[0]
        heard: list[HealthChange] = []
        health.listen(heard.append)
        last = dict.fromkeys(urls, ServerState.UP)
        for kind, i, arg in plan:
            url = urls[i]
            before = health.states[url]
            if kind == "fail":
                error = {
                    "refuse": BackendUnavailable("refused"),
                    "stall": ServerStalled("stall"),
                    "http": BackendHTTPError(url, 400, "bad"),
                }[arg]
                health.after(ModelCall(CallKind.GENERATE, url, servers[url], "r"), None, error)
                if arg == "http" or (arg == "stall" and not gate.is_open):
                    assert health.states[url] is before  # not the server's fault, or a sync
                else:
                    assert health.states[url] is ServerState.DOWN
            elif kind == "gate":
                gate.open() if arg else gate.close("sync")
            elif kind == "expect":
                expected[0] = arg
            elif before is not ServerState.UP:  # probes run for servers that are not up
                servers[url].healthy, servers[url].version = arg
                await health.probe(url)
                after = health.states[url]
                if not servers[url].healthy:
                    assert after is (ServerState.DOWN if gate.is_open else before)
                elif expected[0] is None or arg[1] == expected[0]:
                    assert after is ServerState.UP
                    if expected[0] is None and arg[1] is None and gate.is_open:
                        assert servers[url].version == 0  # labelled the first version
                else:
                    assert after is ServerState.STALE
        for change in heard:
            assert change.state is not last[change.endpoint] or change.state is ServerState.STALE
            last[change.endpoint] = change.state
        assert last == health.states  # every change was announced
        up = [u for u in urls if health.states[u] is ServerState.UP]
        assert health.up_urls() == tuple(up) and health.any_up == bool(up)
        for u in urls:
            assert metrics.SERVER_UP.labels(u)._value.get() == (1 if u in up else 0)

    asyncio.run(drive())


# -- retries of a bound view -------------------------------------------------------------


async def test_a_refused_turn_is_sent_again_from_the_same_tokens_on_the_other_server() -> None:
    pool, servers, heard = fleet()
    view = pool.bind("r:s0/a1", budget=(b := budget()))
    backend = view.get()
    first = pool.server_of("r:s0/a1")
    assert first is not None
    other = next(u for u in URLS if u != first)
    servers[first].mode = "refuse"
    result = await backend.generate(input_ids=[1, 2, 3], sampling_params=PARAMS)
    assert result.token_ids == (7, 8)
    assert servers[first].calls == [("r:s0/a1/t0", (1, 2, 3))]
    assert servers[other].calls == [("r:s0/a1/t1", (1, 2, 3))]  # same prefix, a new rid
    assert pool.server_of("r:s0/a1") == other and pool.load() == {first: 0, other: 1}
    assert heard[0].endpoint == first and heard[0].state is ServerState.DOWN
    await asyncio.sleep(0)  # the background abort of the failed rid
    assert servers[first].aborted == ["r:s0/a1/t0"]
    assert b.used == 1 and b.servers == [first] and not b.reached_caller


async def test_a_trajectory_naming_a_policy_server_is_routed_and_retried_too() -> None:
    """The bundled agents name the worker's server in their config (``sglang_url``): their
    turns are retried like those of an agent that names none."""
    pool, servers, heard = fleet()
    view = pool.bind("r:s1/a1", budget=budget())
    view.get()  # placed
    first = pool.server_of("r:s1/a1")
    assert first is not None
    other = next(u for u in URLS if u != first)
    servers[first].mode = "refuse"
    result = await view.get(first).generate(input_ids=[4, 5], sampling_params=PARAMS)
    assert result.token_ids == (7, 8)
    assert servers[other].calls == [("r:s1/a1/t1", (4, 5))]
    assert heard[0].endpoint == first and heard[0].state is ServerState.DOWN


async def test_an_aborted_or_wrong_version_result_is_retried_and_a_spent_budget_reaches_agent() -> (
    None
):
    pool, servers, _ = fleet(urls=URLS[:1])
    pool.health.expected = lambda: 1
    server = servers[URLS[0]]
    server.mode = "abort"  # e.g. the server shut down gracefully
    b = budget(tries=2)
    backend = pool.bind("r:s1/a1", budget=b).get()

    async def unabort() -> None:
        while len(server.calls) < 2:
            await asyncio.sleep(0)
        server.mode = "ok"

    fix = asyncio.create_task(unabort())
    assert (await backend.generate(input_ids=[5], sampling_params=PARAMS)).token_ids == (7, 8)
    await fix
    assert [rid for rid, _ in server.calls] == ["r:s1/a1/t0", "r:s1/a1/t1", "r:s1/a1/t2"]
    server.mode, server.version = "ok", 0  # restarted from older weights
    assert (await backend.generate(input_ids=[5], sampling_params=PARAMS)).weight_version == 0
    assert b.spent and b.reached_caller  # its last retry spent: the result goes to the agent
    assert "retry budget of 2 spent" in b.describe() and URLS[0] in b.describe()


async def test_a_retry_a_hook_refuses_hands_back_the_aborted_result() -> None:
    pool, servers, _ = fleet(urls=URLS[:1])
    servers[URLS[0]].mode = "abort"

    class EndsTheSample:
        def __init__(self) -> None:
            self.calls = 0

        async def before(self, call: ModelCall) -> None:
            self.calls += 1
            if self.calls > 1:
                raise RuntimeError("the sample fell into the aborted tail")

        def after(self, call: ModelCall, result: Any, error: Any) -> None:
            return None

    backend = pool.bind("r:s2/a1", hooks=(EndsTheSample(),), budget=budget()).get()
    result = await backend.generate(input_ids=[5], sampling_params=PARAMS)
    assert result.aborted and len(servers[URLS[0]].calls) == 1


async def test_calls_that_cannot_be_retried_mark_the_failure_for_a_re_run() -> None:
    pool, servers, _ = fleet(urls=URLS[:1])
    servers[URLS[0]].mode = "refuse"
    b = budget()
    backend = pool.bind("r:s3/a1", budget=b).get()
    with pytest.raises(BackendUnavailable):  # a rid of the caller's: not the view's to retry
        await backend.generate(input_ids=[5], sampling_params=PARAMS, rid="own")
    assert b.reached_caller and b.used == 0
    pool.health.mark(URLS[0], ServerState.UP, "it answers")
    unbudgeted = pool.bind("r:s4/a1").get()  # no budget: nothing is retried
    with pytest.raises(BackendUnavailable):
        await unbudgeted.generate(input_ids=[5], sampling_params=PARAMS)
    assert len(servers[URLS[0]].calls) == 2


def test_a_budget_counts_its_tries_and_backs_off() -> None:
    b = RetryBudget(tries=3, backoff_s=0.5, cap_s=1.5)
    pauses = []
    for url in ("http://a:1", "http://b:2", "http://a:1", "http://b:2"):
        left = b.take(url, "refused")
        pauses.append(b.pause_s())
    assert [b.used, left, b.spent] == [4, False, True]
    assert pauses == [0.5, 1.0, 1.5, 1.5] and b.servers == ["http://a:1", "http://b:2"]
