"""Redis as the engine starts it: authenticated by default, least-privilege ACL users, TLS.

Against a real ``redis-server`` (``engine.ops.embedded``); the TLS test makes a self-signed CA
and server certificate with the ``openssl`` CLI.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis.exceptions as redis_exceptions

from engine.client import SyncRolloutClient
from engine.errors import ConfigError, LogError, LogUnavailable
from engine.events.catalog import RolloutRequested
from engine.events.names import StreamNames
from engine.events.redis_log import RedisSettings, connect, open_log
from engine.ops import cli
from engine.ops.embedded import EmbeddedRedis, RedisTls, start_fake_redis, start_redis_server
from engine.settings import Settings


def raw(port: int, *commands: bytes) -> bytes:
    """What the server answers to ``commands`` sent on one connection (up to a reset)."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        try:
            for command in commands:
                conn.sendall(command)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(4096):
                data += chunk
        except OSError:
            pass  # a TLS port drops a plain client
    return data


def test_a_client_without_the_password_gets_nothing(secured_redis: EmbeddedRedis) -> None:
    reply = raw(
        secured_redis.port,
        b"PING\r\n",
        b"XADD rl:control * forged 1\r\n",
        b"AUTH default wrong-password\r\n",
    )
    assert reply.startswith(b"-NOAUTH"), reply
    assert b"-WRONGPASS" in reply
    assert b"+PONG" not in reply


async def test_the_engine_user_cannot_flush_configure_or_leave_its_prefix(
    secured_redis: EmbeddedRedis,
) -> None:
    client = connect(RedisSettings(url=secured_redis.engine_url))
    try:
        await client.xadd("rl:pool", {"e": b"1"})
        for command in (("FLUSHALL",), ("CONFIG", "GET", "requirepass"), ("KEYS", "*"),
                        ("ACL", "LIST"), ("XADD", "other:stream", "*", "e", "1")):
            with pytest.raises(Exception, match="NOPERM|no permissions"):
                await client.execute_command(*command)
    finally:
        await client.aclose()


async def test_the_trainer_user_may_only_request_and_read(secured_redis: EmbeddedRedis) -> None:
    names = StreamNames()
    admin = open_log(RedisSettings(url=secured_redis.url), names=names, producer="admin")
    trainer = open_log(RedisSettings(url=secured_redis.trainer_url), names=names, producer="t")
    event = RolloutRequested(rollout_id="sec-1", n_prompts=1)
    try:
        await admin.append(names.rollout("sec-1"), event)
        await trainer.append(names.control, event)  # a request: allowed
        envs, _ = await trainer.read_after(names.rollout("sec-1"), "0-0", block_ms=0)
        assert [env.event.rollout_id for env in envs] == ["sec-1"]  # results: readable
        with pytest.raises(LogError, match="NOPERM|no permissions"):
            await trainer.append(names.pool, event)  # forging scheduler events: refused
        with pytest.raises(LogError, match="NOPERM|no permissions"):
            await trainer.append(names.rollout("sec-1"), event)
    finally:
        await admin.aclose()
        await trainer.aclose()


def test_the_passwords_are_in_no_command_line_and_no_readable_file(
    secured_redis: EmbeddedRedis,
) -> None:
    assert secured_redis._proc is not None and secured_redis._workdir is not None
    cmdline = Path(f"/proc/{secured_redis._proc.pid}/cmdline").read_bytes()
    config = Path(secured_redis._workdir) / "redis.conf"
    text = config.read_text()
    for password in secured_redis.passwords.values():
        assert password.encode() not in cmdline
        assert password not in text  # SHA-256 hashes only
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(secured_redis._workdir).stat().st_mode) == 0o700
    assert len(set(secured_redis.passwords.values())) == 3  # one password per user


def test_every_server_gets_fresh_passwords() -> None:
    with start_redis_server() as one, start_redis_server() as two:
        assert set(one.passwords.values()).isdisjoint(two.passwords.values())


