"""``Follower``: a projection kept live from one stream, on every implementation of the log.

Waiters wake on appends and miss no change; an outage is ridden out with the runtime's
backoff and the fold resumes where it was; past the outage limit ``OutageExceeded``; only
the stream's owner dead-letters what does not decode, once; a stop never cancels a read."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LogUnavailable, OutageExceeded
from engine.events import DeadLetter, Envelope, EventLog, PolicyVersionPublished
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.projections.control import ControlProjection, ControlState
from engine.runtime.consumer import Backoff
from engine.runtime.follower import Follower, FollowerClosed, following
from tests.conftest import write_raw
from tests.faults.harness import RestartableRedis

S = "rl:test:follow"
_WAIT_S = 10.0  # a bound on waits that must end, never a timing claim


class Ids:
    """The entry ids folded, in order: a fold that skipped or repeated one shows it."""

    def initial(self) -> tuple[str, ...]:
        return ()

    def evolve(self, state: tuple[str, ...], env: Envelope) -> tuple[str, ...]:
        return (*state, env.id)


class Flaky:
    """The log, except that reads past a position fail as an outage while ``down``."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.down = False
        self.failed = 0

    async def read_after(self, *args: Any, **kwargs: Any) -> tuple[list[Envelope], str]:
        if self.down:
            self.failed += 1
            raise LogUnavailable("redis at 127.0.0.1:1 is unreachable (test)")
        return await self._log.read_after(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


def publish(version: int) -> PolicyVersionPublished:
    return PolicyVersionPublished(version=version, weights_uri=f"/w/v{version}")


async def test_a_waiter_wakes_on_an_append(log: EventLog) -> None:
    control = Follower(log, S, ControlProjection())
    async with following(asyncio.Event(), control):
        waiter = asyncio.create_task(control.wait_for(lambda s: s.published == 1))
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing appended yet
        await log.append(S, publish(1))
        state = await asyncio.wait_for(waiter, _WAIT_S)
    assert state.published == 1 and control.closed


async def test_a_waiter_that_reads_itself_wakes_on_an_append(log: EventLog) -> None:
    """No ``run``: the waiter's own blocking reads fold the stream."""
    control = Follower(log, S, ControlProjection())
    await log.append(S, publish(1))
    waiter = asyncio.create_task(control.wait_for(lambda s: s.published == 2, _WAIT_S))
    await asyncio.sleep(0)
    await log.append(S, publish(2))
    state = await waiter
    assert state.published == 2 and state.published_versions == {1, 2}
    with pytest.raises(TimeoutError, match="version 3 not seen after 0.05 s"):
        await control.wait_for(lambda s: s.published == 3, 0.05, what="version 3 not seen")


async def test_a_waiter_misses_no_change(log: EventLog) -> None:
    """A change folded after the waiter looked at the state, but before it waits, still
    ends its wait at once."""
    control = Follower(log, S, ControlProjection())
    async with following(asyncio.Event(), control):
        seen = control.version
        assert control.state.published is None  # what the waiter decided on
        await log.append(S, publish(1))
        await control.wait_for(lambda s: s.published == 1)  # folded meanwhile
        await asyncio.wait_for(control.changed(seen), _WAIT_S)  # returns at once
        closed = asyncio.create_task(control.changed(control.version))
        await asyncio.sleep(0)
        control.close()
        with pytest.raises(FollowerClosed):
            await asyncio.wait_for(closed, _WAIT_S)


async def test_an_outage_backs_off_and_the_fold_resumes_where_it_was(log: EventLog) -> None:
    flaky = Flaky(log)
    ids = Follower(flaky, S, Ids(), backoff=Backoff(first_s=0.01, max_s=0.02))
    first = await log.append(S, publish(1))
    async with following(asyncio.Event(), ids):
        await asyncio.wait_for(ids.wait_for(lambda s: s == (first,)), _WAIT_S)
        flaky.down = True
        while flaky.failed < 3:  # the follower keeps trying through the outage
            await asyncio.sleep(0.01)
        second = await log.append(S, publish(2))
        assert ids.state == (first,) and ids.backoff.failing
        flaky.down = False
        state = await asyncio.wait_for(ids.wait_for(lambda s: len(s) > 1), _WAIT_S)
    assert state == (first, second)  # nothing skipped, nothing folded twice


async def test_past_the_outage_limit_a_follower_raises_outage_exceeded(log: EventLog) -> None:
    flaky = Flaky(log)
    flaky.down = True
    control = Follower(
        flaky, S, ControlProjection(),
        backoff=Backoff(first_s=0.01, max_s=0.02, limit_s=0.1),
    )
    stop = asyncio.Event()
    with pytest.raises(OutageExceeded, match="outage limit of 0.1 s"):
        async with following(stop, control) as halt:
            await asyncio.wait_for(halt.wait(), _WAIT_S)  # the follower ended: halt
    assert not stop.is_set()


async def test_the_owner_dead_letters_an_undecodable_entry_once(log: EventLog) -> None:
    bad = await write_raw(log, S, {FIELD: b"\x01not an event"})
    reader = Follower(log, S, Ids())
    await reader.refresh()
    await reader.read(block=False)
    assert await log.read(log.names.dead) == []  # a reader that does not own it skips it
    owner = Follower(log, S, Ids(), owner=True)
    await owner.read(block=False)
    assert owner.position == bad  # past the entry, so a compare-and-append at it succeeds
    (good,) = await log.append_if_last(S, publish(1), owner.position)
    again = Follower(log, S, Ids(), owner=True)
    await again.refresh()
    assert again.state == (good,)
    (letter,) = await log.read(log.names.dead)
    assert isinstance(letter.event, DeadLetter) and letter.event.source_id == bad


async def test_close_ends_run_after_its_read_without_cancelling_it(log: EventLog) -> None:
    control = Follower(log, S, ControlProjection(), block_ms=50)
    run = asyncio.create_task(control.run())
    await asyncio.sleep(0.01)  # in a blocking read: nothing to fold
    control.close()
    await asyncio.wait_for(run, _WAIT_S)
    assert not run.cancelled() and run.exception() is None


async def test_a_fold_stops_at_the_entry_until_names(log: EventLog) -> None:
    ids = [await log.append(S, publish(v)) for v in (1, 2, 3)]
    control: Follower[ControlState] = Follower(
        log, S, ControlProjection(), until=lambda s: s.published == 2
    )
    await control.refresh()
    assert control.done and control.position == ids[1] and control.state.published == 2
    assert await control.read() == []  # done: nothing more is folded


@pytest.fixture
async def restartable(tmp_path: Path) -> AsyncIterator[tuple[RestartableRedis, RedisEventLog]]:
    """A redis-server a test may stop and start again in place (AOF), and a log on it."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    server = RestartableRedis(tmp_path)
    server.start()
    log = RedisEventLog(connect(RedisSettings(url=server.url, block_ms=100)), block_ms=100)
    try:
        yield server, log
    finally:
        await log.aclose()
        server.stop()


async def test_a_follower_rides_out_a_redis_restart(
    restartable: tuple[RestartableRedis, RedisEventLog],
) -> None:
    """A real outage: redis-server stopped and started again in place; the follower
    resumes at its position."""
    server, log = restartable
    ids = Follower(log, S, Ids(), backoff=Backoff(first_s=0.05, max_s=0.2))
    first = await log.append(S, publish(1))
    async with following(asyncio.Event(), ids):
        await asyncio.wait_for(ids.wait_for(lambda s: s == (first,)), _WAIT_S)
        await asyncio.to_thread(server.stop)
        while not ids.backoff.failing:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(server.start)
        second = await log.append(S, publish(2))
        state = await asyncio.wait_for(ids.wait_for(lambda s: len(s) > 1), 30)
    assert state == (first, second)


async def test_a_follower_gives_up_on_a_redis_server_gone_past_the_limit(
    restartable: tuple[RestartableRedis, RedisEventLog],
) -> None:
    """redis-server stopped and not started again: the follower backs off, then raises
    ``OutageExceeded`` once the outage is longer than its limit, and a waiter on it does not
    wait on: it hears that the follower is closed, or reads itself and gives up too."""
    server, log = restartable
    control = Follower(
        log, S, ControlProjection(), backoff=Backoff(first_s=0.05, max_s=0.1, limit_s=0.5)
    )
    await log.append(S, publish(1))
    with pytest.raises(OutageExceeded, match="outage limit of 0.5 s"):
        async with following(asyncio.Event(), control) as halt:
            await asyncio.wait_for(control.wait_for(lambda s: s.published == 1), _WAIT_S)
            waiter = asyncio.create_task(control.wait_for(lambda s: s.published == 2))
            await asyncio.to_thread(server.stop)
            await asyncio.wait_for(halt.wait(), 30)  # the follower ended: halt
    with pytest.raises((FollowerClosed, OutageExceeded)):
        await asyncio.wait_for(waiter, _WAIT_S)
    assert control.state.published == 1
