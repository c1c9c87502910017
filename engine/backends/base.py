"""The model-backend port: one structural ``Protocol`` and the record every backend returns.

Every LLM call in a rollout goes through a ``ModelBackend`` (inference-backend §1). Two modes
coexist and the agent loop picks one by reading ``supports_token_ids``:

- token-in / token-out (``SGLangBackend``): the caller passes ``input_ids``; the result carries
  the exact sampled ``token_ids`` and their ``logprobs``, so the tokens the model emitted are the
  tokens training sees (no re-tokenisation, no chat-template round trip);
- chat (``OpenAIBackend``): the caller passes ``messages`` (and ``tools``); the result carries
  text, structured ``tool_calls`` and ``usage``, but no token ids (``tokenize`` raises
  ``NotImplementedError``).

Contract shared by every implementation:

- ``generate`` is keyword-only; exactly one of ``input_ids`` / ``messages`` is given, and a
  backend that cannot take the given one raises ``NotImplementedError`` before any I/O.
- A request the server aborted is *not* an exception: it returns an empty result whose
  ``finish_reason`` is ``"abort"`` (the sample becomes a masked dummy upstream).
- Transport and protocol failures raise the ``BackendError`` subclasses of ``engine.errors``
  (``BackendUnavailable``, ``BackendHTTPError``, ``BackendProtocolError``), never httpx's.
- A backend owns one pooled HTTP client, created lazily on first use inside the running event
  loop and released by ``aclose()``; it must not be shared across event loops.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "FinishReason",
    "GenerationResult",
    "ModelBackend",
    "ToolCall",
    "Usage",
    "error_finish_reason",
]


class FinishReason(StrEnum):
    """Why a generation ended; ``GenerationResult.finish_reason`` may also be ``error:<what>``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"


def error_finish_reason(detail: str) -> str:
    """The ``error:*`` finish reason for a failure the backend reports in-band."""
    return f"error:{detail}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One structured tool call, in the OpenAI wire convention.

    ``arguments`` is the JSON text exactly as the model produced it: a model may emit invalid
    JSON, and deciding what that means is the agent's business, not the transport's.
    """

    name: str
    arguments: str
    id: str = ""

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict; ``ValueError`` naming the tool if they are not a JSON object."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"tool call {self.name!r}: arguments are not valid JSON ({exc}): "
                f"{self.arguments[:200]!r}"
            ) from exc
        if not isinstance(value, dict):
            raise ValueError(
                f"tool call {self.name!r}: arguments must be a JSON object, "
                f"got {type(value).__name__}"
            )
        return value


@dataclass(frozen=True, slots=True)
class Usage:
    """Token accounting for one call."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """What one ``generate`` call produced.

    ``token_ids`` and ``logprobs`` are set by token-level backends only and always have the same
    length; ``logprobs[i]`` is the log-probability the server assigned to ``token_ids[i]`` when it
    sampled it. ``tool_calls`` is set by chat backends when the server parsed structured calls.
    ``finish_reason`` is a ``FinishReason`` value or ``error:<what>``. Chat backends also keep
    ``refusal`` (the model declined; OpenAI's ``message.refusal``) and ``reasoning_content``
    (the thinking a reasoning parser split off, as SGLang and others return it).
    ``weight_version`` is the policy version the *server* reported for the weights that
    generated this reply (SGLang's ``meta_info.weight_version``); None when it reported none.
    """

    text: str
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    finish_reason: str = FinishReason.STOP
    usage: Usage | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    weight_version: int | None = None

    def __post_init__(self) -> None:
        if (self.token_ids is None) != (self.logprobs is None):
            raise ValueError("GenerationResult: token_ids and logprobs must be given together")
        if self.token_ids is not None and self.logprobs is not None:
            if len(self.token_ids) != len(self.logprobs):
                raise ValueError(
                    f"GenerationResult: {len(self.token_ids)} token ids but "
                    f"{len(self.logprobs)} logprobs"
                )

    @property
    def aborted(self) -> bool:
        return self.finish_reason == FinishReason.ABORT


@runtime_checkable
class ModelBackend(Protocol):
    """A prompt-to-completion engine (see the module docstring for the contract)."""

    @property
    def supports_token_ids(self) -> bool: ...

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
    ) -> GenerationResult: ...

    def tokenize(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    async def aclose(self) -> None: ...
