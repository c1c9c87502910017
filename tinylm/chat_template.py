"""The tinylm chat template: Qwen2.5's rendered format, tools included.

Rendered shape (what the tokenizer's ``apply_chat_template`` produces and the model is trained
on)::

    <|im_start|>system
    {system prompt}

    # Tools
    ...
    <tools>
    {"type": "function", "function": {...}}
    </tools>
    ...<|im_end|>
    <|im_start|>user
    What is 17 + 25?<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "python", "arguments": {"code": "print(17 + 25)"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    42
    </tool_response><|im_end|>
    <|im_start|>assistant
    The answer is <answer>42</answer><|im_end|>

- The system turn lists the tools (each as one JSON line) and how to call them; with tools and
  no system message a default system prompt is used.
- An assistant turn with ``tool_calls`` renders its content (if any) and then one
  ``<tool_call>`` block per call; ``arguments`` may be a dict or the OpenAI wire's JSON string,
  and a dict renders as ``json.dumps`` writes it (the engine's ``render_tool_call`` writes
  the same text; a test holds the two equal).
- Consecutive ``tool`` messages share one user turn, each wrapped in ``<tool_response>``.
- ``add_generation_prompt`` ends the text with ``<|im_start|>assistant\\n``, so a generation
  starts right where the assistant's content starts.

The template is written with ``{%-``/``-%}`` everywhere and explicit ``'\\n'`` strings, so the
rendered text does not depend on Jinja's ``trim_blocks``/``lstrip_blocks`` settings.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHAT_TEMPLATE", "DEFAULT_SYSTEM_PROMPT", "render_chat"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

_TOOLS_PREAMBLE = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to help with the user query."
    "\\nThe function signatures are inside <tools></tools> tags:\\n<tools>"
)
_TOOLS_EPILOGUE = (
    "\\n</tools>\\n\\nFor each function call, write a JSON object with the function name and "
    "its arguments inside <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
)

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=none, start=0) -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set ns.system = messages[0].content -%}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{{- ns.system if ns.system is not none else '" + DEFAULT_SYSTEM_PROMPT + "' -}}"
    "{{- '" + _TOOLS_PREAMBLE + "' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '" + _TOOLS_EPILOGUE.replace("'", "\\'") + "<|im_end|>\\n' -}}"
    "{%- elif ns.system is not none -%}"
    "{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages[ns.start:] -%}"
    "{%- if m.role == 'user' or m.role == 'system' -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if m.tool_calls -%}"
    "{%- if m.content -%}{{- '\\n' + m.content -}}{%- endif -%}"
    "{%- for call in m.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- else -%}{{- '\\n' + (m.content or '') -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + (m.content | string) + '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- raise_exception('tinylm chat template: unknown role ' ~ m.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """Render without a tokenizer (used to train the tokenizer itself).

    Gives the same text as ``tokenizer.apply_chat_template(..., tokenize=False)``: the template
    only needs a ``tojson`` filter that writes like ``json.dumps`` with ``ensure_ascii=False``.
    """
    return _compiled().render(
        messages=list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
    )


@functools.cache
def _compiled() -> Template:
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(CHAT_TEMPLATE)


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _raise(message: str) -> None:
    raise TemplateError(message)
