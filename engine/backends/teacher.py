"""``TeacherBackend``: a frozen teacher model on its own SGLang server.

The teacher speaks its own chat template, so it loads its own tokenizer (CPU only, local files
only). It never acts in the environment. Two roles are foreseen:

- **Role B** (implemented): ``score_response`` force-decodes a kept student trajectory and
  returns, for every student-emitted token, the teacher's logprob and its top-K alternatives,
  the inputs of the K3 reverse-KL term. The payload is the seed's: ``prompt + response`` as
  ``input_ids``, one greedy step, ``logprob_start_len = len(prompt) - 1``,
  ``top_logprobs_num = K``. It assumes teacher and student share a vocabulary (same model
  family), as the seed does. A failure propagates (``BackendError``): a run must fail loudly
  rather than train on missing teacher logprobs.
- **Role A** (implemented): ``label_turn`` labels one turn of a DAgger rollin. The student's
  conversation (canonical messages: an assistant message's ``<tool_call>`` blocks become
  structured ``tool_calls``) is rendered with the *teacher's* tokenizer and chat template, tools
  included, so the teacher reads it in its own format; its reply is parsed into a
  ``TeacherLabel`` (prose, canonical tool calls, and its token ids in the teacher's
  vocabulary) by its own tool-call parser (``reply_parser``; Qwen/Hermes ``<tool_call>``
  blocks unless given), so the caller can write the calls in the student's syntax. Any
  failure (transport error, timeout, HTTP error, aborted or truncated generation, a reply
  without token ids, a malformed tool-call block, a conversation its template cannot render)
  is logged and returns ``None``, "no label": the student's turn stands. The lower-level
  ``generate_from_tokens`` continues a sequence already in the teacher's format.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.backends._http import HTTPSettings
from engine.backends.base import FinishReason, ForceDecodeScore, GenerationResult, ToolCall
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.backends.toolcalls import ParsedToolCalls, parse_tool_calls
from engine.errors import BackendError, ConfigError

__all__ = [
    "DEFAULT_TOP_LOGPROBS",
    "TeacherBackend",
    "TeacherConfig",
    "TeacherLabel",
    "canonical_messages",
]

logger = logging.getLogger(__name__)

DEFAULT_TOP_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class TeacherConfig:
    """The teacher's server, tokenizer and the K of its top-K logprobs."""

    url: str
    tokenizer_path: str | Path | None = None
    top_logprobs_num: int = DEFAULT_TOP_LOGPROBS
    http: HTTPSettings = field(default_factory=HTTPSettings)

    def __post_init__(self) -> None:
        if self.top_logprobs_num < 0:
            raise ConfigError(
                f"TeacherConfig.top_logprobs_num must be >= 0, got {self.top_logprobs_num}"
            )


@dataclass(frozen=True, slots=True)
class TeacherLabel:
    """The teacher's action for one turn (Role A).

    ``text``: the reply as decoded (special tokens dropped); ``content``: its prose with the
    tool-call blocks removed; ``tool_calls``: the calls it made, canonical (name + arguments),
    so the caller can write them in the student's own format; ``token_ids``: the reply in the
    teacher's vocabulary, as the teacher's server returned them.
    """

    text: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    token_ids: tuple[int, ...]
    finish_reason: str


def canonical_messages(history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``history`` with each assistant message's ``<tool_call>`` blocks moved out of its text
    into structured ``tool_calls``, so any chat template writes them in its own syntax.

    An assistant message that already carries ``tool_calls`` is kept as it is.
    """
    out: list[dict[str, Any]] = []
    for message in history:
        item = dict(message)
        content = item.get("content")
        plain = item.get("role") == "assistant" and "tool_calls" not in item
        if plain and isinstance(content, str):
            parsed = parse_tool_calls(content)
            if parsed.tool_calls:
                item["content"] = parsed.content
                item["tool_calls"] = [
                    {
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.parsed_arguments()},
                    }
                    for call in parsed.tool_calls
                ]
        out.append(item)
    return out


class TeacherBackend:
    """Force-decoding and per-turn labelling on a frozen teacher (see the module docstring)."""

    def __init__(
        self,
        *,
        config: TeacherConfig,
        tokenizer: Any | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        reply_parser: Callable[[str], ParsedToolCalls] = parse_tool_calls,
    ) -> None:
        self.config = config
        self._parse_reply = reply_parser
        self._sglang = SGLangBackend(
            config=SGLangConfig(
                url=config.url, tokenizer_path=config.tokenizer_path, http=config.http
            ),
            tokenizer=tokenizer,
            transport=transport,
        )

    @property
    def tokenizer(self) -> Any | None:
        return self._sglang.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self._sglang.tokenize(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._sglang.decode(token_ids)

    async def score_response(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        top_logprobs_num: int | None = None,
    ) -> ForceDecodeScore:
        """Teacher logprob and top-K of every response token (Role B)."""
        k = self.config.top_logprobs_num if top_logprobs_num is None else top_logprobs_num
        return await self._sglang.score(prompt_ids, response_ids, top_logprobs_num=k)

    async def generate_from_tokens(
        self, input_ids: Sequence[int], *, sampling_params: Mapping[str, Any]
    ) -> GenerationResult:
        """Continue a prompt already rendered in the teacher's own format (Role A, low level)."""
        return await self._sglang.generate(input_ids=input_ids, sampling_params=sampling_params)

    async def label_turn(
        self,
        history: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        where: str = "teacher",
    ) -> TeacherLabel | None:
        """The teacher's action after ``history`` (Role A), or ``None`` ("no label").

        ``history`` is the student's conversation so far (system prompt, task, earlier turns
        with their tool messages), ``tools`` the tool schemas offered; both are rendered with
        the teacher's chat template. ``where`` names the turn in the log lines of a failure.
        """
        try:
            input_ids = self._sglang.render_messages(canonical_messages(history), tools)
        except Exception as exc:  # noqa: BLE001 - any template failure means "no label"
            logger.warning("%s: no label, the teacher's template cannot render it: %s", where, exc)
            return None
        try:
            gen = await self.generate_from_tokens(input_ids, sampling_params=sampling_params)
        except (BackendError, httpx.HTTPError) as exc:
            logger.warning("%s: no label, the teacher failed: %s", where, exc)
            return None
        problem = _label_problem(gen)
        if problem is not None:
            logger.warning("%s: no label, %s", where, problem)
            return None
        assert gen.token_ids is not None  # _label_problem checked it
        text = self.decode(gen.token_ids)
        parsed = self._parse_reply(text)
        if parsed.errors:
            logger.warning(
                "%s: no label, the teacher's reply has malformed tool calls: %s",
                where,
                "; ".join(parsed.errors),
            )
            return None
        return TeacherLabel(
            text=text,
            content=parsed.content,
            tool_calls=parsed.tool_calls,
            token_ids=tuple(gen.token_ids),
            finish_reason=str(gen.finish_reason),
        )

    async def aclose(self) -> None:
        await self._sglang.aclose()


def _label_problem(gen: GenerationResult) -> str | None:
    """Why ``gen`` is no usable label (``None``: it is one)."""
    if gen.aborted:
        return "the teacher's server aborted the generation"
    reason = str(gen.finish_reason)
    if reason.startswith("error:"):
        return f"the teacher's generation ended with {reason!r}"
    if reason == FinishReason.LENGTH:
        return "the teacher's reply was cut at its token budget"
    if not gen.token_ids:
        return "the teacher's reply has no token ids"
    return None
