"""``rollout serve``: server arguments checked against SGLang's, the registry fold, and real
tinylm servers supervised, restarted at the active version and retired."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from engine.errors import ConfigError
from engine.events.base import Envelope, Event
from engine.events.catalog import PolicyVersionActivated, PolicyVersionPublished
from engine.events.catalog.servers import ServerRegistered, ServerRetired
from engine.events.log import EventLog
from engine.ops.processes import Processes
from engine.ops.serve import (
    ServeConfig,
    Supervisor,
    active_weights,
    check_role,
    check_server_args,
    restart_wait,
    server_argv,
)
from engine.projections.base import fold, start
from engine.projections.control import ControlProjection, ControlState
from engine.runtime.follower import Follower
from engine.settings import Settings
from tests.redis_server import RedisServer
from workers._common import follow_servers, servers_from_log
from workers.cli import ROLLOUT

ROOT = Path(__file__).resolve().parents[2]
E = TypeVar("E", bound=Event)


def test_server_arguments_sglang_lacks_or_the_supervisor_sets_are_refused_by_name() -> None:
    check_server_args(
        [
            "--max-running-requests",
            "8",
            "--mem-fraction-static=0.8",
            "--enable-metrics",
            "--tp",
            "2",
        ],
        "sglang",
    )
    check_server_args(["--torch-threads", "2"], "tinylm")  # tinylm's own, for tinylm only
    with pytest.raises(ConfigError, match="'--torch-threads' is not an option of SGLang 0.5.23"):
        check_server_args(["--torch-threads", "2"], "sglang")
    with pytest.raises(ConfigError, match="'--no-such-flag' is not an option of SGLang"):
        check_server_args(["--tp-size", "1", "--no-such-flag=1"], "sglang")
    for owned in ("--port", "--model", "--weight-vers", "--host"):
        with pytest.raises(ConfigError, match=f"{owned!r}: rollout serve sets"):
            check_server_args([owned, "x"], "tinylm")


def test_an_sglang_server_is_launch_server_with_the_model_port_and_version() -> None:
    argv = server_argv("sglang", ROLLOUT, "/ckpt/v3", "0.0.0.0", 30001, 3, ["--tp-size", "2"])
    assert argv == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt/v3",
        "--host",
        "0.0.0.0",
        "--port",
        "30001",
        "--weight-version",
        "3",
        "--tp-size",
        "2",
    ]
    teacher = server_argv("tinylm", ROLLOUT, "/m", "127.0.0.1", 5, None, [])
    assert teacher[1:] == [
        *ROLLOUT,
        "tinylm",
        "serve",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "5",
    ]


def test_restarts_back_off_exponentially_up_to_the_cap() -> None:
    assert [restart_wait(n, 0.5, 5.0) for n in range(1, 7)] == [0.5, 1, 2, 4, 5, 5]


def test_servers_start_from_the_active_version_folder_or_the_base_model() -> None:
    base = Path("/models/base")
    assert active_weights(ControlState(), base) == (0, "/models/base")
    active = PolicyVersionActivated(version=3, servers=[], weights_uri="file:///ckpt/v3")
    assert active_weights(ControlState(activated=active), base) == (3, "/ckpt/v3")


def test_an_eval_server_names_its_version_and_only_an_eval_server_does() -> None:
    config = ServeConfig(backend="tinylm", model=Path("/ckpt/v0"), count=1, role="eval",
                         supervisor="s", weight_version=0)  # fmt: skip
    assert config.weight_version == 0
    with pytest.raises(ConfigError, match="--role eval needs --weight-version"):
        check_role("eval", None)
    with pytest.raises(ConfigError, match="a policy server loads the active policy version"):
        ServeConfig(backend="tinylm", model=Path("/m"), count=1, role="policy", supervisor="s",
                    weight_version=0)  # fmt: skip
    with pytest.raises(ConfigError, match="for --role eval only; a teacher server loads --model"):
        check_role("teacher", 0)


def test_servers_from_the_log_and_from_flags_are_refused_together() -> None:
    both = Settings(servers_from_log=True, sglang_url="http://a:1")
    with pytest.raises(ConfigError, match="ROLLOUT_SERVERS_FROM_LOG and --sglang-url"):
        servers_from_log(both)
    assert not servers_from_log(Settings(sglang_url="http://a:1"))
    assert servers_from_log(Settings(servers_from_log=True))


def test_fixed_ports_count_up_from_the_first(log: EventLog, tmp_path: Path) -> None:
    config = ServeConfig(
        backend="tinylm",
        model=tmp_path,
        count=3,
        role="policy",
        supervisor="s",
        host="0.0.0.0",
        port=31000,
    )
    urls = [s.url for s in Supervisor(log, Processes(tmp_path, rollout=ROLLOUT), config).servers]
    host = socket.gethostname()
    assert urls == [f"http://{host}:{p}" for p in (31000, 31001, 31002)]


def test_the_registry_keeps_each_endpoint_last_registration_until_retired() -> None:
    def reg(url: str, role: str = "policy", version: int = 0) -> ServerRegistered:
        return ServerRegistered(
            endpoint=url, role=role, backend="tinylm", supervisor="s", weight_version=version
        )

    events = [
        reg("http://a:1"),
        reg("http://t:1", "teacher"),
        reg("http://b:1"),
        reg("http://a:1", version=2),
        ServerRetired(endpoint="http://b:1", supervisor="s"),
        ServerRetired(endpoint="http://never:1", supervisor="s"),
    ]
    envs = [Envelope(id=f"{i + 1}-0", stream="rl:control", event=e) for i, e in enumerate(events)]
    state = fold(ControlProjection(), start(ControlProjection()), envs).state
    assert state.registered_servers() == ("http://a:1",)
    assert state.registered["http://a:1"].weight_version == 2
    assert state.registered_servers("teacher") == ("http://t:1",)


async def _registrations(log: EventLog, n: int, timeout_s: float = 180.0) -> list[ServerRegistered]:
    for _ in range(int(timeout_s / 0.2)):
        regs = [
            e.event
            for e in await log.read_all(log.names.control)
            if isinstance(e.event, ServerRegistered)
        ]
        if len(regs) >= n:
            return regs
        await asyncio.sleep(0.2)
    raise AssertionError(f"fewer than {n} ServerRegistered on {log.names.control}")


async def _until(log: EventLog, kind: type[E], timeout_s: float = 120.0) -> E:
    for _ in range(int(timeout_s / 0.2)):
        for env in await log.read_all(log.names.control):
            if isinstance(env.event, kind):
                return env.event
        await asyncio.sleep(0.2)
    raise AssertionError(f"no {kind.__name__} on {log.names.control}")


def _model_info(url: str) -> dict[str, object]:
    info: dict[str, object] = httpx.get(url + "/get_model_info", timeout=30).json()
    return info


def _generates(url: str) -> bool:
    reply = httpx.post(
        url + "/generate",
        timeout=60,
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    )
    return reply.status_code == 200 and bool(reply.json()["output_ids"])


@pytest.mark.redis_server
async def test_discovery_names_the_missing_supervisor_when_none_registered(
    real_log: EventLog, redis_server: RedisServer
) -> None:
    used: list[tuple[str, ...]] = []
    control = Follower(real_log, real_log.names.control, ControlProjection(), block_ms=100)
    with pytest.raises(ConfigError, match="no policy server registered on rl:control"):
        async with follow_servers(control, used.append, outage_limit_s=0.5):
            pass
    assert used == []
    await real_log.append(
        real_log.names.control,
        ServerRegistered(endpoint="http://a:1", backend="sglang", supervisor="s", weight_version=0),
    )
    await real_log.append(
        real_log.names.control,
        ServerRegistered(endpoint="http://t:1", role="teacher", backend="sglang", supervisor="s"),
    )
    control = Follower(real_log, real_log.names.control, ControlProjection(), block_ms=100)
    async with follow_servers(control, used.append, outage_limit_s=0.5):
        assert used == [("http://a:1",)]


@pytest.mark.redis_server
@pytest.mark.slow
async def test_serve_restarts_a_killed_server_at_the_active_version_and_retires_on_sigterm(
    real_log: EventLog, redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    settings = {
        "redis_url": redis_server.url,
        "model_dir": tinylm_dir,
        "serve_count": 2,
        "serve_backoff_s": 0.2,
        "serve_log_dir": tmp_path / "servers",
    }
    with Processes(
        tmp_path / "logs", rollout=ROLLOUT, settings=settings, env={"PYTHONPATH": str(ROOT)}
    ) as procs:
        procs.start("bad", "serve", "--", "--max-running-requests", "4", "--no-such-flag")
        assert procs.wait("bad", 60) == 2
        assert "'--no-such-flag' is not an option of SGLang" in procs.output("bad")
        assert not (tmp_path / "servers").exists()  # refused before any server started

        procs.start("serve", "serve", "--", "--max-running-requests", "4")
        first = await _registrations(real_log, 2)
        urls = [r.endpoint for r in first]
        assert len(set(urls)) == 2 and all(r.weight_version == 0 for r in first)
        assert {(r.role, r.backend) for r in first} == {("policy", "tinylm")}
        for url in urls:
            assert _model_info(url)["weight_version"] == "0" and _generates(url)

        # A syncer finds them in the log and activates version 1 on both.
        procs.start("sync", "sync", settings={"servers_from_log": True})
        v1 = tmp_path / "ckpt" / "v1"
        shutil.copytree(tinylm_dir, v1)
        await real_log.append(
            real_log.names.control, PolicyVersionPublished(version=1, weights_uri=f"file://{v1}")
        )
        activated = await _until(real_log, PolicyVersionActivated)
        assert sorted(activated.servers) == sorted(urls) and activated.version == 1
        assert all(_model_info(url)["weight_version"] == "1" for url in urls)

        # One server dies: restarted on its port from version 1's folder.
        assert first[0].pid is not None
        os.kill(first[0].pid, signal.SIGKILL)
        again = (await _registrations(real_log, 3))[2]
        assert again.endpoint == urls[0] and again.weight_version == 1  # same port
        assert again.pid != first[0].pid
        assert _model_info(urls[0])["weight_version"] == "1" and _generates(urls[0])
        cmdline = Path(f"/proc/{again.pid}/cmdline").read_bytes().split(b"\0")
        assert [b"--model-path", str(v1).encode()] == cmdline[cmdline.index(b"--model-path") :][:2]
        assert procs.alive("serve")

        procs.signal("serve", signal.SIGTERM)
        assert procs.wait("serve", 60) == 0
        retired = [
            e.event.endpoint
            for e in await real_log.read_all(real_log.names.control)
            if isinstance(e.event, ServerRetired)
        ]
        assert sorted(retired) == sorted(urls)
        for url in urls:
            with pytest.raises(httpx.HTTPError):
                httpx.get(url + "/get_model_info", timeout=2)
