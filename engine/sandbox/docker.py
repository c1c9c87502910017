"""Docker sandbox: one container per sandbox, driven through the docker SDK in threads.

A sandbox is an idle container (``keepalive`` under Docker's init, which collects orphans) with
the sandbox's labels, no network unless configured, ``no-new-privileges``, ``max_procs`` as
``pids_limit``, ``memory_mb`` as ``mem_limit`` without swap, ``cpu_time_s`` as its
``RLIMIT_CPU``, ``cpus`` as ``nano_cpus`` and, with ``disk_mb``, a tmpfs working directory.

Commands are ``docker exec`` s (``_docker_exec``). When even the kill cannot run (a fork bomb
holding every pid), the container is killed and the sandbox marked failed: later calls raise
``SandboxError`` saying so, and ``stop``/``reap`` still remove it. ``stdin`` is staged as a file
in ``scratch_dir`` that the command's shell opens and unlinks before the command starts. Files
move through the archive endpoints (``_docker_files``).
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from engine.errors import ConfigError, SandboxError
from engine.sandbox import _docker_exec as _exec
from engine.sandbox._docker_api import call, docker_module, is_not_found, tar_archive, translate
from engine.sandbox._docker_files import ArchiveFiles
from engine.sandbox._forward import Forwarder, NetnsRef, forward
from engine.sandbox.base import (
    MANAGED_LABEL,
    SANDBOX_ID_LABEL,
    Endpoint,
    ExecResult,
    SandboxLimits,
    command_argv,
    validate_labels,
    validate_selector,
)

__all__ = ["DockerSandbox", "DockerSandboxConfig", "DockerSandboxProvider"]

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, slots=True, kw_only=True)
class DockerSandboxConfig:
    """Settings of the Docker backend.

    ``image`` must have ``/bin/sh`` and the ``keepalive`` command; ``user``: who commands run as
    (``None``: the image's); ``cpus``: ``None`` is no cap; ``base_url``: the daemon (``None``:
    from the environment, as the docker CLI does).
    """

    image: str
    workdir: str = "/workspace"
    user: str | None = None
    network_mode: str = "none"
    cpus: float | None = 1.0
    keepalive: tuple[str, ...] = ("sleep", "infinity")
    init: bool = True
    scratch_dir: str = "/tmp"
    base_env: Mapping[str, str] = field(
        default_factory=lambda: {"PATH": _DEFAULT_PATH, "LANG": "C.UTF-8"}
    )
    base_url: str | None = None
    api_timeout_s: float = 60.0
    kill_grace_s: float = 10.0
    default_limits: SandboxLimits = field(default_factory=SandboxLimits)

    def __post_init__(self) -> None:
        if not self.image:
            raise ConfigError("DockerSandboxConfig.image must name an image")
        for name in ("workdir", "scratch_dir"):
            value = getattr(self, name)
            if not posixpath.isabs(value) or posixpath.normpath(value) in ("/", "//"):
                raise ConfigError(
                    f"DockerSandboxConfig.{name} must be an absolute path below /, got {value!r}"
                )
        if self.cpus is not None and self.cpus <= 0:
            raise ConfigError(f"DockerSandboxConfig.cpus must be > 0, got {self.cpus}")
        if not self.keepalive:
            raise ConfigError("DockerSandboxConfig.keepalive needs a command")


class DockerSandbox:
    """A sandbox made by :class:`DockerSandboxProvider`."""

    def __init__(
        self,
        *,
        client: Callable[[], Any],
        sandbox_id: str,
        labels: Mapping[str, str],
        limits: SandboxLimits,
        config: DockerSandboxConfig,
    ) -> None:
        self._client_factory = client
        self._client: Any = None
        self._id = sandbox_id
        self._labels = MappingProxyType(dict(labels))
        self._limits = limits
        self._config = config
        self._workdir = posixpath.normpath(config.workdir)
        self._container: Any = None
        self._forwarders: list[Forwarder] = []
        self._files: ArchiveFiles | None = None
        self._state: Literal["new", "running", "failed", "stopped"] = "new"
        self._failure = ""
        self._owner = (0, 0)
        self._exec_count = 0
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"DockerSandbox(id={self._id!r}, state={self._state}, image={self._config.image!r})"

    @property
    def id(self) -> str:
        return self._id

    @property
    def labels(self) -> Mapping[str, str]:
        return self._labels

    @property
    def limits(self) -> SandboxLimits:
        return self._limits

    @property
    def workdir(self) -> str:
        return self._workdir

    @property
    def container_id(self) -> str | None:
        return None if self._container is None else str(self._container.id)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        async with self._lock:
            if self._state == "running":
                return
            if self._state != "new":
                raise SandboxError(f"sandbox {self._id} is {self._state} and cannot start again")
            try:
                self._client = await asyncio.to_thread(self._client_factory)
                await self._create_container()
                await self._prepare_workdir()
                self._files = ArchiveFiles(
                    client=self._client,
                    container=self._container,
                    workdir=self._workdir,
                    owner=self._owner,
                    sandbox_id=self._id,
                    max_file_bytes=self._limits.max_file_bytes,
                )
            except BaseException:
                await self._remove_container()
                self._state = "stopped"
                raise
            self._state = "running"

    async def _create_container(self) -> None:
        docker = docker_module()
        limits, config = self._limits, self._config
        memory = f"{limits.memory_mb}m"
        options: dict[str, Any] = {
            "command": list(config.keepalive),
            "detach": True,
            "name": f"rollout-{self._id}",
            "labels": dict(self._labels),
            "working_dir": self._workdir,
            "network_mode": config.network_mode,
            "mem_limit": memory,
            "memswap_limit": memory,
            "pids_limit": limits.max_procs,
            "ulimits": [
                docker.types.Ulimit(
                    name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds + 1
                ),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            "init": config.init,
            "security_opt": ["no-new-privileges:true"],
        }
        if config.cpus is not None:
            options["nano_cpus"] = int(config.cpus * 1e9)
        if config.user is not None:
            options["user"] = config.user
        if limits.disk_mb is not None:
            options["tmpfs"] = {
                self._workdir: f"rw,exec,nosuid,nodev,size={limits.disk_mb}m,mode=1777"
            }
        self._container = await call(
            f"starting sandbox {self._id} from image {config.image!r}",
            self._client.containers.run,
            config.image,
            **options,
        )

    async def _prepare_workdir(self) -> None:
        """Learn the exec user's uid/gid and hand it the working directory with
        ``put_archive`` (the daemon extracts as root): under ``no-new-privileges`` a root exec
        in a non-root container has no capabilities, so ``chown`` inside would be refused."""
        if self._config.user is None:
            return
        ids = await self._quick_exec(["/bin/sh", "-c", "id -u; id -g"], user=self._config.user)
        try:
            uid, gid = (int(line) for line in ids.split())
        except ValueError as exc:
            raise SandboxError(
                f"sandbox {self._id}: could not learn uid/gid of user {self._config.user!r} "
                f"in image {self._config.image!r} (got {ids!r})"
            ) from exc
        self._owner = (uid, gid)
        mode = 0o1777 if self._limits.disk_mb is not None else 0o755
        name = posixpath.basename(self._workdir)
        archive = tar_archive([(name, None, mode)], owner=self._owner)
        await call(
            f"sandbox {self._id}: handing {self._workdir} to uid {uid}",
            self._container.put_archive,
            posixpath.dirname(self._workdir),
            archive,
        )

    async def _quick_exec(self, argv: list[str], *, user: str) -> str:
        container = self._container

        def run() -> tuple[int, bytes]:
            result = container.exec_run(argv, user=user)
            return int(result.exit_code), bytes(result.output)

        code, output = await call(f"sandbox {self._id}: running {argv[0]}", run)
        if code != 0:
            raise SandboxError(
                f"sandbox {self._id}: {' '.join(argv)!r} exited {code}: "
                f"{output.decode('utf-8', 'replace')[:500]}"
            )
        return output.decode("utf-8", "replace")

    async def expose(self, endpoint: Endpoint) -> str:
        """Needs the daemon on this machine and a root worker: the worker joins the
        container's network namespace through its init pid."""
        container = self._require_running(f"expose {endpoint.target}")
        try:
            await asyncio.to_thread(container.reload)
            pid = int(container.attrs["State"]["Pid"])
            netns = NetnsRef.of(pid)
        except Exception as exc:
            raise SandboxError(
                f"sandbox {self._id}: cannot reach the container's network namespace to expose "
                f"{endpoint.target} (the daemon must run on this machine and the worker as "
                f"root): {exc}"
            ) from exc
        self._forwarders.append(await forward(netns, endpoint))
        return f"127.0.0.1:{endpoint.port}"

    async def stop(self) -> None:
        async with self._lock:
            if self._state == "stopped":
                return
            self._state = "stopped"
            forwarders, self._forwarders = self._forwarders, []
            for forwarder in forwarders:
                await forwarder.close()
            await self._remove_container()

    async def _remove_container(self) -> None:
        container = self._container
        if container is None:
            return
        try:
            await asyncio.to_thread(container.remove, force=True, v=True)
        except Exception as exc:
            if is_not_found(exc):
                return  # reaped already
            raise translate(f"removing sandbox {self._id}", exc) from exc

    async def __aenter__(self) -> DockerSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _require_running(self, what: str) -> Any:
        if self._state == "failed":
            raise SandboxError(f"cannot {what}: sandbox {self._id} failed: {self._failure}")
        if self._state != "running":
            raise SandboxError(f"cannot {what}: sandbox {self._id} is {self._state}")
        return self._container

    async def _fail(self, reason: str) -> None:
        """Kill the whole container: the last resort for a command that cannot be stopped."""
        self._state = "failed"
        self._failure = reason
        try:
            await asyncio.to_thread(self._container.kill)
        except Exception:
            pass  # already gone is as good as killed

    # -- commands ------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        container = self._require_running(f"exec {cmd!r}")
        argv = command_argv(cmd)
        timeout = self._limits.effective_timeout(timeout_s)
        self._exec_count += 1
        number = self._exec_count
        marker = f"{self._id}/{number}"
        environment = _exec.environment(
            self._config.base_env, env, home=self._workdir, marker=marker, sandbox_id=self._id
        )
        if stdin is not None:
            argv = await self._stage_stdin(argv, stdin, number)
        api = self._client.api
        created = await call(
            f"sandbox {self._id}: creating exec {number}",
            api.exec_create,
            container.id,
            argv,
            stdout=True,
            stderr=True,
            stdin=False,
            tty=False,
            environment=environment,
            workdir=self._workdir,
            user=self._config.user or "",
        )
        exec_id = created["Id"]
        output = _exec.Output(self._limits.max_output_bytes)

        def pump() -> None:
            for out, err in api.exec_start(exec_id, stream=True, demux=True):
                if out:
                    output.add(0, out)
                if err:
                    output.add(1, err)

        started, wall_start = time.monotonic(), time.time()
        task = asyncio.ensure_future(call(f"sandbox {self._id}: exec {number}", pump))
        # A pump abandoned after a timeout may still fail later; its error is not news then.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        timed_out = False
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                timed_out = True
                if not await self._kill_exec(marker):
                    await self._fail(f"exec {number} ({argv[0]!r}) could not be killed")
                done, _ = await asyncio.wait({task}, timeout=self._config.kill_grace_s)
                if not done and self._state != "failed":
                    await self._fail(f"exec {number} ({argv[0]!r}) kept its output open")
        except BaseException:
            task.cancel()
            await asyncio.shield(self._kill_exec(marker))
            raise
        elapsed = time.monotonic() - started
        if task.done() and not task.cancelled() and not timed_out:
            error = task.exception()
            if error is not None:
                raise error
        code = await _exec.exit_code(
            api, exec_id, timed_out=timed_out, failed=lambda: self._state == "failed",
            sandbox_id=self._id,
        )
        return await _exec.result(
            code, output, timed_out=timed_out, elapsed=elapsed, since=wall_start,
            client=self._client, container_id=container.id,
            failure=self._failure if self._state == "failed" else None,
        )

    async def _stage_stdin(self, argv: list[str], stdin: bytes | str, number: int) -> list[str]:
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        name = f".rollout-stdin-{self._id}-{number}"
        archive = tar_archive([(name, data, 0o600)], owner=self._owner)
        await call(
            f"sandbox {self._id}: staging stdin",
            self._container.put_archive,
            self._config.scratch_dir,
            archive,
        )
        return _exec.stdin_argv(posixpath.join(self._config.scratch_dir, name), argv)

    async def _kill_exec(self, marker: str) -> bool:
        return await _exec.kill_exec(
            self._container, marker, user=self._config.user or "",
            grace_s=self._config.kill_grace_s,
        )

    # -- files ---------------------------------------------------------------------------

    async def read_file(self, path: str) -> bytes:
        self._require_running(f"read {path!r}")
        assert self._files is not None
        return await self._files.read(path)

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._require_running(f"write {path!r}")
        assert self._files is not None
        if not 0 <= mode <= 0o7777:
            raise SandboxError(f"file mode for {path!r} must be within 0o0..0o7777, got {mode!r}")
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if len(payload) > self._limits.max_file_bytes:
            raise SandboxError(
                f"sandbox {self._id}: {len(payload)} bytes for {path!r} exceed the "
                f"{self._limits.max_file_bytes}-byte file limit"
            )
        await self._files.write(path, payload, mode)


