"""Sandboxes: where agents' commands run (the contract is in ``base``).

``LocalSandboxProvider`` runs them as contained local processes, ``DockerSandboxProvider`` in
one container per sandbox (the docker SDK is imported on first use).
"""

from engine.sandbox.base import (
    MANAGED_LABEL,
    SANDBOX_ID_LABEL,
    Endpoint,
    ExecOutcome,
    ExecResult,
    KillReason,
    Sandbox,
    SandboxLimits,
    SandboxProvider,
    classify,
    raise_for_outcome,
    sandbox_session,
)
from engine.sandbox.docker import DockerSandbox, DockerSandboxConfig, DockerSandboxProvider
from engine.sandbox.local import (
    Containment,
    LocalSandbox,
    LocalSandboxConfig,
    LocalSandboxProvider,
)

__all__ = [
    "MANAGED_LABEL",
    "SANDBOX_ID_LABEL",
    "Containment",
    "DockerSandbox",
    "DockerSandboxConfig",
    "DockerSandboxProvider",
    "Endpoint",
    "ExecOutcome",
    "ExecResult",
    "KillReason",
    "LocalSandbox",
    "LocalSandboxConfig",
    "LocalSandboxProvider",
    "Sandbox",
    "SandboxLimits",
    "SandboxProvider",
    "classify",
    "raise_for_outcome",
    "sandbox_session",
]
