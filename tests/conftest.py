"""Shared fixtures: logs (``log`` and ``make_log``, in memory unless ``log_backend`` says
otherwise; ``real_log`` on a real redis-server) and Redis clients (fakeredis and a
real redis-server); the tinylm models the backend, proxy, agent and lane tests serve (built
once per session); and ``teacher_server``, a tinylm subprocess on the ``teacher_dir`` the
requesting test module defines.

And a guard: a test that leaves behind a thread serving uvicorn (a tinylm server, the
``/metrics`` server) or any non-daemon thread, started by the test or by its function-scoped
fixtures, fails in its teardown, naming the threads. Threads that fixtures of a wider scope
start are theirs until their scope ends. (A uvicorn server left running ticks
``asyncio.sleep`` from its thread, so another test's patched sleep sees it.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis.asyncio as aioredis
import uvicorn

from engine.events.log import EventLog
from engine.events.memory_log import MemoryEventLog, MemoryStore
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.ops.tinylm import init_model
from engine.sandbox import MANAGED_LABEL, LocalSandboxConfig, LocalSandboxProvider
from engine.tasks.evaluators import MATH_SYSTEM_PROMPT
from tests.redis_server import RedisServer, redis_required, start_redis_server
from tinylm.corpus import PYTHON_TOOL, Dialogue
from tinylm.model import ModelSize, TrainSettings
from tinylm.process import ServerProcess, spawn_server

ClientFactory = Callable[[], aioredis.Redis]

# ---------------------------------------------------------------- the thread guard

_WIDER_SCOPE_THREADS: set[threading.Thread] = set()
"""Threads started while a fixture wider than one test was being set up."""
_LEFT_THREAD_GRACE_S = 5.0


def _serves_uvicorn(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs a method of an object holding a ``uvicorn.Server`` (tinylm's
    ``UvicornThread``, ``engine.metrics.MetricsServer``)."""
    owner = getattr(getattr(thread, "_target", None), "__self__", None)
    return owner is not None and any(
        isinstance(value, uvicorn.Server) for value in getattr(owner, "__dict__", {}).values()
    )


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Generator[None, Any, Any]:
    if fixturedef.scope == "function":
        return (yield)
    before = set(threading.enumerate())
    try:
        return (yield)
    finally:
        _WIDER_SCOPE_THREADS.update(set(threading.enumerate()) - before)


_threads_before_test = pytest.StashKey[set[threading.Thread]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    item.stash[_threads_before_test] = set(threading.enumerate())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    result = yield
    before = item.stash.get(_threads_before_test, set())
    _WIDER_SCOPE_THREADS.intersection_update(threading.enumerate())  # forget ended ones
    left = [
        t for t in threading.enumerate()
        if t not in before and t not in _WIDER_SCOPE_THREADS
        and (not t.daemon or _serves_uvicorn(t))
    ]
    for thread in left:  # one that is on its way out gets a moment to finish
        thread.join(_LEFT_THREAD_GRACE_S)
    left = [t for t in left if t.is_alive()]
    if left:
        names = ", ".join(
            f"{t.name} ({'uvicorn' if _serves_uvicorn(t) else 'non-daemon'})" for t in left
        )
        pytest.fail(f"{item.nodeid} left threads running after its teardown: {names}")
    return result


# Every tinylm the tests serve (in-process or as a subprocess, which inherits this) returns the
# raw logprobs, as an RL deployment of SGLang must be launched (engine.ops.tinylm.RL_SERVER_ENV).
# Tests of SGLang's default (temperature-scaled) logprobs remove it for their server.
os.environ.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")


def need_redis_server() -> None:
    """Skip the test when the redis-server binary is missing; in CI, fail it instead."""
    if shutil.which("redis-server") is None:
        if redis_required():
            pytest.fail("redis-server is missing in CI: .ci/run must install it")
        pytest.skip("redis-server binary not installed")


@contextlib.contextmanager
def local_sandbox_provider(prefix: str) -> Iterator[LocalSandboxProvider]:
    """A ``LocalSandboxProvider`` on a fresh root, its sandboxes reaped and the root removed
    at the end. Not pytest's tmp_path: that is 0700, and commands run under other uids must
    traverse the root."""
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=tempfile.gettempdir()))
    root.chmod(0o711)
    provider = LocalSandboxProvider(LocalSandboxConfig(root=root))
    try:
        yield provider
    finally:
        asyncio.run(provider.reap({MANAGED_LABEL: "1"}))
        provider.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    need_redis_server()
    server = start_redis_server()
    yield server
    server.stop()


