"""The recording proxy's token series: one per task, built call by call.

A black-box scaffold sends its whole conversation on every ``/v1/chat/completions`` call. The
``Recorder`` turns those calls into the token series the native tool agent would build for the
same conversation (``engine.agents.chat_tokens``): the first call's prompt rendered with the
chat template (``mask 0``); on each later call, the echoed assistant turn (already in the
series as the generated ids) and the observations after it, tokenized as one increment with
``ChatTokens.observation`` (``mask 0``); the generated ids verbatim with their logprobs
(``mask 1``).

Append-only guard: a call whose history shrank, whose consumed prefix was rewritten, whose
echoed turn is not the proxy's reply, or whose tools changed raises ``AppendOnlyViolation``;
the proxy then turns capture off for the task, and ``trajectory()`` gives ``None``: no token
data rather than a corrupt sample.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.agents.chat_tokens import ChatTokens, Message
from engine.agents.result import AgentResult, TurnRecord
from engine.outcomes import TerminationReason

__all__ = ["AppendOnlyViolation", "ProxyTrajectory", "Recorder", "message_signature"]


class AppendOnlyViolation(Exception):
    """The scaffold's history no longer extends what the series holds."""


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return json.dumps(content, sort_keys=True)


def _canonical(args: object) -> str:
    """Tool-call arguments as sorted JSON: the same call re-spaced is the same call."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return str(args)
    return json.dumps(args, sort_keys=True)


def _calls(message: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, Mapping) else {}
        out.append((str(fn.get("name", "")), _canonical(fn.get("arguments", ""))))
    return tuple(out)


def message_signature(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must not change in a consumed message: role, text, tool calls, tool-call id, name."""
    return (
        message.get("role"),
        _text(message.get("content")),
        _calls(message),
        message.get("tool_call_id"),
        message.get("name"),
    )


