"""The model-backend port: the ``ModelBackend`` base, what a backend can do, its records.

Every LLM call in a rollout goes through a ``ModelBackend``. A backend states what it can do
in ``capabilities`` (a frozen ``Capabilities``), and callers ask that, never its class:

- ``token_ids``: ``generate(input_ids=...)`` returns the exact sampled ``token_ids`` and their
  ``logprobs``, so the tokens the model emitted are the tokens training sees (SGLang's native
  API); without it the caller passes ``messages`` (and ``tools``) and gets text, structured
  ``tool_calls`` and ``usage`` back (a chat API), and ``tokenize`` / ``decode`` raise;
- ``scoring``: ``score(prompt_ids, response_ids, top_logprobs_num=K)`` force-decodes given
  tokens and returns the logprob (and top-K) of each response token, the re-score of the
  verification boundary and the teacher's Role B;
- ``abort``: ``generate(rid=...)`` names a request and ``abort(rid)`` ends every request whose
  rid starts with ``rid`` (``None``: all of them); a backend without it ignores ``rid``;
- ``weight_version``: ``weight_version()`` is the version the server serves now;
- ``health``: ``health()`` returns once the server answers its health route
  (``generate=True``: the route that runs one generation step).

An operation a backend lacks raises ``NotImplementedError`` naming the backend and the
capability (``unsupported``) before any I/O. ``base_url`` is the server the backend talks to.
``forwarded_call()`` spans a call the caller sends to ``base_url`` by other means (the
recording proxy's pass-through), so that whatever brackets this backend's generations (a
``BackendPool``'s hooks, ``engine/backends/hooks.py``) brackets that call too.

Contract shared by every implementation:

- ``generate`` is keyword-only; exactly one of ``input_ids`` / ``messages`` is given, and a
  backend that cannot take the given one raises ``NotImplementedError`` before any I/O.
- A request the server aborted is *not* an exception: it returns a result whose
  ``finish_reason`` is ``"abort"``, holding the tokens (and their logprobs) sampled before
  the abort where the server sent them (SGLang does for a running request), so a caller can
  continue the turn from them; otherwise it is empty.
- Transport and protocol failures raise the ``BackendError`` subclasses of ``engine.errors``
  (``BackendUnavailable``, ``BackendHTTPError``, ``BackendProtocolError``), never httpx's.
- A backend owns one pooled HTTP client, created lazily on first use inside the running event
  loop and released by ``aclose()``; it must not be shared across event loops.

``ModelBackend`` is an ABC because it shares that code: no capability unless an adapter
states one, and each operation raising until the adapter offers it.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

__all__ = [
    "Capabilities",
    "FinishReason",
    "ForceDecodeScore",
    "GenerationResult",
    "ModelBackend",
    "ToolCall",
    "Usage",
    "error_finish_reason",
    "unsupported",
]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do (the module docstring says what each one offers)."""

    token_ids: bool = False
    scoring: bool = False
    abort: bool = False
    weight_version: bool = False
    health: bool = False

    def names(self) -> tuple[str, ...]:
        """The capabilities that are on, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))


class FinishReason(StrEnum):
    """Why a generation ended; ``GenerationResult.finish_reason`` may also be ``error:<what>``."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"
    # The trajectory would have spanned more weight versions than its request allows, so
    # the turn was not (or no further) generated (``BackendPool.bind(max_version_span=)``).
    VERSION_SPAN = "version_span"


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
    ``token_versions`` is set when the tokens came from more than one version (a turn
    interrupted by a weight update and continued on the new weights): per token, the
    version that sampled it, ``weight_version`` being the last one's.
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
    token_versions: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if (self.token_ids is None) != (self.logprobs is None):
            raise ValueError("GenerationResult: token_ids and logprobs must be given together")
        if self.token_ids is not None and self.logprobs is not None:
            if len(self.token_ids) != len(self.logprobs):
                raise ValueError(
                    f"GenerationResult: {len(self.token_ids)} token ids but "
                    f"{len(self.logprobs)} logprobs"
                )
        if self.token_versions is not None and len(self.token_versions) != len(
            self.token_ids or ()
        ):
            raise ValueError(
                f"GenerationResult: {len(self.token_versions)} token versions for "
                f"{len(self.token_ids or ())} token ids"
            )

    def versions(self) -> tuple[int | None, ...]:
        """Per token, the weight version that sampled it (None: not reported)."""
        if self.token_versions is not None:
            return self.token_versions
        return (self.weight_version,) * len(self.token_ids or ())

    @property
    def aborted(self) -> bool:
        return self.finish_reason == FinishReason.ABORT


@dataclass(frozen=True, slots=True)
class ForceDecodeScore:
    """Per-response-token logprobs from a force-decode; ``top_*`` are empty when K was 0."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_token_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]
    weight_version: int | None = None  # what the server reported scoring with (None: unknown)


class ModelBackend(abc.ABC):
    """A prompt-to-completion engine (see the module docstring for the contract).

    An adapter implements ``generate``, sets ``base_url`` and its ``capabilities``, and
    overrides the operations those capabilities offer; the others raise ``unsupported``."""

    capabilities: Capabilities = Capabilities()
    base_url: str = ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url})"

    @abc.abstractmethod
    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult: ...

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], *, top_logprobs_num: int = 0
    ) -> ForceDecodeScore:
        raise unsupported(self, "scoring")

    async def abort(self, rid: str | None = None) -> None:
        raise unsupported(self, "abort")

    async def weight_version(self) -> int | None:
        raise unsupported(self, "weight_version")

    async def health(self, *, generate: bool = False) -> None:
        raise unsupported(self, "health")

    def forwarded_call(self) -> AbstractAsyncContextManager[None]:
        """Nothing brackets a bare backend's calls."""
        return nullcontext()

    def tokenize(self, text: str) -> list[int]:
        raise unsupported(self, "token_ids")

    def decode(self, token_ids: Sequence[int]) -> str:
        raise unsupported(self, "token_ids")

    async def aclose(self) -> None:
        return None


def unsupported(backend: ModelBackend, capability: str) -> NotImplementedError:
    """The error of an operation ``backend`` lacks the ``capability`` for."""
    offers = ", ".join(backend.capabilities.names()) or "none"
    return NotImplementedError(
        f"{backend!r} has no {capability} capability (it offers: {offers})"
    )
