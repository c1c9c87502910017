"""``rollout serve``: N model servers kept serving at the active policy version, registered
on ``rl:control``.

Each server is tinylm on CPU (``rollout tinylm serve``) or SGLang (``python -m
sglang.launch_server``), started through the launcher (``engine.ops.processes``) on a port
reserved for it, which a restart keeps. The server arguments are refused at start-up, naming
the first one that SGLang's ``ServerArgs`` lacks (``tinylm.sglang_server_args``, generated
from SGLang's source) or that the supervisor sets itself (model, host, port, version).

Every start and restart of a policy server loads the active policy version: the weights
folder of the last ``PolicyVersionActivated`` on ``rl:control`` with ``--weight-version N``
(both servers take the flag), or the base model as version 0 before any activation, so a
server never comes back with older weights than the others serve. A teacher keeps the base
model. An eval server (``role="eval"``) loads ``model`` (the weights to evaluate) at
``weight_version`` on every start and restart, and keeps it: the syncer loads only policy
servers, so the eval rollouts pinned to that version (``RolloutRequested.pinned_version``) run
there while training moves on. A server that exits is restarted after a wait that doubles
from ``serve_backoff_s`` up to ``serve_backoff_max_s``; one that has served that long starts
over from the first wait.

Each server that answers is registered (``ServerRegistered``); on SIGTERM the supervisor
stops its servers and retires them (``ServerRetired``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from engine.actors.weight_sync import weights_path
from engine.errors import BackendUnavailable, ConfigError
from engine.events.catalog.servers import ServerRegistered, ServerRetired, ServerRole
from engine.events.log import EventLog
from engine.ops.embedded import free_port
from engine.ops.processes import Processes
from engine.ops.tinylm import RL_SERVER_ENV
from engine.projections.control import ControlProjection, ControlState
from engine.runtime.follower import Follower
from tinylm.sglang_server_args import FLAGS, SGLANG_VERSION

__all__ = [
    "ServeConfig",
    "Supervisor",
    "active_weights",
    "check_role",
    "check_server_args",
    "restart_wait",
    "server_argv",
]

logger = logging.getLogger("engine.serve")

OWNED = ("model_path", "host", "port", "weight_version")
"""The ``ServerArgs`` fields the supervisor sets on every server."""
TINYLM_OWN = ("--logprobs", "--torch-threads", "--api-key-file", "--admin-api-key-file")
"""tinylm's flags that SGLang lacks, accepted for the tinylm backend."""


def check_server_args(args: Sequence[str], backend: str) -> None:
    """``ConfigError`` naming the first option that SGLang's ``ServerArgs`` does not have
    (an unambiguous prefix counts, as in SGLang's parser) or that the supervisor sets."""
    for word in args:
        if not word.startswith("--"):
            continue  # a value
        option = word.split("=", 1)[0]
        if backend == "tinylm" and option in TINYLM_OWN:
            continue
        found = [option] if option in FLAGS else [f for f in FLAGS if f.startswith(option)]
        if len({FLAGS[f][0] for f in found}) != 1:
            raise ConfigError(
                f"server argument {option!r} is not an option of SGLang "
                f"{SGLANG_VERSION}'s ServerArgs"
                + (f" (ambiguous: {', '.join(found[:4])})" if found else "")
            )
        if FLAGS[found[0]][0] in OWNED:
            raise ConfigError(
                f"server argument {option!r}: rollout serve sets {', '.join(OWNED)} itself"
            )


def check_role(role: str, weight_version: int | None) -> None:
    """``ConfigError`` unless an eval server names its version, and only an eval server does
    (a policy server loads the active version, a teacher the base model)."""
    if role == "eval" and weight_version is None:
        raise ConfigError(
            "--role eval needs --weight-version (ROLLOUT_SERVE_WEIGHT_VERSION): the version of "
            "--model the eval server keeps and the pinned eval rollouts ask for"
        )
    if role != "eval" and weight_version is not None:
        raise ConfigError(
            f"--weight-version is for --role eval only; a {role} server loads "
            + ("the active policy version" if role == "policy" else "--model")
        )


def server_argv(
    backend: str,
    rollout: Sequence[str],
    model: str,
    host: str,
    port: int,
    version: int | None,
    args: Sequence[str],
) -> list[str]:
    """The command line of one server."""
    if backend == "tinylm":
        head = [sys.executable, *rollout, "tinylm", "serve"]
    else:
        head = [sys.executable, "-m", "sglang.launch_server"]
    tail = ["--model-path", model, "--host", host, "--port", str(port)]
    if version is not None:
        tail += ["--weight-version", str(version)]
    return [*head, *tail, *args]