def test_the_fakeredis_fallback_is_unauthenticated_and_says_so() -> None:
    with start_fake_redis() as fake:
        assert not fake.authenticated
        assert "@" not in fake.url
        assert raw(fake.port, b"*1\r\n$4\r\nPING\r\n").startswith(b"+PONG")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> RedisTls:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=rollout-test-ca", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=redis",
             "-keyout", str(d / "redis.key"), "-out", str(d / "redis.csr"))
    _openssl("x509", "-req", "-in", str(d / "redis.csr"), "-CA", str(d / "ca.crt"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
             "-out", str(d / "redis.crt"))
    # The server runs as root here, but keep what a non-root redis-server could read.
    os.chmod(d / "redis.key", 0o600)
    return RedisTls(cert_file=d / "redis.crt", key_file=d / "redis.key", ca_file=d / "ca.crt")


@pytest.fixture(scope="module")
def tls_redis(certificates: RedisTls) -> EmbeddedRedis:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    server = start_redis_server(tls=certificates)
    yield server  # type: ignore[misc]
    server.stop()


async def test_rediss_urls_work_with_the_ca(
    tls_redis: EmbeddedRedis, certificates: RedisTls
) -> None:
    assert tls_redis.url.startswith("rediss://default:")
    settings = RedisSettings(url=tls_redis.engine_url, tls_ca_file=str(certificates.ca_file))
    client = connect(settings)
    try:
        assert await client.ping()
        await client.xadd("rl:control", {"e": b"over tls"})
        assert await client.xlen("rl:control") == 1
    finally:
        await client.aclose()


async def test_rediss_refuses_a_server_it_cannot_verify(tls_redis: EmbeddedRedis) -> None:
    log = open_log(RedisSettings(url=tls_redis.engine_url, connect_timeout_s=5))  # system CAs
    try:
        with pytest.raises(LogUnavailable, match="certificate verify failed|CERTIFICATE"):
            await log.read_after("rl:control", "0-0", block_ms=0)
    finally:
        await log.aclose()


def test_the_tls_port_does_not_speak_plain_redis(tls_redis: EmbeddedRedis) -> None:
    password = tls_redis.passwords["default"].encode()
    reply = raw(tls_redis.port, b"AUTH default " + password + b"\r\n", b"PING\r\n")
    assert b"+PONG" not in reply and b"+OK" not in reply


def test_tls_files_on_a_plain_url_are_refused() -> None:
    with pytest.raises(ConfigError, match="tls_ca_file set but the URL is not rediss://"):
        RedisSettings(url="redis://u:secret@127.0.0.1:6379/0", tls_ca_file="/ca.crt")
    with pytest.raises(ConfigError, match="go together"):
        RedisSettings(url="rediss://127.0.0.1:6379/0", tls_cert_file="/c.crt")


async def test_settings_hand_the_engine_its_credentials_from_a_file(
    secured_redis: EmbeddedRedis, tmp_path: Path
) -> None:
    secret = tmp_path / "redis.password"
    secret.write_text(secured_redis.passwords["engine"] + "\n")
    secret.chmod(0o600)
    settings = Settings.from_env({
        "ROLLOUT_REDIS_URL": f"redis://127.0.0.1:{secured_redis.port}/0",
        "ROLLOUT_REDIS_USERNAME": "engine",
        "ROLLOUT_REDIS_PASSWORD_FILE": str(secret),
    })
    redis = settings.redis(block_ms=100)
    assert redis.username == "engine" and redis.block_ms == 100
    assert secured_redis.passwords["engine"] not in repr(redis)
    client = connect(redis)
    try:
        assert await client.xlen("rl:pool") >= 0
    finally:
        await client.aclose()
    missing = Settings.from_env({"ROLLOUT_REDIS_PASSWORD_FILE": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match="ROLLOUT_REDIS_PASSWORD_FILE: cannot read"):
        missing.redis()


# ------------------------------------------------- credentials are configuration, not an outage


@pytest.mark.parametrize(
    ("userinfo", "user"),
    [("", "default"), ("engine@", "engine"), ("engine:wrong@", "engine"), ("nobody:x@", "nobody")],
    ids=["no-password", "user-without-password", "wrong-password", "unknown-user"],
)
async def test_refused_credentials_fail_at_once_naming_the_user_and_server(
    secured_redis: EmbeddedRedis, userinfo: str, user: str
) -> None:
    where = f"127.0.0.1:{secured_redis.port}"
    log = open_log(RedisSettings(url=f"redis://{userinfo}{where}/0", block_ms=100))
    try:
        for _attempt in range(2):  # a retry meets the same refusal, not a recursion
            with pytest.raises(ConfigError, match=f"user '{user}' at {where}") as refused:
                await log.last_id("rl:control")
            assert "recursion" not in str(refused.value).lower()
            assert not isinstance(refused.value, LogError)  # never ridden out as an outage
    finally:
        await log.aclose()
    client = connect(RedisSettings(url=f"redis://{userinfo}{where}/0"))
    try:  # the raw client refuses too, with redis's own error
        with pytest.raises(redis_exceptions.AuthenticationError):
            await client.ping()
    finally:
        await client.aclose()


@pytest.mark.parametrize("userinfo", ["", "engine:wrong@"], ids=["no-password", "wrong-password"])
def test_a_process_with_refused_credentials_exits_at_once(
    secured_redis: EmbeddedRedis, tmp_path: Path, userinfo: str
) -> None:
    where = f"127.0.0.1:{secured_redis.port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env["ROLLOUT_REDIS_URL"] = f"redis://{userinfo}{where}/0"
    done = subprocess.run(  # an outage would be ridden out for 300 s, past the timeout
        [sys.executable, "-m", "workers", "finalizer", "--outage-limit-s", "300",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"at {where}" in done.stderr and "refused the login" in done.stderr
    assert "RecursionError" not in done.stderr and "Traceback" not in done.stderr


def test_a_url_without_a_scheme_is_refused_naming_the_variable_and_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = Settings.from_env({"ROLLOUT_REDIS_URL": "127.0.0.1:6379"})
    with pytest.raises(ConfigError, match="ROLLOUT_REDIS_URL") as refused:
        settings.redis()
    assert "--redis-url" in str(refused.value) and "needs a scheme" in str(refused.value)
    with pytest.raises(ConfigError, match="needs a scheme"):
        RedisSettings(url="localhost")
    assert cli.main(["status", "r1", "--redis-url", "localhost:6379"]) == 1
    assert "needs a scheme" in capsys.readouterr().err


def test_the_sync_client_reads_the_redis_settings_the_cli_reads(
    secured_redis: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("ROLLOUT_")]:
        monkeypatch.delenv(key)
    secret = tmp_path / "trainer.password"
    secret.write_text(secured_redis.passwords["trainer"] + "\n")
    secret.chmod(0o600)
    monkeypatch.setenv("ROLLOUT_REDIS_URL", f"redis://127.0.0.1:{secured_redis.port}/0")
    with SyncRolloutClient() as anonymous, pytest.raises(ConfigError, match="user 'default'"):
        anonymous.request(iteration=0, n_prompts=1)
    # What the demo prints for the inspect commands reaches the trainer's client too.
    monkeypatch.setenv("ROLLOUT_REDIS_USERNAME", "trainer")
    monkeypatch.setenv("ROLLOUT_REDIS_PASSWORD_FILE", str(secret))
    monkeypatch.setenv("ROLLOUT_STREAM_PREFIX", "rl")
    with SyncRolloutClient() as client:
        rid = client.request(iteration=0, n_prompts=1)
        assert client._client.log.names.prefix == "rl"

    async def requested() -> list[str]:
        admin = open_log(RedisSettings(url=secured_redis.url))
        try:
            return [env.event.rollout_id for env in await admin.read(admin.names.control)]  # type: ignore[attr-defined]
        finally:
            await admin.aclose()

    assert asyncio.run(requested())[-1] == rid  # the last request on the control plane
