"""The routing rule of a trajectory pinned to a weight version (``BackendPool.bind(version=)``,
an eval request's ``pinned_version``), on servers faked as ``ModelBackend`` adapters
(``tests/backends/test_health.py``): it runs only on servers serving its version -- an eval
server up at it first, else a policy server up at it while no sync is open -- never on another
version, and its calls on an eval server pass no ``TurnGate``. Unpinned trajectories never
run on an eval server."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.health import ServerState
from engine.backends.pool import BackendPool
from engine.errors import BackendUnavailable, ServersDown
from tests.backends.test_health import PARAMS, FakeServer, budget

P, E0, E1 = "http://policy:1", "http://eval0:2", "http://eval1:3"


def pool_of(
    policy: tuple[str, ...] = (P,), *, active: int | None = 1, outage_limit_s: float = 30.0
) -> tuple[BackendPool, dict[str, FakeServer]]:
    servers: dict[str, FakeServer] = {}

    def build(url: str) -> FakeServer:
        servers[url] = FakeServer(url)
        return servers[url]

    pool = BackendPool(list(policy), build=build, outage_limit_s=outage_limit_s)
    pool.health.expected = lambda: active
    pool.health.probe_every_s = 0.01
    for url in policy:
        pool.get(url)
    return pool, servers


async def eval_servers(
    pool: BackendPool, servers: dict[str, FakeServer], versions: dict[str, int | None]
) -> None:
    """Register eval servers at ``versions`` and probe them once (a worker's probe loop)."""
    pool.use_eval_servers(list(versions))
    for url, version in versions.items():
        pool.get(url)  # the probe's backend
        servers[url].version = version
        await pool.health.probe(url)


async def turn(view: BackendPool) -> tuple[str, int | None]:
    backend = view.get()
    result = await backend.generate(input_ids=[1, 2], sampling_params=PARAMS)
    return backend.base_url, result.weight_version


async def test_a_pinned_trajectory_runs_on_the_eval_server_at_its_version_and_no_other() -> None:
    # Given a policy server at the active version 1 and eval servers at versions 0 and 1
    pool, servers = pool_of()
    await eval_servers(pool, servers, {E0: 0, E1: 1})
    assert pool.health.states[E0] is ServerState.UP and pool.health.up_urls() == (P,)
    # When trajectories pinned to 0 and 1 and an unpinned one take turns
    pinned0 = pool.bind("ev:s0/a1", budget=budget(), version=0)
    pinned1 = pool.bind("ev:s1/a1", budget=budget(), version=1)
    train = pool.bind("tr:s0/a1", budget=budget())
    # Then each pinned one runs on the eval server of its version (the eval server before a
    # policy server at the same version), and training never runs on an eval server
    for _ in range(3):
        assert await turn(pinned0) == (E0, 0)
        assert await turn(pinned1) == (E1, 1)
        assert await turn(train) == (P, 1)
    assert [len(servers[u].calls) for u in (P, E0, E1)] == [3, 3, 3]


async def test_a_pinned_trajectory_uses_a_policy_server_still_at_its_version_then_waits() -> None:
    # Given no eval server and a policy server at the active version 0
    active = [0]
    pool, servers = pool_of(outage_limit_s=0.2)
    pool.health.expected = lambda: active[0]
    view = pool.bind("ev:s0/a1", budget=budget(), version=0)
    servers[P].version = 0
    # Then the pinned trajectory runs there while the policy is at its version
    assert await turn(view) == (P, 0)
    # When a sync opens, nothing pinned is placed on the policy servers
    pool.gate.close("weight sync to version 1 in progress")
    assert pool.health.serving(0) == ()
    # And once version 1 is active, the pinned trajectory waits for a server at 0 and, past
    # the outage limit, fails naming the version it waited for; it never ran on version 1
    servers[P].version, active[0] = 1, 1
    pool.gate.open()
    with pytest.raises(ServersDown, match="no model server serves weight version 0"):
        await turn(view)
    assert len(servers[P].calls) == 1


async def test_a_pinned_turn_served_at_another_version_is_retried_on_a_server_at_it() -> None:
    # Given two eval servers probed at version 0, one of which now generates at version 2 (it
    # was restarted from other weights since its probe)
    pool, servers = pool_of()
    await eval_servers(pool, servers, {E0: 0, E1: 0})
    view = pool.bind("ev:s0/a1", budget=budget(), version=0)
    first, _ = await turn(view)
    other = E1 if first == E0 else E0
    servers[first].version = 2
    # When the trajectory takes its next turn
    url, version = await turn(view)
    # Then the result of version 2 is not handed back: the turn runs again on the other one
    assert (url, version) == (other, 0)
    assert pool.health.serving(0) == (other,)
    # And without a retry budget the call fails as an infrastructure failure instead
    bare = pool.bind("ev:s1/a1", version=0)
    servers[other].version = 3
    with pytest.raises(BackendUnavailable, match="pinned to 0"):
        await turn(bare)


async def test_calls_on_an_eval_server_pass_no_gate_while_a_sync_holds_the_policy() -> None:
    # Given an eval server at version 0 and a weight sync that closed the worker's gate
    pool, servers = pool_of()
    await eval_servers(pool, servers, {E0: 0})
    pool.gate.close("weight sync to version 2 in progress")
    # When a pinned and an unpinned trajectory each take a turn
    train = asyncio.create_task(turn(pool.bind("tr:s0/a1", budget=budget())))
    pinned = turn(pool.bind("ev:s0/a1", budget=budget(), version=0))
    assert await asyncio.wait_for(pinned, 30) == (E0, 0)
    # Then the pinned one ran, counted by no gate, while the training turn waits for the sync
    await asyncio.sleep(0)
    assert not train.done() and pool.gate.in_flight == 0
    pool.gate.open()
    assert await train == (P, 1)


async def test_an_eval_server_is_never_stale_never_announced_and_not_a_policy_server() -> None:
    pool, servers = pool_of()
    heard: list[object] = []
    pool.health.listen(heard.append)
    # An eval server that reports no version stays down, naming the flag that fixes it
    await eval_servers(pool, servers, {E0: None})
    assert pool.health.states[E0] is ServerState.DOWN
    assert "--weight-version" in pool.health.reasons[E0]
    # At a version other than the active one it is up (an eval server keeps its version)
    servers[E0].version = 0
    await pool.health.probe(E0)
    assert pool.health.is_up(E0) and pool.health.version_of(E0) == 0
    # Its failures mark it down, even while a sync is open; the policy is not affected
    pool.gate.close("sync")
    view = pool.bind("ev:s0/a1", version=0)
    servers[E0].mode = "refuse"
    with pytest.raises(BackendUnavailable):
        await turn(view)
    assert pool.health.states[E0] is ServerState.DOWN and pool.health.any_up
    assert heard == []  # the fleet's word on rl:control is about the policy servers
    # Retired, it is tracked no more
    pool.use_eval_servers([])
    assert E0 not in pool.health.states and pool.eval_urls == ()


async def test_an_endpoint_registered_again_in_the_other_role_changes_role() -> None:
    # Given E0 serving as an eval server at version 0
    pool, servers = pool_of()
    await eval_servers(pool, servers, {E0: 0})
    # When it is registered as a policy server instead (the worker hands both lists over)
    pool.use_servers([P, E0])
    pool.use_eval_servers([])
    # Then it is tracked as a policy server, probed back at the active version
    assert E0 not in pool.health.fixed and pool.health.states[E0] is ServerState.DOWN
    servers[E0].version = 1
    await pool.health.probe(E0)
    assert pool.health.up_urls() == (P, E0) and pool.health.serving(0) == ()
    # And back as an eval server, the other way round
    pool.use_servers([P])
    pool.use_eval_servers([E0])
    assert pool.health.fixed == {E0} and pool.health.up_urls() == (P,)


@settings(max_examples=60, deadline=None)
@given(
    evals=st.dictionaries(st.sampled_from([E0, E1]), st.sampled_from([0, 1, 2, None]), max_size=2),
    active=st.sampled_from([0, 1, 2, None]),
    policy_version=st.sampled_from([0, 1, 2, None]),
    sync_open=st.booleans(),
    pinned=st.sampled_from([0, 1, 2]),
)
def test_the_servers_of_a_pinned_version_serve_that_version(
    evals: dict[str, int | None],
    active: int | None,
    policy_version: int | None,
    sync_open: bool,
    pinned: int,
) -> None:
    if active is None and policy_version is None:
        policy_version = 0  # labelled 0 at its probe (tests/backends/test_health.py)
    async def check() -> None:
        pool, servers = pool_of(active=active)
        servers[P].version = policy_version
        await pool.health.probe(P)  # up at the active version, else stale
        await eval_servers(pool, servers, evals)
        if sync_open:
            pool.gate.close("sync")
        found = pool.health.serving(pinned)
        at_version = {u for u, v in evals.items() if v == pinned}
        up = pool.health.is_up(P)
        policy_at = (active if active is not None else policy_version) if up else None
        if at_version:  # an eval server at the version wins
            assert set(found) == at_version
        elif policy_at == pinned and not sync_open:
            assert found == (P,)
        else:
            assert found == ()

    asyncio.run(check())
