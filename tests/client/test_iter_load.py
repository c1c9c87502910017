"""``RolloutClient.iter_load``: the samples of ``load``, in the same order, in chunks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.client import RolloutClient, SyncRolloutClient
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.runtime.archive import Archive, read_archive
from engine.sample import Sample
from tests.conftest import write_raw
from tests.redis_server import RedisServer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "e64f068"


async def _restore(log: EventLog, name: str) -> Archive:
    archive = read_archive(FIXTURES / name)
    for entry_id, raw in archive.entries:
        await write_raw(log, archive.stream, {FIELD: raw}, entry_id)
    return archive


@pytest.mark.parametrize("chunk_size", [1, 3, 10_000])
async def test_iter_load_yields_loads_samples_in_chunks(
    log: EventLog, chunk_size: int
) -> None:
    archive = await _restore(log, "train.rollout")
    client = RolloutClient(log)
    whole = await client.load(archive.rollout_id)
    assert len(whole) > 3
    chunks = [c async for c in client.iter_load(archive.rollout_id, chunk_size)]
    assert [len(c) for c in chunks[:-1]] == [chunk_size] * (len(chunks) - 1)
    assert 1 <= len(chunks[-1]) <= chunk_size
    assert [s for c in chunks for s in c] == whole


def test_the_sync_client_iterates_too(redis_server: RedisServer) -> None:
    async def restore() -> tuple[str, list[Sample]]:
        admin = connect(RedisSettings(url=redis_server.url))
        await admin.flushall()
        log = RedisEventLog(admin)
        try:
            archive = await _restore(log, "train.rollout")
            return archive.rollout_id, await RolloutClient(log).load(archive.rollout_id)
        finally:
            await log.aclose()

    rollout_id, whole = asyncio.run(restore())
    with SyncRolloutClient(redis_server.url) as client:
        chunks = list(client.iter_load(rollout_id, 2))
    assert len(chunks) > 1 and [s for c in chunks for s in c] == whole