@contextlib.asynccontextmanager
async def redis_clients(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """A factory of clients that all talk to one fresh, empty Redis: ``fakeredis`` or the
    session's ``redis-server``."""
    clients: list[aioredis.Redis] = []
    if kind == "fakeredis":
        server = fakeredis.FakeServer(version=(7, 0))

        def make() -> aioredis.Redis:
            client = fakeredis.FakeAsyncRedis(server=server)
            clients.append(client)
            return client
    else:
        real: RedisServer = request.getfixturevalue("redis_server")
        settings = RedisSettings(url=real.url, block_ms=500)
        admin = connect(settings)
        await admin.flushall()
        await admin.aclose()

        def make() -> aioredis.Redis:
            client = connect(settings)
            clients.append(client)
            return client

    try:
        yield make
    finally:
        for client in clients:
            await client.aclose()


@pytest.fixture(params=["fakeredis", "redis-server"])
async def redis_factory(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """Clients of one fresh, empty Redis, on fakeredis and on a real redis-server."""
    async with redis_clients(request.param, request) as make:
        yield make


LogFactory = Callable[..., EventLog]
"""``make(producer=..., block_ms=..., max_deliveries=...)``: a log on one shared store (one
"process" on one Redis)."""


@pytest.fixture
def log_backend() -> str:
    """The implementation ``make_log`` and ``log`` run on: ``memory`` unless a folder's
    conftest says otherwise (``tests/events`` runs every implementation), or a test that
    needs a real Redis does (``@pytest.mark.parametrize("log_backend", ["redis-server"])``);
    ``fakeredis`` is the third."""
    return "memory"


@pytest.fixture
async def make_log(
    log_backend: str, request: pytest.FixtureRequest
) -> AsyncIterator[LogFactory]:
    """Logs on one fresh store of ``log_backend``."""
    if log_backend == "memory":
        store = MemoryStore()
        yield lambda **kwargs: MemoryEventLog(store, **kwargs)
        return
    async with redis_clients(log_backend, request) as clients:
        yield lambda **kwargs: RedisEventLog(clients(), **kwargs)


@pytest.fixture
def log(make_log: LogFactory) -> EventLog:
    """The log a test runs on (see ``log_backend``)."""
    return make_log(producer="test", block_ms=200, max_deliveries=3)


@pytest.fixture
async def real_log(redis_server: RedisServer) -> AsyncIterator[RedisEventLog]:
    """A log on the session's redis-server, emptied first: for tests with engine processes,
    which need a Redis they can reach."""
    client = connect(RedisSettings(url=redis_server.url, block_ms=200))
    await client.flushall()
    log = RedisEventLog(client, producer="test", block_ms=200)
    yield log
    await log.aclose()


async def write_raw(
    log: EventLog, stream: str, fields: Mapping[bytes | str, bytes], entry_id: str | None = None
) -> str:
    """Store an entry as given, undecoded (at ``entry_id`` when set): what a broken or
    foreign writer leaves, or an archive's entries at their ids. On any implementation."""
    raw = {k.encode() if isinstance(k, str) else k: v for k, v in fields.items()}
    if isinstance(log, MemoryEventLog):
        return log.append_fields(stream, raw, entry_id)
    assert isinstance(log, RedisEventLog)
    written = await log.redis.xadd(stream, raw, id=entry_id or "*")  # type: ignore[arg-type]
    return written.decode() if isinstance(written, bytes) else str(written)


TINYLM_QUESTION = "What is 17 + 25?"
TINYLM_DIALOGUE = Dialogue(
    messages=[
        {"role": "user", "content": TINYLM_QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": {"code": "print(17 + 25)"}},
                }
            ],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is <answer>42</answer>"},
    ],
    tools=[PYTHON_TOOL],
)
MATH_EPISODE = Dialogue(
    messages=[{"role": "system", "content": MATH_SYSTEM_PROMPT}, *TINYLM_DIALOGUE.messages],
    tools=TINYLM_DIALOGUE.tools,
)
"""The same episode as the ``math`` agent renders it (its system prompt, the python tool)."""


def overfit_tinylm(
    path: Path,
    dialogue: Dialogue,
    *,
    seed: int = 0,
    size: ModelSize | None = None,
    batch_size: int = 1,
    warmup_steps: int = 3,
) -> Path:
    """A tinylm at ``path`` overfit on ``dialogue`` (60 steps), so greedy decoding replays it."""
    init_model(
        path,
        seed=seed,
        dialogues=[dialogue],
        train=TrainSettings(
            steps=60, batch_size=batch_size, learning_rate=5e-3, warmup_steps=warmup_steps
        ),
        size=size or ModelSize(),
    )
    return path


@pytest.fixture(scope="session")
def tinylm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm") / "model"
    init_model(path, seed=0, train_steps=0)
    return path


@pytest.fixture(scope="session")
def toolcall_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm-toolcall") / "model"
    return overfit_tinylm(path, TINYLM_DIALOGUE, batch_size=2, warmup_steps=5)


@pytest.fixture(scope="session")
def math_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tinylm overfit on ``MATH_EPISODE``: the agents' policy, the DAgger lane's teacher."""
    return overfit_tinylm(tmp_path_factory.mktemp("agents-tinylm") / "model", MATH_EPISODE)


@pytest.fixture(scope="module")
def teacher_server(teacher_dir: Path) -> Iterator[ServerProcess]:
    """A tinylm server subprocess on the module's own ``teacher_dir`` fixture."""
    with spawn_server(teacher_dir, port=0) as proc:
        yield proc


# The engine rig's fixtures (an in-process engine, the engine's processes, evaluator specs),
# for every test folder.
from tests.rig import engine, procs, specs  # noqa: E402, F401
