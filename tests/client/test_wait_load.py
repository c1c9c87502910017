"""``RolloutClient.wait_load``: ``wait_ready`` then ``load``, with the stream folded while it
is written. The rollouts are the archived e64f068 rollouts, appended entry by entry."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from engine.client import RolloutClient, SyncRolloutClient
from engine.errors import RolloutError, RolloutFailed
from engine.events.catalog import RolloutFailed as RolloutFailedEvent
from engine.events.catalog import RolloutReady
from engine.events.codec import decode
from engine.events.log import EventLog, RawStreamEntry
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.runtime.archive import Archive, read_archive
from engine.sample import Sample
from tests.client.test_iter_load import FIXTURES
from tests.conftest import write_raw
from tests.faults.harness import RestartableRedis
from tests.redis_server import RedisServer

_DEADLINE_S = 30.0


class _Watched:
    """The log, with the entry ids every ``tail_raw`` returned recorded (the follower's
    reads), so a test can wait until the follower has folded an entry."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.tailed: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    async def tail_raw(self, *args: Any, **kwargs: Any) -> list[RawStreamEntry]:
        rows: list[RawStreamEntry] = await self._log.tail_raw(*args, **kwargs)
        self.tailed.extend(entry_id for _stream, entry_id, _raw in rows)
        return rows


async def _until(done: Any) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _DEADLINE_S
    while not done():
        assert loop.time() < deadline, "the follower never read the entry"
        await asyncio.sleep(0.01)


def _ready_at(archive: Archive) -> int:
    for at, (_entry_id, raw) in enumerate(archive.entries):
        if decode(raw).type == "RolloutReady":
            return at
    raise AssertionError("the archive has no RolloutReady")


async def _append(
    log: EventLog, stream: str, entries: Sequence[tuple[str, bytes]]
) -> list[str]:
    """Append the entries' events under new ids; returns the ids."""
    ids = []
    for _entry_id, raw in entries:
        ids.append(await write_raw(log, stream, {FIELD: raw}))
        await asyncio.sleep(0)  # the follower may read between two appends
    return ids


def _following() -> list[asyncio.Task[Any]]:
    """This loop's unfinished tasks following a rollout stream for ``wait_load``."""
    return [
        t for t in asyncio.all_tasks()
        if not t.done() and t.get_name().startswith("follow rl:{rollout:")
    ]


@pytest.mark.parametrize("name", ["train.rollout", "eval.rollout"])
async def test_the_stream_is_folded_while_written(log: EventLog, name: str) -> None:
    """The result is what wait_ready and load give; and the entries up to the ready event
    were folded while they were appended: once the follower has read them they are trimmed
    from Redis, and the samples still come back whole."""
    archive = read_archive(FIXTURES / name)
    stream, rid = archive.stream, archive.rollout_id
    at = _ready_at(archive)
    ready = decode(archive.entries[at][1])
    assert isinstance(ready, RolloutReady)

    # What load gives on the whole stream; then the stream is written again, from empty.
    await _append(log, stream, archive.entries)
    expected = await RolloutClient(log).load(rid)
    await log.delete_stream(stream)

    watched = _Watched(log)
    client = RolloutClient(watched)  # type: ignore[arg-type]
    waiting = asyncio.create_task(client.wait_load(rid, timeout=_DEADLINE_S))
    half = at // 2
    await _append(log, stream, archive.entries[:half])
    await write_raw(log, stream, {FIELD: b"\x01not an event"})  # skipped, as load skips it
    ready_id = (await _append(log, stream, archive.entries[half : at + 1]))[-1]
    await _until(lambda: ready_id in watched.tailed)
    assert not waiting.done()  # the control plane has no ready event yet
    # Entries after the ready event (an aborted tail) are read after the wait ends.
    await _append(log, stream, archive.entries[at + 1 :])
    await log.trim_before(stream, ready_id)  # what the follower read is gone
    await log.append(log.names.control, ready)
    got_ready, samples = await waiting
    assert got_ready == ready
    assert samples == expected and len(samples) >= 1


async def test_a_failed_rollout_raises_and_stops_the_follower(log: EventLog) -> None:
    client = RolloutClient(log)
    waiting = asyncio.create_task(client.wait_load("r-failed", timeout=_DEADLINE_S))
    await _until(_following)
    await log.append(log.names.control, RolloutFailedEvent(rollout_id="r-failed", reason="x"))
    with pytest.raises(RolloutFailed, match="x"):
        await waiting
    assert _following() == []


async def test_it_times_out_as_wait_ready_does(log: EventLog) -> None:
    client = RolloutClient(log)
    with pytest.raises(TimeoutError, match="r-late not ready"):
        await client.wait_load("r-late", timeout=0.2)
    assert _following() == []


async def test_a_ready_rollout_without_its_stream_fails_as_load_does(log: EventLog) -> None:
    """The control plane has the ready event, the rollout stream is gone (archived and
    deleted): the follower stops, and the error is load's."""
    ready = RolloutReady(rollout_id="r-gone", sample_ids=["s0"])
    await log.append(log.names.control, ready)
    client = RolloutClient(log)
    with pytest.raises(RolloutError) as from_load:
        await client.load("r-gone")
    with pytest.raises(RolloutError) as from_wait:
        await client.wait_load("r-gone", timeout=_DEADLINE_S)
    assert str(from_wait.value) == str(from_load.value)


def test_the_sync_client_waits_and_loads(redis_server: RedisServer) -> None:
    async def restore() -> tuple[str, list[Sample]]:
        admin = connect(RedisSettings(url=redis_server.url))
        await admin.flushall()
        log = RedisEventLog(admin)
        try:
            archive = read_archive(FIXTURES / "train.rollout")
            await _append(log, archive.stream, archive.entries)
            ready = decode(archive.entries[_ready_at(archive)][1])
            await log.append(log.names.control, ready)
            return archive.rollout_id, await RolloutClient(log).load(archive.rollout_id)
        finally:
            await log.aclose()

    rollout_id, whole = asyncio.run(restore())
    with SyncRolloutClient(redis_server.url) as client:
        ready, samples = client.wait_load(rollout_id, timeout=_DEADLINE_S)
    assert ready.rollout_id == rollout_id and samples == whole


async def test_it_waits_and_follows_through_a_redis_restart(tmp_path: Path) -> None:
    """Redis goes away while the rollout is half written: the wait goes on, the follower
    pauses, and once Redis is back both pick up where they were; the samples are load's."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    archive = read_archive(FIXTURES / "train.rollout")
    at = _ready_at(archive)
    ready = decode(archive.entries[at][1])
    server = RestartableRedis(tmp_path)
    server.start()
    client = RolloutClient.connect(server.url, block_ms=100)
    writer = RolloutClient.connect(server.url, block_ms=100)
    log = writer.log
    assert isinstance(log, RedisEventLog)
    try:
        waiting = asyncio.create_task(client.wait_load(archive.rollout_id, timeout=60))
        await _append(log, archive.stream, archive.entries[: at // 2])
        await _until(_following)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(1.0)
        assert not waiting.done()  # the outage ends neither the wait nor the follower
        await asyncio.to_thread(server.start)
        await _append(log, archive.stream, archive.entries[at // 2 :])
        await log.append(log.names.control, ready)
        got_ready, samples = await asyncio.wait_for(waiting, 30)
        assert got_ready == ready
        assert samples == await writer.load(archive.rollout_id) and samples
    finally:
        await client.aclose()
        await writer.aclose()
        server.stop()
