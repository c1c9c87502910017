"""The recording proxy: black-box OpenAI-chat scaffolds in front of a token-level model server.

``RecordingProxy`` serves ``/v1/chat/completions`` and ``/v1/models`` for one task and records
the conversation as the token series the native tool agent would build (docs/agents.md).
"""

from engine.proxy.series import AppendOnlyViolation, ProxyTrajectory, Recorder, message_signature
from engine.proxy.server import RecordingProxy

__all__ = [
    "AppendOnlyViolation",
    "ProxyTrajectory",
    "Recorder",
    "RecordingProxy",
    "message_signature",
]
