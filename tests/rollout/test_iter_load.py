"""``RolloutClient.iter_load``: the samples of ``load``, in the same order, in chunks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.client import RolloutClient, SyncRolloutClient
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.projections.rollout import RolloutProjection
from engine.projections.samples import trainer_sample_chunks
from engine.runtime.archive import Archive, read_archive
from engine.runtime.rebuild import rebuild
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


async def test_chunks_let_go_of_each_samples_events(log: EventLog) -> None:
    archive = await _restore(log, "train.rollout")
    folded = await rebuild(log, archive.stream, RolloutProjection())
    state = folded.state
    n = len(state.samples)
    chunks = trainer_sample_chunks(state, 2)
    first = next(chunks)
    assert len(first) == 2 and len(state.samples) == n - 2
    rest = [s for c in chunks for s in c]
    assert len(first) + len(rest) == len(state.ready.sample_ids)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="chunk_size"):
        trainer_sample_chunks(state, 0)


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
