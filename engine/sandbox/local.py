"""Local-process sandbox: one directory per sample, commands run as contained child processes.

Layout (``root`` defaults to ``$TMPDIR/rollout-sandboxes``)::

    <root>/<id>/              owned by the worker, mode 0711: commands cannot change it
    <root>/<id>/sandbox.json  labels, uid, cgroups, process groups -- what ``reap`` needs
    <root>/<id>/work/         the working directory (``workdir``), owned by the sandbox's uid
    <root>/<id>/tmp/          ``TMPDIR`` of the commands
    <root>/.uids/<uid>        which sandbox holds which dedicated uid

The provider's supervisor (``_init.py``) forks every command in a new session, with an
environment built from scratch (the worker's holds credentials), in the working directory,
under these limits:

* **processes**: ``RLIMIT_NPROC``, which the kernel ignores for root, so a root worker runs
  commands as a *dedicated uid* per sandbox (which also keeps them off the worker's files);
  where that uid range is not mapped, as ``nobody``, and a non-root worker as itself, the limit
  then counting on top of what that uid already runs. Usable cgroups add ``pids.max``.
* **CPU**: ``RLIMIT_CPU`` per process (SIGXCPU, then SIGKILL a second later).
* **memory**: ``RLIMIT_DATA`` per process (unlike ``RLIMIT_AS`` it leaves out shared libraries
  and reserved address space, so runtimes with big arenas start), plus the cgroup limit.
* **disk**: ``RLIMIT_FSIZE`` per file when ``limits.disk_mb`` is set.
* **wall clock**: on timeout the command's cgroup, process group and every process carrying its
  exec marker are SIGKILLed.
* **network**: a network namespace per sandbox with only loopback, so commands reach neither
  Redis nor the model server nor any host service. A root *namespace holder*, which the sandbox
  uid cannot signal, keeps it alive; commands ``setns`` into it before dropping privileges, so
  one sandbox's commands share a loopback and sandboxes never do. ``expose`` forwards one port
  to one outside service. Where ``unshare(CLONE_NEWNET)`` is refused, commands share the host's
  network and ``containment`` says so.

``stop()`` and ``reap()`` kill the sandbox's processes (its uid's, its cgroups', its markers',
its recorded process groups'), remove its cgroups and directory and release its uid.

This contains resources and the file API; it is not a filesystem jail: commands can read what
the sandbox uid may read and write world-writable places such as ``/tmp``. Run untrusted code
under the Docker backend when that matters.
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import socket
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from engine.errors import ConfigError, SandboxError
from engine.sandbox import _procs
from engine.sandbox._cgroup import CgroupCounters, SandboxCgroup
from engine.sandbox._forward import Forwarder, NetnsRef, forward
from engine.sandbox._local_config import (
    NOBODY,
    Containment,
    LocalSandboxConfig,
    check_env,
    plan_containment,
)
from engine.sandbox._local_store import (
    UIDS,
    SandboxRecord,
    claim_uid,
    destroy,
    matching_records,
)
from engine.sandbox._paths import read_beneath, write_beneath
from engine.sandbox._spawn import Supervisor, run_command
from engine.sandbox.base import (
    MANAGED_LABEL,
    SANDBOX_ID_LABEL,
    Endpoint,
    ExecResult,
    SandboxLimits,
    attribute_end,
    command_argv,
    validate_labels,
    validate_selector,
)

__all__ = ["Containment", "LocalSandbox", "LocalSandboxConfig", "LocalSandboxProvider"]


class LocalSandbox:
    """A sandbox made by :class:`LocalSandboxProvider`."""

    def __init__(
        self,
        *,
        sandbox_id: str,
        labels: Mapping[str, str],
        limits: SandboxLimits,
        config: LocalSandboxConfig,
        containment: Containment,
        supervisor: Supervisor,
    ) -> None:
        self._id = sandbox_id
        self._supervisor = supervisor
        self._labels = MappingProxyType(dict(labels))
        self._limits = limits
        self._config = config
        self._containment = containment
        self._dir = config.root / sandbox_id
        self._workdir = self._dir / "work"
        self._tmpdir = self._dir / "tmp"
        self._state: Literal["new", "running", "stopping", "stopped"] = "new"
        self._record = SandboxRecord(
            id=sandbox_id,
            labels=dict(labels),
            path=str(self._dir),
            identity=containment.identity,
            owner=f"{socket.gethostname()}:{os.getpid()}",
            created_at=time.time(),
        )
        self._cgroup: SandboxCgroup | None = None
        self._netns: NetnsRef | None = None
        self._forwarders: list[Forwarder] = []
        self._exec_count = 0
        self._created = False
        self._start_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"LocalSandbox(id={self._id!r}, state={self._state}, workdir={str(self._workdir)!r})"

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
        return str(self._workdir)

    @property
    def path(self) -> Path:
        return self._dir

    @property
    def uid(self) -> int | None:
        """The uid commands run as, or ``None`` when they run as the worker's uid."""
        return self._record.uid

    @property
    def cgroup(self) -> SandboxCgroup | None:
        return self._cgroup

    @property
    def network_holder_pid(self) -> int | None:
        """The root process that keeps the sandbox's network namespace (``None``: none)."""
        return None if self._netns is None else self._netns.pid

    @property
    def network_namespace(self) -> str | None:
        """``/proc/PID/ns/net`` of the sandbox's network namespace (``None``: the host's)."""
        return None if self._netns is None else self._netns.path

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._state == "running":
                return
            if self._state != "new":
                raise SandboxError(f"sandbox {self._id} is {self._state} and cannot start again")
            try:
                await asyncio.to_thread(self._allocate)
                if self._containment.network:
                    await self._hold_network_namespace()
            except BaseException as exc:
                if self._created:
                    await destroy(self._record, uids_dir=self._uids_dir, root=self._config.root)
                self._state = "stopped"
                if isinstance(exc, SandboxError | ConfigError):
                    raise
                if isinstance(exc, OSError):
                    raise SandboxError(f"could not start sandbox {self._id}: {exc}") from exc
                raise
            self._state = "running"

    @property
    def _uids_dir(self) -> Path:
        return self._config.root / UIDS

    def _allocate(self) -> None:
        root = self._config.root
        root.mkdir(parents=True, exist_ok=True)
        identity = self._containment.identity
        if identity != "inherit":
            if root.stat().st_uid == os.geteuid():
                os.chmod(root, 0o711)
            self._check_traversable(root)
        self._dir.mkdir(mode=0o711)
        self._created = True
        os.chmod(self._dir, 0o711)
        self._record.save()  # from here on reap() can find and remove it
        if identity == "dedicated":
            self._record.uid = self._record.gid = claim_uid(
                self._uids_dir, self._id, self._config.uid_base, self._config.uid_count
            )
        elif identity == "nobody":
            self._record.uid = self._record.gid = NOBODY
        for directory in (self._workdir, self._tmpdir):
            directory.mkdir(mode=0o700)
            if self._record.uid is not None and self._record.gid is not None:
                os.chown(directory, self._record.uid, self._record.gid)
        layout = self._containment.cgroup
        if layout is not None:
            try:
                self._cgroup = SandboxCgroup.create(layout, self._id, self._limits)
                self._record.cgroup = self._cgroup.to_json()
            except OSError as exc:
                if self._config.cgroups == "required":
                    raise SandboxError(f"sandbox {self._id}: {exc}") from exc
        self._record.save()

    async def _hold_network_namespace(self) -> None:
        environment = {
            "PATH": "/usr/bin:/bin",
            _procs.SANDBOX_MARKER: self._id,
            _procs.EXEC_MARKER: f"{self._id}/netns",
        }
        spawned = await self._supervisor.spawn_detached(
            argv=[self._config.python, "-I", "-S", "-c", _HOLD],
            env=environment,
            spec={"new_netns": True, "cwd": "/", "no_new_privs": True},
        )
        self._record.pgids.append(spawned)
        await asyncio.to_thread(self._record.save)
        try:
            netns = NetnsRef.of(spawned)
        except OSError as exc:
            raise SandboxError(
                f"sandbox {self._id}: its network namespace holder died: {exc}"
            ) from exc
        if netns.ino == os.stat("/proc/self/ns/net").st_ino:
            raise SandboxError(f"sandbox {self._id}: the holder did not get a network namespace")
        self._netns = netns

    async def expose(self, endpoint: Endpoint) -> str:
        self._require_running(f"expose {endpoint.target}")
        if self._netns is None:
            raise SandboxError(
                f"sandbox {self._id} has no network namespace of its own (its commands share "
                f"the host's network: {self._containment.describe()}), so there is no inside "
                f"to expose {endpoint.target} in"
            )
        self._forwarders.append(await forward(self._netns, endpoint))
        return f"127.0.0.1:{endpoint.port}"

    async def _close_forwarders(self) -> None:
        forwarders, self._forwarders = self._forwarders, []
        for forwarder in forwarders:
            await forwarder.close()

    def _check_traversable(self, root: Path) -> None:
        for directory in [root, *root.parents]:
            if not directory.stat().st_mode & stat.S_IXOTH:
                raise ConfigError(
                    f"sandbox root {root}: {directory} is not searchable by other users "
                    "(mode lacks o+x), so the sandbox uid cannot reach its workdir; choose a "
                    "root under a world-searchable directory such as /tmp"
                )

    async def stop(self) -> None:
        async with self._start_lock:
            if self._state in ("stopped", "stopping"):
                return
            if self._state == "new":
                self._state = "stopped"
                return
            self._state = "stopping"
            await self._close_forwarders()
            on_disk = await asyncio.to_thread(SandboxRecord.load, self._dir)
            if on_disk is None:
                # Reaped by someone else: the uid may belong to a newer sandbox by now, so only
                # processes carrying this sandbox's marker may be killed.
                on_disk = SandboxRecord(
                    id=self._id, labels={}, path=str(self._dir), identity="inherit"
                )
            problems = await destroy(on_disk, uids_dir=self._uids_dir, root=self._config.root)
            self._state = "stopped"
        if problems:
            raise SandboxError(
                f"sandbox {self._id} was not fully cleaned up: {'; '.join(problems)}"
            )

    async def __aenter__(self) -> LocalSandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _require_running(self, what: str) -> None:
        if self._state != "running":
            raise SandboxError(f"cannot {what}: sandbox {self._id} is {self._state}")

    # -- files ---------------------------------------------------------------------------

    def _owner(self) -> tuple[int, int] | None:
        if self._record.uid is None or self._record.gid is None:
            return None
        return (self._record.uid, self._record.gid)

    async def read_file(self, path: str) -> bytes:
        self._require_running(f"read {path!r}")
        try:
            return await asyncio.to_thread(
                read_beneath,
                self.workdir,
                path,
                uid=self._record.uid,
                max_bytes=self._limits.max_file_bytes,
            )
        except OSError as exc:
            raise SandboxError(f"sandbox {self._id}: reading {path!r} failed: {exc}") from exc

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        self._require_running(f"write {path!r}")
        payload = data.encode() if isinstance(data, str) else bytes(data)
        if len(payload) > self._limits.max_file_bytes:
            raise SandboxError(
                f"sandbox {self._id}: {len(payload)} bytes for {path!r} exceed the "
                f"{self._limits.max_file_bytes}-byte file limit"
            )
        try:
            await asyncio.to_thread(
                write_beneath, self.workdir, path, payload, mode=mode, owner=self._owner()
            )
        except OSError as exc:
            raise SandboxError(f"sandbox {self._id}: writing {path!r} failed: {exc}") from exc

    # -- commands ------------------------------------------------------------------------

    def _environment(self, env: Mapping[str, str] | None, number: int) -> dict[str, str]:
        if env is not None:
            check_env(env, f"exec in sandbox {self._id}")
        merged = dict(self._config.base_env)
        merged.update(HOME=self.workdir, TMPDIR=str(self._tmpdir), PWD=self.workdir)
        merged.update(env or {})
        merged[_procs.SANDBOX_MARKER] = self._id
        merged[_procs.EXEC_MARKER] = f"{self._id}/{number}"
        return merged

    def _rlimits(self) -> dict[str, tuple[int, int]]:
        limits = self._limits
        memory = limits.memory_mb * 2**20
        nproc = limits.max_procs
        identity = self._containment.identity
        if identity == "nobody":
            nproc += _procs.count_tasks_of_uid(NOBODY)
        elif identity == "inherit":
            nproc += _procs.count_tasks_of_uid(os.getuid())
        wanted = {
            "RLIMIT_CPU": (limits.cpu_seconds, limits.cpu_seconds + 1),
            "RLIMIT_DATA": (memory, memory),
            "RLIMIT_NPROC": (nproc, nproc),
            "RLIMIT_CORE": (0, 0),
        }
        if limits.disk_mb is not None:
            size = limits.disk_mb * 2**20
            wanted["RLIMIT_FSIZE"] = (size, size)
        if os.geteuid() != 0:  # an unprivileged worker cannot raise a hard limit
            for name, (soft, hard) in list(wanted.items()):
                _, current_hard = resource.getrlimit(getattr(resource, name))
                if current_hard != resource.RLIM_INFINITY and hard > current_hard:
                    wanted[name] = (min(soft, current_hard), current_hard)
        return wanted

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult:
        self._require_running(f"exec {cmd!r}")
        argv = command_argv(cmd)
        timeout = self._limits.effective_timeout(timeout_s)
        self._exec_count += 1
        number = self._exec_count
        environment = self._environment(env, number)
        stdin_bytes = stdin.encode() if isinstance(stdin, str) else stdin
        group = self._cgroup

        def prepare() -> tuple[list[str], dict[str, tuple[int, int]], CgroupCounters | None]:
            if group is None:
                return [], self._rlimits(), None
            return group.exec_group(number), self._rlimits(), group.counters()

        try:
            cgroup_procs, rlimits, before = await asyncio.to_thread(prepare)
        except OSError as exc:
            raise SandboxError(f"sandbox {self._id}: preparing exec {number}: {exc}") from exc
        return await self._run(
            argv,
            number=number,
            timeout=timeout,
            environment=environment,
            stdin=stdin_bytes,
            spec={
                "cgroup_procs": cgroup_procs,
                "rlimits": rlimits,
                "uid": self._record.uid,
                "gid": self._record.gid,
                "cwd": self.workdir,
                "no_new_privs": True,
                "netns": None if self._netns is None else self._netns.to_json(),
            },
            before=before,
        )

    async def _record_pgid(self, pgid: int) -> None:
        self._record.pgids.append(pgid)
        try:
            await asyncio.to_thread(self._record.save)
        except OSError:
            pass  # reaped under our feet; the exec still runs and stop() reports it

    async def _run(
        self,
        argv: list[str],
        *,
        number: int,
        timeout: float,
        environment: dict[str, str],
        stdin: bytes | None,
        spec: dict[str, object],
        before: CgroupCounters | None,
    ) -> ExecResult:
        try:
            finished = await run_command(
                self._supervisor,
                argv=argv,
                env=environment,
                spec=spec,
                stdin=stdin,
                timeout=timeout,
                max_output_bytes=self._limits.max_output_bytes,
                drain_grace_s=self._config.drain_grace_s,
                on_started=self._record_pgid,
                kill=lambda pgid: self._kill_exec(number, pgid),
            )
        except SandboxError as exc:
            raise SandboxError(f"sandbox {self._id}: could not run {argv[0]!r}: {exc}") from exc
        finally:
            if self._cgroup is not None:
                self._cgroup.release_exec(number)
        if self._state != "running":
            raise SandboxError(
                f"sandbox {self._id} was stopped while {argv[0]!r} was running (exec {number})"
            )
        status = finished.status
        exit_code = 128 - status if status < 0 else status
        stderr = finished.stderr.text()
        diagnostics = {"exec": str(number)}
        oom_killed = pids_exhausted = False
        if self._cgroup is not None and before is not None:
            after = self._cgroup.counters()
            oom = after.oom_kills - before.oom_kills
            pids = after.pids_max_hits - before.pids_max_hits
            diagnostics.update(cgroup_oom_kills=str(oom), cgroup_pids_max_hits=str(pids))
            oom_killed, pids_exhausted = oom > 0, pids > 0
        return ExecResult(
            exit_code=exit_code,
            stdout=finished.stdout.text(),
            stderr=stderr,
            stdout_truncated=finished.stdout.truncated,
            stderr_truncated=finished.stderr.truncated,
            timed_out=finished.timed_out,
            killed_by=attribute_end(
                exit_code,
                timed_out=finished.timed_out,
                stderr=stderr,
                oom_killed=oom_killed,
                pids_exhausted=pids_exhausted,
            ),
            elapsed_s=finished.elapsed_s,
            diagnostics=diagnostics,
        )

    async def _kill_exec(self, number: int, pgid: int) -> None:
        """SIGKILL the exec's processes: its cgroup, its process group, its marker carriers."""
        group = self._cgroup
        entry = _procs.marker(_procs.EXEC_MARKER, f"{self._id}/{number}")
        if group is not None:
            group.kill_exec(number)

        def find() -> set[int]:
            found = _procs.find_processes(env_entry=entry, pgids=[pgid])
            if group is not None:
                found |= group.exec_members(number)
            return found

        await _procs.kill_until_gone(find)


