"""Settings of the local backend, and what containment this machine allows.

:func:`plan_containment` runs once per provider: who commands run as (from the worker's euid and
the user namespace's uid map), which cgroups are usable, and whether sandboxes can get a network
namespace of their own (tried in a throwaway process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.errors import ConfigError, SandboxError
from engine.sandbox import _procs
from engine.sandbox._cgroup import CgroupLayout, detect
from engine.sandbox.base import SandboxLimits

__all__ = ["Containment", "Identity", "LocalSandboxConfig", "check_env", "plan_containment"]

NOBODY = 65534
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Identity = Literal["dedicated", "nobody", "inherit"]


def _default_root() -> Path:
    return Path(tempfile.gettempdir()) / "rollout-sandboxes"


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalSandboxConfig:
    """Settings of the local backend.

    ``identity``: ``"auto"`` is ``"dedicated"`` for a root worker whose uid range is mapped, else
    ``"nobody"`` for root, else ``"inherit"`` (the worker's uid). ``cgroups`` and ``network``:
    ``"auto"`` uses them where the machine allows (``Containment`` says what it got),
    ``"required"`` refuses to run without, ``"off"`` never uses them. ``cgroup_parent``: a
    delegated cgroup v2 directory. ``base_env``: every command's starting environment (``HOME``,
    ``TMPDIR`` and the markers are added). ``python`` runs the supervisor. ``drain_grace_s``: how
    long to keep reading output that a finished command's background processes still write.
    ``require_isolation``: ``ConfigError`` unless commands get their own network namespace and
    a uid other than the worker's.
    """

    root: Path = field(default_factory=_default_root)
    identity: Literal["auto", "dedicated", "nobody", "inherit"] = "auto"
    uid_base: int = 3_000_000
    uid_count: int = 65_536
    cgroups: Literal["auto", "off", "required"] = "auto"
    cgroup_parent: Path | None = None
    base_env: Mapping[str, str] = field(
        default_factory=lambda: {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8"}
    )
    python: str = sys.executable
    drain_grace_s: float = 1.0
    default_limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: Literal["auto", "off", "required"] = "auto"
    require_isolation: bool = False

    def __post_init__(self) -> None:
        if not self.root.is_absolute():
            raise ConfigError(f"LocalSandboxConfig.root must be absolute, got {self.root}")
        if not 1000 <= self.uid_base < 2**32 - 2 or self.uid_count < 1:
            raise ConfigError(
                f"LocalSandboxConfig.uid_base/uid_count must give uids in 1000..2**32-2, got "
                f"{self.uid_base} + {self.uid_count}"
            )
        if self.uid_base + self.uid_count >= 2**32 - 1:
            raise ConfigError(
                f"LocalSandboxConfig uid range {self.uid_base}+{self.uid_count} passes 2**32-2"
            )
        if self.drain_grace_s < 0:
            raise ConfigError(
                f"LocalSandboxConfig.drain_grace_s must be >= 0, got {self.drain_grace_s}"
            )
        check_env(self.base_env, "LocalSandboxConfig.base_env")


@dataclass(frozen=True, slots=True)
class Containment:
    """What the provider could set up on this machine, and why not the rest."""

    identity: Identity
    cgroup: CgroupLayout | None
    notes: str = ""
    network: bool = False  # each sandbox gets a network namespace of its own

    @property
    def isolated(self) -> bool:
        """Commands can neither reach the host's network nor act as the worker's uid."""
        return self.network and self.identity != "inherit"

    def describe(self) -> str:
        who = {
            "dedicated": "a dedicated uid per sandbox",
            "nobody": "uid nobody (shared)",
            "inherit": "the worker's own uid",
        }[self.identity]
        groups = self.cgroup.describe() if self.cgroup else "no cgroups"
        net = (
            "a network namespace per sandbox (loopback only)"
            if self.network
            else "the HOST'S NETWORK (they can reach every loopback service)"
        )
        text = f"commands run as {who}; {groups}; {net}"
        return f"{text} ({self.notes})" if self.notes else text


_PROBE = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.unshare(0x40000000) != 0:\n"
    "    sys.exit(os.strerror(ctypes.get_errno()))\n"
)


def probe_network_namespace(python: str) -> str | None:
    """``None`` when a process may ``unshare(CLONE_NEWNET)`` here, else why not."""
    try:
        done = subprocess.run(
            [python, "-I", "-S", "-c", _PROBE],
            capture_output=True,
            timeout=30,
            env={"PATH": DEFAULT_PATH},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not probe for network namespaces with {python}: {exc}"
    if done.returncode == 0:
        return None
    why = done.stderr.decode("utf-8", "replace").strip().splitlines()
    return f"unshare(CLONE_NEWNET) refused: {why[-1] if why else done.returncode}"


def _mapped(map_file: str, first: int, count: int) -> bool:
    try:
        lines = Path(map_file).read_text().splitlines()
    except OSError:
        return True  # no user namespaces: every id exists
    for line in lines:
        fields = line.split()
        if len(fields) == 3:
            inside, _, length = (int(value) for value in fields)
            if inside <= first and first + count <= inside + length:
                return True
    return False


def plan_containment(config: LocalSandboxConfig) -> Containment:
    notes: list[str] = []
    root = os.geteuid() == 0
    range_mapped = _mapped("/proc/self/uid_map", config.uid_base, config.uid_count) and _mapped(
        "/proc/self/gid_map", config.uid_base, config.uid_count
    )
    nobody_mapped = _mapped("/proc/self/uid_map", NOBODY, 1) and _mapped(
        "/proc/self/gid_map", NOBODY, 1
    )
    identity: Identity
    if config.identity == "auto":
        if root and range_mapped:
            identity = "dedicated"
        elif root and nobody_mapped:
            identity = "nobody"
            notes.append(f"uids {config.uid_base}+{config.uid_count} are not mapped here")
        else:
            identity = "inherit"
            if root:
                notes.append("neither the uid range nor nobody is mapped here")
    else:
        identity = config.identity
        if identity != "inherit" and not root:
            raise ConfigError(
                f"LocalSandboxConfig.identity={identity!r} needs a root worker (euid is "
                f"{os.geteuid()}); use 'inherit' or 'auto'"
            )
        if identity == "dedicated" and not range_mapped:
            raise ConfigError(
                f"LocalSandboxConfig uid range {config.uid_base}+{config.uid_count} is not "
                "mapped in /proc/self/uid_map; choose a mapped uid_base or identity='nobody'"
            )
    if root and identity == "inherit":
        notes.append("commands run as root, so RLIMIT_NPROC does not hold")
    layout: CgroupLayout | None = None
    if config.cgroups != "off":
        layout, reason = detect(config.cgroup_parent)
        if layout is None and config.cgroups == "required":
            raise ConfigError(f"LocalSandboxConfig.cgroups='required' but {reason}")
        if reason:
            notes.append(reason)
    network = False
    if config.network != "off":
        refused = probe_network_namespace(config.python)
        if refused is not None and config.network == "required":
            raise ConfigError(f"LocalSandboxConfig.network='required' but {refused}")
        if refused is not None:
            notes.append(refused)
        network = refused is None
    containment = Containment(identity, layout, "; ".join(notes), network)
    if config.require_isolation and not containment.isolated:
        raise ConfigError(
            "sandbox isolation is required (LocalSandboxConfig.require_isolation) but this "
            f"machine gives: {containment.describe()}"
        )
    return containment


def check_env(env: Mapping[str, str], what: str) -> None:
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise SandboxError(f"{what}: environment name {key!r} is not valid")
        if not isinstance(value, str) or "\0" in value:
            raise SandboxError(f"{what}: environment value of {key} must be a str without NUL")
        if key in (_procs.SANDBOX_MARKER, _procs.EXEC_MARKER):
            raise SandboxError(f"{what}: {key} is reserved for the sandbox's own bookkeeping")