@dataclass(frozen=True, slots=True)
class ProxyTrajectory:
    """A task's token series as the proxy captured it (``AgentResult``'s token fields)."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]
    response_logprobs: tuple[float, ...]
    loss_mask: tuple[int, ...]
    turns: tuple[TurnRecord, ...]

    def agent_result(self, termination_reason: TerminationReason, *, text: str = "") -> AgentResult:
        """The ``AgentResult`` of this trajectory, ended for ``termination_reason``."""
        return AgentResult(
            prompt_token_ids=self.prompt_token_ids,
            response_token_ids=self.response_token_ids,
            response_logprobs=self.response_logprobs,
            loss_mask=self.loss_mask,
            turns=self.turns,
            termination_reason=termination_reason,
            metrics={
                "n_turns": float(len(self.turns)),
                "generated_tokens": float(sum(self.loss_mask)),
                "observation_tokens": float(len(self.loss_mask) - sum(self.loss_mask)),
            },
            text=text,
        )


@dataclass(frozen=True, slots=True)
class _Reply:
    """The assistant turn the proxy answered, as the scaffold should echo it back."""

    ids: tuple[int, ...]
    content: str
    calls: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class _Ahead:
    reply: _Reply
    closing: tuple[str, str]  # ChatTokens.closing(history before the reply)
    raw: str  # the reply's text as generated, trailing special tokens dropped


@dataclass
class Recorder:
    """Builds one task's series. Not thread-safe: one call at a time."""

    tokenizer: Any
    chat: ChatTokens | None = None
    tools_sig: str | None = None
    tools_seen: list[Any] | None = None
    consumed: list[tuple[Any, ...]] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    history: list[Message] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    last: _Reply | None = None
    valid: bool = True
    invalid_reason: str | None = None
    # ``prepare``'s work for the reply ``last``, used only while ``last`` is that reply.
    ahead: _Ahead | None = None

    def series(self) -> list[int]:
        return [*self.prompt, *self.response]

    def sync(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[int]:
        """Consume ``messages`` (a call's whole history); the exact ids to generate on.
        Raises ``AppendOnlyViolation``, leaving the series as it was, when they do not extend
        what was consumed."""
        tool_list = list(tools) if tools else None
        if self.chat is None:
            if not messages:
                raise AppendOnlyViolation("the first call has no messages")
            self.chat = ChatTokens(self.tokenizer, tools)
            self.tools_sig = json.dumps(tool_list, sort_keys=True)
            self.tools_seen = copy.deepcopy(tool_list)
            self.history = [dict(m) for m in messages]
            self.prompt = self.chat.prompt_ids(self.history)
            self.consumed = [message_signature(m) for m in messages]
            self.seen = [copy.deepcopy(dict(m)) for m in messages]
            return self.series()
        # The same tools (the usual case) compare equal without re-encoding.
        if tool_list != self.tools_seen and (
            json.dumps(tool_list, sort_keys=True) != self.tools_sig
        ):
            raise AppendOnlyViolation("the tools changed between calls")
        if len(messages) < len(self.consumed):
            raise AppendOnlyViolation(
                f"history shrank from {len(self.consumed)} to {len(messages)} messages"
            )
        # An unchanged message equals its kept deep copy without JSON work; only one that
        # differs is compared by signature (re-spaced tool-call arguments are the same).
        for i, (seen, old) in enumerate(zip(self.seen, self.consumed, strict=True)):
            if messages[i] != seen and message_signature(messages[i]) != old:
                raise AppendOnlyViolation(f"history rewritten at message {i}")
        fresh = list(messages[len(self.consumed) :])
        # Made before any state changes, so a refused call leaves the series as it was.
        fresh_sigs = [message_signature(m) for m in fresh]
        fresh_seen = [copy.deepcopy(dict(m)) for m in fresh]
        if self.last is None:
            raise AppendOnlyViolation("a new call arrived while the last one gave no reply")
        if not fresh or fresh[0].get("role") != "assistant":
            raise AppendOnlyViolation(
                f"message {len(self.consumed)} should echo the assistant reply, got "
                f"{fresh[0].get('role') if fresh else 'nothing'}"
            )
        echo = fresh[0]
        if _text(echo.get("content")).strip() != self.last.content.strip() or (
            _calls(echo) != self.last.calls
        ):
            raise AppendOnlyViolation(
                f"message {len(self.consumed)} is not the assistant reply the proxy gave"
            )
        observations = [dict(m) for m in fresh[1:]]
        if any(m.get("role") == "assistant" for m in observations):
            raise AppendOnlyViolation("an assistant message the model did not generate")
        ahead = self.ahead if self.ahead is not None and self.ahead.reply is self.last else None
        if ahead is None:
            ahead = self._ahead(self.chat, self.last)
        obs = self.chat.observation(
            self.history, self.last.ids, observations, closing=ahead.closing
        )
        self.history = [*self.history, {"role": "assistant", "content": ahead.raw}, *observations]
        self.response.extend(obs.token_ids)
        self.logprobs.extend(0.0 for _ in obs.token_ids)
        self.mask.extend(0 for _ in obs.token_ids)
        self.consumed = [*self.consumed, *fresh_sigs]
        self.seen = [*self.seen, *fresh_seen]
        self.last = self.ahead = None
        return self.series()

    def prepare(self) -> None:
        """Render ahead what the next ``sync`` needs that its messages cannot change (the
        history's closing, the reply's text), so that the work runs while the scaffold reads
        the reply rather than on the next call's path; ``sync`` does it itself otherwise."""
        if self.valid and self.chat is not None and self.last is not None and self.ahead is None:
            self.ahead = self._ahead(self.chat, self.last)

    def _ahead(self, chat: ChatTokens, last: _Reply) -> _Ahead:
        return _Ahead(last, chat.closing(self.history), chat.reply_text(last.ids))

    def generated(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        content: str,
        calls: Sequence[tuple[str, str]],
        prompt_tokens: int,
        elapsed_s: float,
        finish_reason: str,
    ) -> None:
        """Append a generation verbatim (``mask 1``) and remember the reply it became."""
        self.response.extend(int(i) for i in ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.mask.extend(1 for _ in ids)
        canonical = tuple((name, _canonical(args)) for name, args in calls)
        self.last = _Reply(tuple(int(i) for i in ids), content, canonical)
        self.turns.append(
            TurnRecord(
                index=len(self.turns),
                prompt_tokens=prompt_tokens,
                response_tokens=len(ids),
                tool_calls=tuple(name for name, _ in calls),
                elapsed_s=max(0.0, elapsed_s),
                finish_reason=finish_reason,
            )
        )

    def invalidate(self, reason: str) -> None:
        """Capture off for the rest of the task (the first reason is kept)."""
        if self.valid:
            self.valid = False
            self.invalid_reason = reason

    def trajectory(self) -> ProxyTrajectory | None:
        """The series, or ``None`` if capture was turned off or the arrays do not line up."""
        if not self.valid or not self.prompt or not self.turns:
            return None
        n = len(self.response)
        if len(self.logprobs) != n or len(self.mask) != n or sum(self.mask) == 0:
            return None
        if any(m not in (0, 1) for m in self.mask) or any(t < 0 for t in self.series()):
            return None
        if sum(t.response_tokens for t in self.turns) != sum(self.mask):
            return None
        return ProxyTrajectory(
            prompt_token_ids=tuple(self.prompt),
            response_token_ids=tuple(self.response),
            response_logprobs=tuple(self.logprobs),
            loss_mask=tuple(self.mask),
            turns=tuple(self.turns),
        )
