"""The server side's tool-call parser: ``<tool_call>`` blocks in generated text.

tinylm's chat template (``chat_template.py``) renders a call as::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(17 + 25)"}}
    </tool_call>

and the OpenAI endpoint (``chat.py``) reads such blocks back out of what the model wrote, as
SGLang's own parser does for a real model. A block counts as a call when its body is a JSON
object with a non-empty string ``name`` and ``arguments`` that is an object or a JSON string
(absent: ``{}``); any other block stays in the prose, so a malformed call is visible to the
client instead of vanishing. ``arguments`` is returned as JSON text, the OpenAI wire form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["CLOSE", "OPEN", "FunctionCall", "split_tool_calls"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class FunctionCall:
    id: str
    name: str
    arguments: str  # JSON text


def _as_call(body: str, call_id: str) -> FunctionCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    elif not isinstance(arguments, str):
        return None
    return FunctionCall(id=call_id, name=name, arguments=arguments)


def split_tool_calls(text: str, *, id_prefix: str) -> tuple[str, list[FunctionCall]]:
    """``(prose, calls)``: the text without its well-formed blocks (stripped), and the calls
    in order, with ids ``f"{id_prefix}{n}"``."""
    prose: list[str] = []
    calls: list[FunctionCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:  # unterminated: stays in the prose
            break
        after = end + len(CLOSE)
        call = _as_call(text[start + len(OPEN) : end].strip(), f"{id_prefix}{len(calls)}")
        if call is None:
            prose.append(text[pos:after])
        else:
            prose.append(text[pos:start])
            calls.append(call)
        pos = after
    prose.append(text[pos:])
    return "".join(prose).strip(), calls
