"""Retention: acked shared streams are trimmed, finished rollouts are archived to a file store
and deleted from Redis (the archive replays byte-identically), ``rl:data`` is trimmed below
its snapshot, ``rl:dead`` and its seen-set are bounded, and the finalizer does it all by
default."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.actors.evaluator_worker import GROUP as EVALUATOR_GROUP
from engine.actors.finalizer import GROUP as FINALIZER_GROUP
from engine.actors.scheduler import SCHEDULER_GROUP
from engine.events import BatchAdmitted, DataCursorAdvanced, RolloutFailed, TailCarried
from engine.events.ids import id_ms
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog, RedisSettings, connect
from engine.ops import cli
from engine.ops.replay import (
    RawEntry,
    decode_entries,
    read_archive,
    replay_state,
    replay_to_dir,
)
from engine.ops.retention import archive_path, retention_pass
from engine.projections.data_cursor import DataCursorProjection
from engine.runtime.follower import Follower
from engine.runtime.rebuild import rebuild
from engine.settings import Settings
from tests.conftest import write_raw
from tests.redis_server import RedisServer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "e64f068"
ARTIFACTS = ["summary.json", "samples.jsonl", "eval_details.jsonl", "placement.jsonl"]


async def _restore(log: EventLog, stream: str, entries: list[RawEntry]) -> None:
    """Put archived entries back into the log under their own ids, as the live run wrote
    them."""
    for entry_id, raw in entries:
        await write_raw(log, stream, {FIELD: raw}, entry_id)


def _after(entries: list[RawEntry], seconds: float) -> float:
    """A wall-clock time ``seconds`` after the last entry."""
    return id_ms(entries[-1][0]) / 1000 + seconds


async def test_a_finished_rollout_is_archived_deleted_and_replays_byte_identically(
    log: EventLog, tmp_path: Path
) -> None:
    archive = read_archive(FIXTURES / "train.rollout")
    await _restore(log, archive.stream, archive.entries)
    store = tmp_path / "store"

    # Inside the retention window: kept in Redis, nothing written.
    report = await retention_pass(log, store, keep_s=60, now_s=_after(archive.entries, 30))
    assert report.kept == [archive.rollout_id] and report.archived == []
    assert await log.stream_length(archive.stream) == len(archive.entries)
    assert not archive_path(store, archive.rollout_id).exists()

    # Past it: archived, verified, deleted.
    report = await retention_pass(log, store, keep_s=60, now_s=_after(archive.entries, 61))
    assert report.archived == [archive.rollout_id] and report.conflicts == []
    assert await log.list_streams("rl:{rollout:*}") == []
    stored = read_archive(archive_path(store, archive.rollout_id))
    assert (stored.stream, stored.rollout_id) == (archive.stream, archive.rollout_id)
    assert stored.entries == archive.entries

    # What ``rollout replay ID --from FILE`` does (the command itself runs its own loop).
    envelopes, _bad = decode_entries(stored.stream, stored.entries)
    out = tmp_path / "replay"
    replay_to_dir(replay_state(envelopes), out)
    for artifact in ARTIFACTS:
        expected = (FIXTURES / "train" / artifact).read_bytes()
        assert (out / artifact).read_bytes() == expected, f"{artifact} differs"


async def test_an_unfinished_rollout_stays_and_a_late_write_is_not_deleted(
    log: EventLog, tmp_path: Path
) -> None:
    archive = read_archive(FIXTURES / "train.rollout")
    unfinished = archive.entries[: len(archive.entries) // 2]
    await _restore(log, archive.stream, unfinished)
    later = time.time() + 1  # past the fixture and anything appended during the test
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.archived == [] and report.kept == []
    assert await log.stream_length(archive.stream) == len(unfinished)

    # Finished and archived once; then a late writer recreates the stream with one entry:
    # the archive on file differs from the stream, so it is reported and left alone.
    await _restore(log, archive.stream, archive.entries[len(unfinished) :])
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.archived == [archive.rollout_id]
    await _restore(log, archive.stream, archive.entries)
    await log.append(archive.stream, RolloutFailed(rollout_id=archive.rollout_id, reason="x"))
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.conflicts == [archive.rollout_id]
    assert await log.stream_length(archive.stream) == len(archive.entries) + 1
    assert read_archive(archive_path(tmp_path, archive.rollout_id)).entries == archive.entries


async def test_shared_streams_are_trimmed_only_below_every_groups_ack_and_the_window(
    log: EventLog, tmp_path: Path
) -> None:
    control = log.names.control
    work = log.names.work("math")
    a, b = SCHEDULER_GROUP, FINALIZER_GROUP
    await log.ensure_group(control, a)
    await log.ensure_group(work, EVALUATOR_GROUP)
    ids = await log.append_many(
        [(control, RolloutFailed(rollout_id=f"r{i}", reason="")) for i in range(6)]
        + [(work, RolloutFailed(rollout_id=f"w{i}", reason="")) for i in range(4)]
    )
    control_ids, work_ids = ids[:6], ids[6:]
    got = await log.read_group(a, "c", [control], count=10, block_ms=50)
    got += await log.read_group(EVALUATOR_GROUP, "c", [work], count=10, block_ms=50)
    await log.ack(control, a, *control_ids)
    await log.ack(work, EVALUATOR_GROUP, *[e.id for e in got if e.stream == work])
    last = max(id_ms(i) for i in ids) / 1000
    # The finalizers' group does not exist yet: it will read control from 0, so control
    # is not trimmed even though the only group there acked everything.
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=last + 1)
    assert report.trimmed[control] == 0 and report.trimmed[work] == 4
    assert len(await log.read(control)) == 6

    # Group b has read 4 and acked 3 (its 3rd still pending).
    await log.ensure_group(control, b)
    got_b = await log.read_group(b, "c", [control], count=4, block_ms=50)
    await log.ack(control, b, got_b[0].id, got_b[1].id, got_b[3].id)
    # A window that covers everything trims nothing.
    report = await retention_pass(log, tmp_path, keep_s=3600, now_s=last)
    assert sum(report.trimmed.values()) == 0
    # Past the window: control keeps b's pending entry and everything after it.
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=last + 1)
    assert [e.id for e in await log.read(control)] == control_ids[2:]
    assert report.trimmed[control] == 2
    assert await log.read(work) == [] and len(work_ids) == 4


async def test_memory_usage_and_delete_stream(log: EventLog) -> None:
    await log.append("rl:x", RolloutFailed(rollout_id="r", reason=""))
    assert await log.delete_stream("rl:x") is True
    assert await log.delete_stream("rl:x") is False


async def test_memory_usage_counts_a_streams_bytes(redis_server: RedisServer) -> None:
    client = connect(RedisSettings(url=redis_server.url))
    await client.flushall()
    log = RedisEventLog(client)
    try:
        assert await log.memory_usage("rl:none") == 0
        await log.append("rl:m", RolloutFailed(rollout_id="r", reason="y" * 1000))
        assert await log.memory_usage("rl:m") > 1000
    finally:
        await log.aclose()


def test_the_retention_command_runs_one_pass(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["retention", "--redis-url", redis_server.url, "--store", str(tmp_path)]) == 0
    assert "archived and deleted 0 rollouts" in capsys.readouterr().out
    assert cli.main(["retention", "--redis-url", redis_server.url, "--store", str(tmp_path),
                     "--keep-s", "-1"]) == 2
    assert "--keep-s must be at least 0.0, got -1.0 (ROLLOUT_RETENTION_KEEP_S)" in (
        capsys.readouterr().err
    )
    assert cli.main(["retention", "--redis-url", redis_server.url]) == 2
    assert "needs --store DIR (or ROLLOUT_RETENTION_STORE)" in capsys.readouterr().err


def test_the_retention_command_reads_its_defaults_from_the_environment(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_RETENTION_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("ROLLOUT_RETENTION_KEEP_S", "120")
    args = cli.build_parser(Settings.from_env()).parse_args(["retention"])
    assert (args.retention_store, args.retention_keep_s) == (tmp_path / "store", 120.0)
    assert cli.main(["retention", "--redis-url", redis_server.url]) == 0
    assert (tmp_path / "store").is_dir()




async def test_a_finished_rollout_waits_while_unacked_work_names_it(
    log: EventLog, tmp_path: Path
) -> None:
    archive = read_archive(FIXTURES / "train.rollout")
    await _restore(log, archive.stream, archive.entries)
    work = log.names.work("math")
    await log.ensure_group(work, EVALUATOR_GROUP)
    queued = await log.append(
        work,
        BatchAdmitted(rollout_id=archive.rollout_id, batch_id="b9", evaluator_id="math",
                      sample_ids=[]),
    )
    later = time.time() + 1  # past the fixture's end and the work entry appended now
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.waiting == [archive.rollout_id] and report.archived == []
    assert await log.stream_length(archive.stream) == len(archive.entries)

    (delivered,) = await log.read_group(EVALUATOR_GROUP, "w", [work], count=1, block_ms=50)
    assert delivered.id == queued
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.waiting == [archive.rollout_id]  # delivered but pending: still waits
    await log.ack(work, EVALUATOR_GROUP, queued)
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=later)
    assert report.archived == [archive.rollout_id] and report.trimmed[work] == 1
    assert await log.list_streams("rl:{rollout:*}") == []


def _cursor(offset: int) -> dict[str, object]:
    return {"seed": 0, "datasets": ["ds"], "offset": offset}


@pytest.mark.parametrize("log_backend", ["memory", "redis-server"])
async def test_rl_data_is_trimmed_below_its_snapshot_and_a_resumed_scheduler_folds_the_same(
    log: EventLog, tmp_path: Path
) -> None:
    data = log.names.data
    tail = TailCarried(rollout_id="r1", request_stream="train", tasks=[])
    first = [
        (data, DataCursorAdvanced(rollout_id="r0", cursor=_cursor(4))),
        (data, DataCursorAdvanced(rollout_id="r1", cursor=_cursor(8))),
        (data, tail),
        (data, DataCursorAdvanced(rollout_id="r2", cursor=_cursor(12), carried=["r1"])),
        (data, TailCarried(rollout_id="r2", request_stream="train", tasks=[])),
    ]
    await log.append_many(first)
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=time.time() + 1)
    assert report.trimmed[data] == 0  # the first snapshot: nothing below a previous one
    await log.append(data, DataCursorAdvanced(rollout_id="r3", cursor=_cursor(16)))
    whole = (await rebuild(log, data, DataCursorProjection())).state
    # The next pass trims every entry below the first pass's snapshot.
    report = await retention_pass(log, tmp_path, keep_s=0, now_s=time.time() + 1)
    assert report.trimmed[data] == len(first)
    assert [e.event.rollout_id for e in await log.read_all(data)] == ["r3"]  # type: ignore[attr-defined]
    # A scheduler starting now folds the snapshot and the tail into the same state.
    resumed = Follower(log, data, DataCursorProjection(), owner=True)
    await resumed.refresh()
    assert resumed.state.cursors == whole.cursors
    assert resumed.state.rollouts == whole.rollouts
    assert resumed.state.carried_for("train") == whole.carried_for("train")
    assert [t.rollout_id for t in resumed.state.carried_for("train")] == ["r2"]


@pytest.mark.parametrize("log_backend", ["memory", "redis-server"])
async def test_dead_letters_are_trimmed_and_their_marks_go_once_their_entries_are_gone(
    log: EventLog, tmp_path: Path
) -> None:
    # Given three undecodable entries of one rollout stream and one of another, each
    # dead-lettered once by the stream's owner,
    gone, kept = "rl:{rollout:gone}", "rl:{rollout:kept}"
    ids = [await write_raw(log, gone, {FIELD: b"\xc1garbage"}) for _ in range(3)]
    kept_id = await write_raw(log, kept, {FIELD: b"\xc1garbage"})
    await log.read_all(gone, dead_letter=True)
    await log.read_all(kept, dead_letter=True)
    marks = {f"{gone}@{i}" for i in ids} | {f"{kept}@{kept_id}"}
    assert await log.dead_marks() == marks and await log.stream_length(log.names.dead) == 4
    # when the first stream is deleted and a pass keeps two letters,
    assert await log.delete_stream(gone)
    report = await retention_pass(log, tmp_path, keep_s=3600, dead_max=2)
    # then the two oldest letters are trimmed; the marks of trimmed letters whose entries
    # are gone go, the kept letters keep theirs, and the entry still in its stream too.
    assert report.trimmed[log.names.dead] == 2
    letters = [e.event for e in await log.read_all(log.names.dead)]
    assert [(d.source_stream, d.source_id) for d in letters] == [  # type: ignore[attr-defined]
        (gone, ids[2]), (kept, kept_id)
    ]
    assert await log.dead_marks() == {f"{gone}@{ids[2]}", f"{kept}@{kept_id}"}
    # A second pass with room for none: the last letters go, and only the mark of the entry
    # still in its stream stays (a reread of it writes no second letter).
    await retention_pass(log, tmp_path, keep_s=3600, dead_max=0)
    assert await log.stream_length(log.names.dead) == 0
    assert await log.dead_marks() == {f"{kept}@{kept_id}"}
    await log.read_all(kept, dead_letter=True)
    assert await log.stream_length(log.names.dead) == 0


def test_the_finalizer_process_runs_retention_by_default_under_its_work_dir() -> None:
    from workers.finalizer import _config

    config = _config(Settings(), "fin")
    assert config.retention is not None
    assert config.retention.store == Path("runs") / "archive"
    assert (config.retention.keep_s, config.retention.every_s) == (3600.0, 60.0)
    assert config.retention.dead_max == 10_000
    assert config.stall_window_s == 300.0
    moved = _config(Settings(work_dir=Path("/srv/rl")), "fin")
    assert moved.retention is not None and moved.retention.store == Path("/srv/rl/archive")
    off = _config(Settings(retention=False, stall_window_s=0), "fin")
    assert off.retention is None and off.stall_window_s is None