_HOLD = "import signal\nwhile True:\n    signal.pause()\n"  # the namespace holder


class LocalSandboxProvider:
    """Creates :class:`LocalSandbox` es under ``config.root`` and reaps them by label.

    Construction inspects the machine once; ``containment`` reports what it found. Workers on
    one machine may share a root (uids are claimed with lock files).
    """

    def __init__(self, config: LocalSandboxConfig | None = None) -> None:
        self.config = config or LocalSandboxConfig()
        self.containment = plan_containment(self.config)
        self._supervisor = Supervisor(self.config.python)

    @property
    def supervisor_pid(self) -> int | None:
        return self._supervisor.pid

    def close(self) -> None:
        """Let the supervisor go (it exits once every sandbox's processes are gone; stop the
        sandboxes first). A later exec starts a new one."""
        self._supervisor.close()

    async def __aenter__(self) -> LocalSandboxProvider:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def create(
        self, *, labels: Mapping[str, str], limits: SandboxLimits | None = None
    ) -> LocalSandbox:
        checked = validate_labels(labels)
        sandbox_id = f"sb-{secrets.token_hex(6)}"
        checked[MANAGED_LABEL] = "1"
        checked[SANDBOX_ID_LABEL] = sandbox_id
        return LocalSandbox(
            sandbox_id=sandbox_id,
            labels=checked,
            limits=limits or self.config.default_limits,
            config=self.config,
            containment=self.containment,
            supervisor=self._supervisor,
        )

    async def find(self, label_selector: Mapping[str, str]) -> list[str]:
        """Ids of the sandboxes under ``root`` that carry all of ``label_selector``."""
        selector = validate_selector(label_selector)
        return [
            meta.id
            for meta in await asyncio.to_thread(matching_records, self.config.root, selector)
        ]

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        selector = validate_selector(label_selector)
        metas = await asyncio.to_thread(matching_records, self.config.root, selector)
        problems: list[str] = []
        for meta in metas:
            problems += await destroy(meta, uids_dir=self.config.root / UIDS, root=self.config.root)
        if problems:
            raise SandboxError(f"reaping {selector} left things behind: {'; '.join(problems)}")
        return len(metas)