def restart_wait(failures: int, first_s: float, cap_s: float) -> float:
    """The wait before restarting a server that failed ``failures`` times in a row."""
    return float(min(first_s * 2 ** (failures - 1), cap_s))


def active_weights(state: ControlState, base: Path) -> tuple[int, str]:
    """The active policy version and its folder; version 0 and ``base`` before any."""
    if state.activated is None:
        return 0, str(base)
    return state.activated.version, weights_path(state.activated.weights_uri)


@dataclass(frozen=True)
class ServeConfig:
    backend: str
    model: Path
    count: int
    role: ServerRole
    supervisor: str
    host: str = "127.0.0.1"
    port: int | None = None
    args: tuple[str, ...] = ()
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    start_timeout_s: float = 600.0
    poll_s: float = 0.2
    weight_version: int | None = None  # the version an eval server keeps

    def __post_init__(self) -> None:
        check_role(self.role, self.weight_version)


@dataclass
class _Server:
    name: str
    url: str
    port: int
    failures: int = 0
    up_since: float = 0.0
    retry_at: float | None = None


class Supervisor:
    """Runs ``config.count`` servers until ``stop`` is set; see the module docstring."""

    def __init__(self, log: EventLog, processes: Processes, config: ServeConfig) -> None:
        self.log = log
        self.processes = processes
        self.config = config
        self._policy = Follower(log, log.names.control, ControlProjection())
        shown = config.host if config.host not in ("0.0.0.0", "::") else socket.gethostname()
        self.servers = []
        for i in range(config.count):
            port = free_port() if config.port is None else config.port + i
            self.servers.append(_Server(f"{config.role}-{i}", f"http://{shown}:{port}", port))

    async def run(self, stop: asyncio.Event) -> None:
        started: list[_Server] = []
        try:
            for server in self.servers:
                await self._start(server)
                started.append(server)
            while not stop.is_set():
                for server in self.servers:
                    await self._tend(server)
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.poll_s)
        finally:
            await asyncio.to_thread(self.processes.stop)
            if started:
                await self.log.append_many(
                    [
                        (
                            self.log.names.control,
                            ServerRetired(
                                endpoint=s.url, supervisor=self.config.supervisor, reason="stopped"
                            ),
                        )
                        for s in started
                    ]
                )

    async def _tend(self, server: _Server) -> None:
        now = time.monotonic()
        if self.processes.alive(server.name):
            if now - server.up_since >= self.config.backoff_max_s:
                server.failures = 0
            return
        if server.retry_at is None:
            server.failures += 1
            wait = restart_wait(server.failures, self.config.backoff_s, self.config.backoff_max_s)
            server.retry_at = now + wait
            logger.warning(
                "%s (%s) exited with status %s; restarting in %.1fs",
                server.name,
                server.url,
                self.processes[server.name].popen.returncode,
                wait,
            )
        elif now >= server.retry_at:
            try:
                await self._start(server)
            except BackendUnavailable as exc:
                logger.warning("%s", exc)
                server.retry_at = None

    async def _start(self, server: _Server) -> None:
        cfg = self.config
        version, model = cfg.weight_version, str(cfg.model)  # an eval server's, kept
        if cfg.role == "policy":
            await self._policy.refresh()
            version, model = active_weights(self._policy.state, cfg.model)
        argv = server_argv(
            cfg.backend, self.processes.rollout, model, cfg.host, server.port, version, cfg.args
        )
        local = f"http://127.0.0.1:{server.port}" if cfg.host in ("0.0.0.0", "::") else server.url
        proc = await asyncio.to_thread(
            self.processes.spawn,
            server.name,
            argv,
            RL_SERVER_ENV,
            url=local,
            timeout_s=cfg.start_timeout_s,
        )
        server.up_since, server.retry_at = time.monotonic(), None
        logger.info("%s serves at %s (version %s, %s)", server.name, server.url, version, model)
        await self.log.append(
            self.log.names.control,
            ServerRegistered(
                endpoint=server.url,
                role=cfg.role,
                backend=cfg.backend,
                supervisor=cfg.supervisor,
                weight_version=version,
                pid=proc.pid,
            ),
        )
