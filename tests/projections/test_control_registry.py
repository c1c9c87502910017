"""The model servers' registry in the control fold: ``ServerRegistered`` / ``ServerRetired``
on ``rl:control`` give ``ControlState.registered`` (endpoint -> last registration) and a
retired server leaves the health words too."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.events.base import Envelope, Event
from engine.events.catalog.servers import ServerDown, ServerRegistered, ServerRetired, ServerUp
from engine.projections.base import fold, start
from engine.projections.control import ControlProjection, ControlState

URLS = ("http://a:1", "http://b:1", "http://c:1")


def folded(events: list[Event]) -> ControlState:
    envs = [Envelope("rl:control", f"{i + 1}-0", ev) for i, ev in enumerate(events)]
    return fold(ControlProjection(), start(ControlProjection()), envs).state


def reg(url: str, role: str = "policy", version: int | None = 0) -> ServerRegistered:
    return ServerRegistered(endpoint=url, role=role, backend="tinylm", supervisor="s",
                            weight_version=version)  # fmt: skip


def test_a_retired_server_leaves_the_registry_and_the_health_words() -> None:
    # Given two registered policy servers, both said up by a worker, one down later
    state = folded([
        reg(URLS[0]), reg(URLS[1]), ServerUp(endpoint=URLS[0], worker="w"),
        ServerUp(endpoint=URLS[1], worker="w"),
        ServerDown(endpoint=URLS[0], worker="w", reason="refused"),
    ])  # fmt: skip
    assert state.registered_servers() == URLS[:2] and not state.servers_down
    # When the up one is retired
    state = ControlProjection().evolve(
        state, Envelope("rl:control", "9-0", ServerRetired(endpoint=URLS[1], supervisor="s"))
    )
    # Then only the down one is known: every policy server the log knows is down
    assert state.registered_servers() == (URLS[0],)
    assert state.servers == {URLS[0]: "down"} and state.servers_down
    assert "every policy server is down" in state.why_stopped()


def test_a_retirement_of_an_unknown_server_changes_nothing() -> None:
    before = folded([reg(URLS[0])])
    after = ControlProjection().evolve(
        before, Envelope("rl:control", "2-0", ServerRetired(endpoint=URLS[2], supervisor="s"))
    )
    assert after is before


Op = tuple[str, int, str, int]
ops = st.lists(
    st.tuples(st.sampled_from(["register", "retire", "up"]), st.integers(0, 2),
              st.sampled_from(["policy", "teacher"]), st.integers(0, 3)),  # fmt: skip
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_the_registry_is_each_endpoints_last_registration_in_first_registration_order(
    plan: list[Op],
) -> None:
    # Given any sequence of registrations, retirements and health words
    events: list[Event] = []
    model: dict[str, ServerRegistered] = {}
    words: dict[str, str] = {}
    for kind, i, role, version in plan:
        url = URLS[i]
        if kind == "register":
            ev: Event = reg(url, role, version)
            model[url] = ev  # a restart replaces it, keeping its place
        elif kind == "retire":
            ev = ServerRetired(endpoint=url, supervisor="s")
            model.pop(url, None)
            words.pop(url, None)
        else:
            ev = ServerUp(endpoint=url, worker="w")
            words[url] = "up"
        events.append(ev)
    # When they are folded
    state = folded(events)
    # Then the registry is the model's, in order, and the roles split it
    assert list(state.registered) == list(model) and dict(state.registered) == model
    assert state.registered_servers() == tuple(u for u, r in model.items() if r.role == "policy")
    assert state.registered_servers("teacher") == tuple(
        u for u, r in model.items() if r.role == "teacher"
    )
    assert dict(state.servers) == words
