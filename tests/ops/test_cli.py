"""The rollout CLI on a real redis-server: replay identity, archive, status, tail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.events import EventLog, RolloutKind
from engine.events.redis_log import RedisEventLog
from engine.ops import cli
from engine.projections.summary import ARTIFACT_FILES
from tests.redis_server import RedisServer
from tests.rig import Engine, start_rollout

real_redis = pytest.mark.parametrize("log_backend", ["redis-server"])


async def _rollout_live(engine: Engine, log: EventLog, rid: str, out: Path) -> None:
    engine.start_worker()
    follow = asyncio.create_task(engine.finalizer(out_dir=out).follow(rid))
    scripts = {1: {"fail": {"phase": "run", "error": "sandbox"}}, 2: {"turns": 3, "reward": 0.25}}
    await start_rollout(
        log, rid, n_prompts=3, per_prompt=2, kind=RolloutKind.EVAL,
        script=lambda i: scripts.get(i, {}),
    )
    await asyncio.wait_for(follow, 30)


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


@real_redis
async def test_replay_is_byte_identical_from_the_log_and_from_an_archive(
    engine: Engine, log: RedisEventLog, redis_server: RedisServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = redis_server.url
    await _rollout_live(engine, log, "rr", tmp_path / "live")
    live = {name: (tmp_path / "live" / "rr" / name).read_bytes() for name in ARTIFACT_FILES}

    assert await _cli("replay", "rr", "--out", str(tmp_path / "replay"), "--redis-url", url) == 0
    for name in ARTIFACT_FILES:
        assert (tmp_path / "replay" / name).read_bytes() == live[name], name

    archive = tmp_path / "rr.archive"
    assert await _cli("archive", "rr", "--out", str(archive), "--redis-url", url) == 0
    await log.redis.delete(log.names.rollout("rr"))  # the log is gone; the archive remains
    out = tmp_path / "from-file"
    assert await _cli("replay", "rr", "--from", str(archive), "--out", str(out)) == 0
    for name in ARTIFACT_FILES:
        assert (out / name).read_bytes() == live[name], name
    printed = capsys.readouterr().out
    assert "archived" in printed and "replayed" in printed


async def test_replay_refuses_a_wrong_or_broken_archive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    broken.write_bytes(b"\x92not an archive")
    assert await _cli("replay", "x", "--from", str(broken)) == 1
    assert "not a rollout archive" in capsys.readouterr().err


@real_redis
async def test_status_and_tail(
    engine: Engine, log: EventLog, redis_server: RedisServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = redis_server.url
    await _rollout_live(engine, log, "rs", tmp_path)
    capsys.readouterr()
    assert await _cli("status", "rs", "--redis-url", url) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rollout rs: READY: 6 kept, 0 dropped"
    assert "planned 6" in lines[1] and "completed 5, aborted 1" in lines[1]
    assert len(lines) == 2 + 2  # two batches of four and two
    assert await _cli(
        "tail", "--rollout", "rs", "--from-start", "--count", "3", "--redis-url", url
    ) == 0
    tail = capsys.readouterr().out.splitlines()
    assert len(tail) == 3
    assert all("rollout=rs" in line for line in tail)
    assert any("RolloutRequested" in line for line in tail)
    assert await _cli("status", "missing", "--redis-url", url) == 1


@real_redis
async def test_pool_time_travel(
    log: EventLog, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.events import NodeDecl, PoolDeclared, TokenAcquired, TokenGrant, TokenReleased

    pool = log.names.pool
    declared = await log.append(pool, PoolDeclared(nodes=[NodeDecl(node="n0", cpu=8)]))
    acquired = await log.append(pool, TokenAcquired(
        rollout_id="r", batch_id="b0", evaluator_id="e",
        tokens=[TokenGrant(token_id="b0:t0", node="n0", cpu=2)]))
    await log.append(pool, TokenReleased(rollout_id="r", batch_id="b0"))
    url = redis_server.url
    capsys.readouterr()
    assert await _cli("pool", "--at", acquired, "--redis-url", url) == 0
    then = capsys.readouterr().out
    assert f"pool at {acquired}" in then and "1 batch holding 1 token" in then
    assert await _cli("pool", "--at", declared, "--redis-url", url) == 0
    assert "0 batches holding 0 tokens" in capsys.readouterr().out
    assert await _cli("pool", "--redis-url", url) == 0
    assert "0 batches holding 0 tokens" in capsys.readouterr().out


@real_redis
async def test_top_once_shows_rollouts_pool_workers_and_groups(
    engine: Engine, log: EventLog, redis_server: RedisServer, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await _rollout_live(engine, log, "rt", tmp_path)
    capsys.readouterr()
    assert await _cli("top", "--once", "--redis-url", redis_server.url) == 0
    out = capsys.readouterr().out
    [row] = [line for line in out.splitlines() if " rt " in line]
    cells = [c.strip() for c in row.strip("│┃ ").split("│")]
    # rollout, kind, state, planned, started, completed, aborted, to admit, queued, age
    assert cells[:9] == ["rt", "eval", "READY", "6", "6", "5", "1", "0", "0"]
    [worker] = [line for line in out.splitlines() if " w1 " in line]
    assert [c.strip() for c in worker.strip("│ ").split("│")][:3] == ["w1", "0", "6"]
    assert "evaluators" in out and log.names.work("scripted") in out
    assert "ungated" in out  # the test engine declares no layout
