"""mini-swe-agent environment that runs each action in the task's sandbox.

Selected with ``environment_class: rollout_sandbox_env.SandboxEnvironment``, it sends each
command to the engine's command bridge over a Unix socket (one JSON line
``{"command", "timeout"}`` in, ``{"output", "returncode", "exception_info"}`` out), so the
scaffold never touches the host's files. A command whose output starts with the line
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` and that exits 0 ends the run (``Submitted``), as in
mini-swe-agent's own protocol.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from minisweagent.exceptions import Submitted

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironment:
    """``execute`` through the bridge at ``bridge`` (``unix:/path``)."""

    def __init__(
        self,
        *,
        bridge: str,
        timeout: int = 30,
        env: dict[str, str] | None = None,
        cwd: str = "",
        **_ignored: Any,
    ) -> None:
        if not bridge.startswith("unix:"):
            raise ValueError(f"bridge must be 'unix:/path', got {bridge!r}")
        self.config = {"bridge": bridge, "timeout": timeout, "env": dict(env or {}), "cwd": cwd}

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        request = {
            "command": str(action.get("command", "")),
            "timeout": timeout or self.config["timeout"],
            "env": self.config["env"],
        }
        try:
            output = self._call(request)
        except OSError as exc:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"the sandbox could not run the command: {exc}",
            }
        self._check_finished(output)
        return output

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        path = str(self.config["bridge"])[len("unix:") :]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            sock.sendall(json.dumps(request).encode() + b"\n")
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        reply = json.loads(b"".join(chunks))
        if not isinstance(reply, dict):
            raise OSError(f"the bridge answered {reply!r}")
        return reply

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = str(output.get("output", "")).lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output.get("returncode") == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {
            **self.config,
            "system": "Linux",
            "release": "",
            "version": "",
            "machine": "",
            **kwargs,
        }

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": dict(self.config),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }
