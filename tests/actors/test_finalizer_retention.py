"""Retention inside the finalizer (issue 16): given a retention store, a running finalizer
archives finished rollouts past the window and deletes them from Redis on its own, and
keeps the ones inside the window -- no ``rollout retention`` command involved."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from engine.actors.finalizer import Finalizer, FinalizerConfig, RetentionConfig
from engine.events.log import EventLog
from engine.events.redis_log import FIELD
from engine.ops.retention import ACTOR_GROUPS
from engine.runtime.archive import read_archive
from engine.runtime.retention import archive_path
from tests.conftest import write_raw

FIXTURES = Path(__file__).parents[1] / "fixtures" / "e64f068"


async def _run_until(finalizer: Finalizer, done: asyncio.Event, timeout: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(finalizer.run(stop))
    try:
        async with asyncio.timeout(timeout):
            await done.wait()
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=30)


async def test_the_finalizer_archives_and_deletes_finished_rollouts_itself(
    log: EventLog, tmp_path: Path
) -> None:
    old = read_archive(FIXTURES / "train.rollout")  # finished long ago (its ids say when)
    for entry_id, raw in old.entries:
        await write_raw(log, old.stream, {FIELD: raw}, entry_id)
    store = tmp_path / "store"
    config = FinalizerConfig(
        consumer="fin",
        heartbeat_ms=200,
        claim_idle_ms=2000,
        block_ms=100,
        retention=RetentionConfig(store=store, keep_s=3600, every_s=0.05, groups=ACTOR_GROUPS),
    )
    finalizer = Finalizer(log, config)
    done = asyncio.Event()

    async def watch() -> None:
        while await log.stream_length(old.stream):
            await asyncio.sleep(0.05)
        done.set()

    watcher = asyncio.create_task(watch())
    await _run_until(finalizer, done, timeout=60)
    watcher.cancel()
    assert finalizer.retention_passes >= 1
    assert await log.list_streams("rl:{rollout:*}") == []
    assert read_archive(archive_path(store, old.rollout_id)).entries == old.entries


async def test_a_rollout_inside_the_window_stays(log: EventLog, tmp_path: Path) -> None:
    old = read_archive(FIXTURES / "train.rollout")
    for entry_id, raw in old.entries:
        await write_raw(log, old.stream, {FIELD: raw}, entry_id)
    store = tmp_path / "store"
    window = 10 * 365 * 86400.0  # longer than the fixture's age
    config = FinalizerConfig(
        consumer="fin",
        heartbeat_ms=200,
        claim_idle_ms=2000,
        block_ms=100,
        retention=RetentionConfig(store=store, keep_s=window, every_s=0.05, groups=ACTOR_GROUPS),
    )
    finalizer = Finalizer(log, config)
    done = asyncio.Event()

    async def watch() -> None:
        while finalizer.retention_passes < 2:
            await asyncio.sleep(0.05)
        done.set()

    watcher = asyncio.create_task(watch())
    await _run_until(finalizer, done, timeout=60)
    watcher.cancel()
    assert await log.stream_length(old.stream) == len(old.entries)
    assert not archive_path(store, old.rollout_id).exists()


@pytest.mark.parametrize(("keep_s", "every_s"), [(-1.0, 1.0), (1.0, 0.0)])
def test_retention_settings_are_checked(keep_s: float, every_s: float, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="retention"):
        RetentionConfig(store=tmp_path, keep_s=keep_s, every_s=every_s, groups=ACTOR_GROUPS)


@pytest.mark.parametrize(
    ("flag", "value"), [("--retention-keep-s", "-1"), ("--retention-every-s", "0")]
)
def test_the_finalizer_command_refuses_bad_retention_flags(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers import finalizer as command

    with pytest.raises(SystemExit) as exited:
        command.main(["--redis-url", "redis://127.0.0.1:1", "--retention-store",
                      str(tmp_path), flag, value])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err
