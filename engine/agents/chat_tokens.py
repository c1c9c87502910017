"""Token series of a tool episode: the rendered prompt and the observation increments.

An episode keeps one token series (``TokenSeries``): the prompt rendered once by the chat
template, then, turn after turn, the model's generated tokens *verbatim* and the observation
tokens the environment adds. Generated tokens are never re-tokenized.

An observation increment, with ``H`` the conversation so far (each earlier assistant turn as
its generated text), ``M`` a marker text and ``render`` the chat template with the agent's
tools:

1. ``P = render(H, add_generation_prompt=True)``, ``A = render(H + [assistant M])``: ``A`` must
   be ``P + M + close``, ``close`` being what the template writes after an assistant message
   (``<|im_end|>\n`` for Qwen);
2. ``B = render(H + [assistant M] + tool_messages, add_generation_prompt=True)`` must start
   with ``A``; ``tail = B[len(A):]`` is the tool turn and the next generation prompt;
3. if the model's last token is a special token whose text starts ``close`` (it stopped on
   the end-of-turn token), that part of ``close`` is dropped;
4. the increment is ``tokenize(close + tail)``.

Since the increment starts right after or with a special token, the tokenizer splits the
full text at the same place, so *prompt + generated + increments* equals the tokenization of a
full re-render of the conversation, except in tokens the model emitted: its own token split
(training must see what it sampled), a turn ended on a *different* end token (kept, and still
followed by the full ``close``), and a template whose ``close`` does not begin with a special
token (none of the targeted ones). A template that is not append-only in this sense raises
``AgentError`` naming the tokenizer rather than produce an inconsistent series.
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

    def reply_text(self, generated_ids: Sequence[int]) -> str:
        """A turn's text as an assistant message of the history: special tokens kept, but not
        the trailing ones (the end of turn), which the template writes itself."""
        end = len(generated_ids)
        while end > 0 and generated_ids[end - 1] in self._special_ids:
            end -= 1
        return self.decode(generated_ids[:end], skip_special_tokens=False)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The episode's prompt: the conversation with the assistant's generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def assistant_close(self, history: Sequence[Mapping[str, Any]]) -> str:
        """What the template writes after an assistant message's content (step 1)."""
        return self.closing(history)[0]

    def closing(self, history: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
        """Step 1 for ``history``: ``close`` and the rendering ``A``. It does not depend on
        the turn, so a caller can compute it while the turn generates and pass it to
        ``observation``."""
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
        """The increment after a turn that generated ``generated_ids``; ``history`` is the
        conversation before that turn, ``closing`` its ``closing(history)`` if known."""
        close, before = self.closing(history) if closing is None else closing
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
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int | None],
    ) -> None:
        """The policy's tokens, each with its logprob and the version that sampled it."""
        if len(versions) != len(token_ids):
            raise ValueError(f"{len(versions)} versions for {len(token_ids)} generated tokens")
        self.response.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(token_ids))
        self.versions.extend(UNKNOWN_VERSION if v is None else v for v in versions)

    def observed(self, token_ids: Sequence[int]) -> None:
        self.response.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.mask.extend([0] * len(token_ids))
        self.versions.extend([UNKNOWN_VERSION] * len(token_ids))