class DockerSandboxProvider:
    """Creates :class:`DockerSandbox` es on one daemon and reaps them by label."""

    def __init__(self, config: DockerSandboxConfig, *, client: Any = None) -> None:
        self.config = config
        self._client = client
        self._client_lock = threading.Lock()

    def _get_client(self) -> Any:
        """The SDK client, made on first use (it talks to the daemon: call in a thread)."""
        with self._client_lock:
            if self._client is None:
                docker = docker_module()
                timeout = int(self.config.api_timeout_s)
                try:
                    if self.config.base_url is None:
                        self._client = docker.from_env(timeout=timeout)
                    else:
                        self._client = docker.DockerClient(
                            base_url=self.config.base_url, timeout=timeout
                        )
                except (docker.errors.DockerException, OSError) as exc:
                    raise translate("connecting to the docker daemon", exc) from exc
            return self._client

    async def ping(self) -> None:
        """Raise SandboxError unless the daemon answers and has the configured image."""
        client = await asyncio.to_thread(self._get_client)
        await call("pinging the docker daemon", client.ping)
        await call(
            f"looking up sandbox image {self.config.image!r}",
            client.images.get,
            self.config.image,
        )

    def create(
        self, *, labels: Mapping[str, str], limits: SandboxLimits | None = None
    ) -> DockerSandbox:
        checked = validate_labels(labels)
        sandbox_id = f"sb-{secrets.token_hex(6)}"
        checked[MANAGED_LABEL] = "1"
        checked[SANDBOX_ID_LABEL] = sandbox_id
        return DockerSandbox(
            client=self._get_client,
            sandbox_id=sandbox_id,
            labels=checked,
            limits=limits or self.config.default_limits,
            config=self.config,
        )

    async def find(self, label_selector: Mapping[str, str]) -> list[str]:
        """Ids of the sandboxes (running or not) that carry all of ``label_selector``."""
        selector = validate_selector(label_selector)
        containers = await self._containers(selector)
        return [
            str(container.labels.get(SANDBOX_ID_LABEL, container.id)) for container in containers
        ]

    async def _containers(self, selector: Mapping[str, str]) -> list[Any]:
        client = await asyncio.to_thread(self._get_client)
        filters = {"label": [f"{MANAGED_LABEL}=1", *(f"{k}={v}" for k, v in selector.items())]}
        found: list[Any] = await call(
            f"listing sandboxes with labels {dict(selector)}",
            client.containers.list,
            all=True,
            filters=filters,
        )
        return found

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        selector = validate_selector(label_selector)
        removed = 0
        for container in await self._containers(selector):
            try:
                await asyncio.to_thread(container.remove, force=True, v=True)
                removed += 1
            except Exception as exc:
                if is_not_found(exc):
                    continue  # removed concurrently by its owner or another reaper
                raise translate(f"reaping container {container.id}", exc) from exc
        return removed

    def close(self) -> None:
        """Close the SDK client (sandboxes keep running; a later call reconnects)."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
