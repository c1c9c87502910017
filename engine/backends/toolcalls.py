"""Tool calls written in model text, Qwen2.5 / Hermes style.

A model that speaks this format writes each call as its own block::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(17 + 25)"}}
    </tool_call>

``render_tool_call`` writes exactly that block (``json.dumps`` with its default separators, the
same text the tinylm chat template renders from a structured call) and ``parse_tool_calls``
reads it back out of generated text. The tinylm server uses the parser for its OpenAI endpoint;
agents driving a token-level backend can use it on ``GenerationResult.text``.

Parsing is lenient about whitespace around the JSON and strict about its shape: a block whose
body is not an object with a string ``name`` and an object (or JSON-string) ``arguments`` is not
a call. It stays in ``content`` and its problem is listed in ``errors``, so a malformed call is
visible to whoever judges the episode instead of vanishing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.backends.base import ToolCall

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedToolCalls",
    "parse_tool_calls",
    "render_tool_call",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The block a model should emit to call ``name`` with ``arguments``."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


@dataclass(frozen=True, slots=True)
class ParsedToolCalls:
    """Text split into prose (``content``) and the well-formed calls it contained."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


def _call_from_body(body: str, call_id: str) -> ToolCall | str:
    """A ``ToolCall``, or a message saying why ``body`` is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"tool call body is not JSON ({exc.msg} at char {exc.pos}): {body[:120]!r}"
    if not isinstance(obj, dict):
        return f"tool call body must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call needs a non-empty string 'name', got {name!r}"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        # Some models put the arguments in as a JSON string, as the OpenAI wire does.
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return f"tool call {name!r}: 'arguments' must be an object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=text, id=call_id)


def parse_tool_calls(text: str, *, id_prefix: str = "call_") -> ParsedToolCalls:
    """Split ``text`` into prose and tool calls; ids are ``f"{id_prefix}{index}"``."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        parsed = _call_from_body(match.group(1).strip(), f"{id_prefix}{len(calls)}")
        kept.append(text[last : match.start()])
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
            kept.append(match.group(0))
        last = match.end()
    kept.append(text[last:])
    if TOOL_CALL_OPEN in text[last:]:
        errors.append("unterminated <tool_call> block (no </tool_call>)")
    return ParsedToolCalls(
        content="".join(kept).strip(), tool_calls=tuple(calls), errors=tuple(errors)
    )
