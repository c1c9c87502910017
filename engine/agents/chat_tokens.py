"""Token series of a tool episode: the rendered prompt and the observation increments.

The agent keeps one token series per episode (``TokenSeries``): the prompt rendered once by
the chat template, then, turn after turn, the model's generated tokens *verbatim* and
the observation tokens the environment adds. Generated tokens are never re-tokenized; only the
text the environment contributes goes through the tokenizer.

How an observation increment is computed, with ``H`` the conversation so far (prompt messages,
and each earlier assistant turn as ``{"role": "assistant", "content": <generated text>}`` plus
its tool messages), ``M`` a marker text and ``render`` the tokenizer's chat template with the
agent's tools:

1. ``P = render(H, add_generation_prompt=True)`` and
   ``A = render(H + [assistant M])``: ``A`` must be ``P + M + close``, where ``close`` is what
   the template writes after an assistant message's content (``<|im_end|>\\n`` for Qwen);
2. ``B = render(H + [assistant M] + tool_messages, add_generation_prompt=True)`` must start with
   ``A``; ``tail = B[len(A):]`` is the tool turn (``<tool_response>`` wrappers) and the next
   generation prompt;
3. if the model's last token is a special token whose text starts ``close`` (it emitted the
   end-of-turn token, as a model stopping on EOS does), that part of ``close`` is dropped;
4. the increment is ``tokenize(close + tail)``.

Because the increment starts right after a special token or with one (``<|im_end|>`` is a
special token in every template this targets), the tokenizer splits the full text at the same
place, so *prompt + generated + increments* equals the tokenization of a full re-render of the
conversation in which each assistant message's content is the text the model generated. The
deviations, all confined to tokens the model emitted:

- the model's own token split can differ from what the tokenizer would produce for the same
  text (it sampled those tokens; training must see them);
- a turn that ends on a *different* end token (e.g. ``<|endoftext|>``) keeps that token and is
  still followed by the full ``close``;
- a template whose ``close`` does not begin with a special token (none of the targeted ones)
  could tokenize the join differently from a re-render.

A template that is not append-only in this sense (``A`` not extending ``P`` around ``M``, or
``B`` not extending ``A``) cannot be captured token-exactly: ``ChatTokens`` raises
``AgentError`` naming the tokenizer instead of producing a silently inconsistent series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.agents.result import UNKNOWN_VERSION
from engine.errors import AgentError

__all__ = ["ChatTokens", "Message", "Observation", "TokenSeries"]

Message = dict[str, Any]

# Text no chat template adds or strips; it only has to be found again in the rendering.
_MARKER = "\u2063probe-assistant-content\u2063"


@dataclass(frozen=True, slots=True)
class Observation:
    """An observation increment: its text (what the template adds) and its token ids."""

    text: str
    token_ids: tuple[int, ...]


class ChatTokens:
    """Renders and tokenizes one tokenizer's chat template with a fixed set of tools."""

    def __init__(self, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self._special_ids = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", []))

    @property
    def name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__)

    def render(self, messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        if not isinstance(text, str):
            raise AgentError(
                f"tokenizer {self.name}: apply_chat_template(tokenize=False) returned "
                f"{type(text).__name__}, expected str"
            )
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the template wrote it (no BOS/EOS added)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The episode's prompt: the conversation with the assistant's generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def assistant_close(self, history: Sequence[Mapping[str, Any]]) -> str:
        """What the template writes after an assistant message's content (step 1)."""
        return self._close(history)[0]

    def closing(self, history: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """Step 1 for ``history`` (``close`` and the rendering ``A``): the part of an
        observation that does not depend on the turn's tokens or tool messages, so a caller
        can compute it ahead of time (while the turn generates) and pass it to
        ``observation`` as ``closing``."""
        return self._close(history)

    def _close(self, history: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """``close``, and the rendering ``A`` of ``history`` plus the marker message."""
        opened = self.render(history, generation_prompt=True)
        closed = self.render([*history, _assistant(_MARKER)], generation_prompt=False)
        if not closed.startswith(opened + _MARKER):
            raise AgentError(
                f"tokenizer {self.name}: the chat template does not render an assistant message "
                "as the generation prompt followed by its content, so generated tokens cannot "
                "be appended to the prompt token-exactly"
            )
        return closed[len(opened) + len(_MARKER) :], closed

    def observation(
        self,
        history: Sequence[Mapping[str, Any]],
        generated_ids: Sequence[int],
        tool_messages: Sequence[Mapping[str, Any]],
        *,
        closing: tuple[str, str] | None = None,
    ) -> Observation:
        """The increment after a turn whose tokens were ``generated_ids`` (see the module
        docstring); ``history`` is the conversation before that turn. ``closing`` is
        ``closing(history)`` computed earlier (the same value; it saves two renders)."""
        close, before = self._close(history) if closing is None else closing
        after = self.render([*history, _assistant(_MARKER), *tool_messages], generation_prompt=True)
        if not after.startswith(before):
            raise AgentError(
                f"tokenizer {self.name}: adding tool messages changes how the chat template "
                "renders the earlier conversation, so the observation cannot be appended "
                "token-exactly"
            )
        if generated_ids and int(generated_ids[-1]) in self._special_ids:
            last = self.decode([generated_ids[-1]], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last) :]
        text = close + after[len(before) :]
        return Observation(text=text, token_ids=tuple(self.encode(text)))


def _assistant(content: str) -> Message:
    return {"role": "assistant", "content": content}


@dataclass
class TokenSeries:
    """One episode's token series: the prompt, then generated tokens (loss mask 1, their
    logprobs and weight version) and observed ones (mask 0, logprob 0.0, version unknown)."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token; -1: none/unknown

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)

    def ids(self) -> list[int]:
        return [*self.prompt, *self.response]

    def generated(
        self, token_ids: Sequence[int], logprobs: Sequence[float], version: int | None
    ) -> None:
        self.response.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(token_ids))
        self.versions.extend([UNKNOWN_VERSION if version is None else version] * len(token_ids))

    def observed(self, token_ids: Sequence[int]) -> None:
        self.response.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.mask.extend([0] * len(token_ids))
        self.versions.extend([UNKNOWN_VERSION] * len(token_ids))
