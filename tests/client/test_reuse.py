"""Reusing stored rollouts: ``load_archive``, ``RolloutClient.reuse`` from a rollout on the log
and from an archive file, the log's record of where the data came from, and the iteration
sequence of a multi-epoch or per-iteration reuse. The stored rollouts are the archived
e64f068 rollouts (written by an older commit, upcast on read)."""

from __future__ import annotations

import asyncio
import filecmp
import hashlib
import shutil
from pathlib import Path

import pytest

from engine.client import (
    RolloutClient,
    SyncRolloutClient,
    archive_files,
    load_archive,
    reuse_source,
)
from engine.errors import ConfigError, RolloutError
from engine.events import RolloutReady, RolloutReused
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.ops.replay import (
    archive_rollout,
    decode_entries,
    read_archive,
    replay_state,
    replay_to_dir,
)
from engine.runtime.archive import Archive, write_archive
from tests.conftest import write_raw
from tests.redis_server import RedisServer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "e64f068"
TRAIN = FIXTURES / "train.rollout"


async def _restore(log: EventLog, path: Path) -> Archive:
    archive = read_archive(path)
    for entry_id, raw in archive.entries:
        await write_raw(log, archive.stream, {FIELD: raw}, entry_id)
    return archive


def _sha256(archive: Archive) -> str:
    h = hashlib.sha256()
    for _id, raw in archive.entries:
        h.update(len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


async def _replayed(log: EventLog, rollout_id: str, out: Path) -> Path:
    path = out / f"{rollout_id}.rollout"
    await archive_rollout(log, rollout_id, path)
    archive = read_archive(path)
    envelopes, _bad = decode_entries(archive.stream, archive.entries)
    replay_to_dir(replay_state(envelopes), out / rollout_id)
    return out / rollout_id


async def test_load_archive_gives_the_samples_load_gives(log: EventLog) -> None:
    archive = await _restore(log, TRAIN)
    samples = load_archive(TRAIN)
    assert len(samples) > 3 and samples == await RolloutClient(log).load(archive.rollout_id)


def test_an_archive_of_a_rollout_that_was_not_ready_is_refused(tmp_path: Path) -> None:
    source = read_archive(TRAIN)
    open_ = [(i, raw) for i, raw in source.entries if b"RolloutReady" not in raw]
    path = tmp_path / "open.rollout"
    write_archive(path, Archive(source.stream, source.rollout_id, open_))
    with pytest.raises(RolloutError, match="archived before it was ready"):
        load_archive(path)


async def test_an_archive_reused_is_ready_at_once_and_loads_as_the_archive(
    log: EventLog, tmp_path: Path
) -> None:
    client = RolloutClient(log)
    rid = await client.reuse(str(TRAIN), iteration=7)
    ready = await client.wait_ready(rid, timeout=5)
    assert ready.rollout_id == rid and ready.iteration == 7
    source = read_archive(TRAIN)
    samples = await client.load(rid)
    assert samples == load_archive(TRAIN) and len(samples) > 3
    # The stream says where the data came from, first.
    head = (await log.read(log.names.rollout(rid), count=1))[0].event
    assert isinstance(head, RolloutReused)
    assert (head.source, head.source_kind, head.source_rollout_id) == (
        str(TRAIN), "archive", source.rollout_id,
    )
    assert head.source_sha256 == _sha256(source) and head.iteration == 7
    # Nothing asks for generation: no request reaches rl:control.
    control = [e.event.type for e in await log.read(log.names.control)]
    assert control == ["RolloutReady"]


async def test_a_rollout_on_the_log_reused_replays_byte_identically(
    log: EventLog, tmp_path: Path
) -> None:
    source = await _restore(log, TRAIN)
    client = RolloutClient(log)
    rid = await client.reuse(source.rollout_id, iteration=1, rollout_id="again")
    assert rid == "again"
    assert await client.load(rid) == await client.load(source.rollout_id)
    head = (await log.read(log.names.rollout(rid), count=1))[0].event
    assert isinstance(head, RolloutReused) and head.source_kind == "rollout"
    mine = await _replayed(log, rid, tmp_path)
    theirs = await _replayed(log, source.rollout_id, tmp_path)
    names = sorted(p.name for p in theirs.iterdir())
    assert names and sorted(p.name for p in mine.iterdir()) == names
    match, mismatch, errors = filecmp.cmpfiles(theirs, mine, names, shallow=False)
    assert (mismatch, errors) == ([], []), f"replay of the reuse differs in {mismatch + errors}"


async def test_reusing_again_under_the_same_id_finishes_once_and_another_source_is_refused(
    log: EventLog, tmp_path: Path
) -> None:
    client = RolloutClient(log)
    await client.reuse(str(TRAIN), iteration=0, rollout_id="r0")
    await client.reuse(str(TRAIN), iteration=0, rollout_id="r0")  # a retry after a crash
    readies = [e for e in await log.read(log.names.control) if isinstance(e.event, RolloutReady)]
    assert len(readies) == 1
    other = tmp_path / "eval.rollout"
    shutil.copy(FIXTURES / "eval.rollout", other)
    with pytest.raises(ConfigError, match="r0 exists already"):
        await client.reuse(str(other), iteration=0, rollout_id="r0")


async def test_a_source_that_is_missing_or_not_ready_is_refused_naming_it(
    log: EventLog, tmp_path: Path
) -> None:
    client = RolloutClient(log)
    with pytest.raises(RolloutError, match="'nope' is neither an archive file nor a rollout"):
        await client.reuse("nope", iteration=0)
    with pytest.raises(ConfigError, match="neither an archive file nor a rollout id"):
        await client.reuse(str(tmp_path / "missing.rollout"), iteration=0)
    source = read_archive(TRAIN)
    unready = [(i, raw) for i, raw in source.entries if b"RolloutReady" not in raw]
    for entry_id, raw in unready:
        await write_raw(log, log.names.rollout("open"), {FIELD: raw}, entry_id)
    with pytest.raises(RolloutError, match="open is not ready"):
        await client.reuse("open", iteration=0)
    assert await log.stream_length(log.names.control) == 0  # nothing half-written


def test_iterations_reuse_their_stored_rollouts_in_order_or_the_first_every_time(
    tmp_path: Path,
) -> None:
    for name in ("iter_002.rollout", "iter_000.rollout", "iter_001.rollout", ".partial"):
        (tmp_path / name).write_bytes(b"")
    files = [str(p) for p in archive_files(tmp_path)]
    assert [Path(f).name for f in files] == [f"iter_00{i}.rollout" for i in range(3)]
    assert [reuse_source(files, i) for i in range(3)] == files
    assert {reuse_source(files, i, repeat_first=True) for i in range(5)} == {files[0]}
    with pytest.raises(ConfigError, match="iteration 3 has no stored rollout \\(there are 3"):
        reuse_source(files, 3)
    with pytest.raises(ConfigError, match="is not a directory"):
        archive_files(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no archive file"):
        archive_files(tmp_path / "empty")


def test_the_sync_client_reuses_on_a_real_redis(redis_server: RedisServer) -> None:
    async def flush() -> None:
        admin = connect(RedisSettings(url=redis_server.url))
        await admin.flushall()
        await RedisEventLog(admin).aclose()

    asyncio.run(flush())
    with SyncRolloutClient(redis_server.url) as client:
        rid = client.reuse(str(TRAIN), iteration=2)
        assert client.wait_ready(rid, timeout=5).iteration == 2
        assert client.load(rid) == load_archive(TRAIN)
