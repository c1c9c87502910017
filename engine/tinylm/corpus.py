"""Synthetic tool-use dialogues that teach tinylm the shape of a good episode.

Two families, matching the bundled tasks:

- **math** (tool ``python``, arguments ``{"code": str}``): the user asks e.g. "What is 17 + 25?";
  the assistant calls ``print(17 + 25)``, the tool answers ``42``, and the assistant replies
  ``The answer is <answer>42</answer>``;
- **shell** (tool ``shell``, arguments ``{"cmd": str}``): the user asks for a file with given
  content so a check script passes; the assistant runs e.g. ``echo hello > greeting.txt``
  (sometimes checks it with ``cat`` or runs the check), then replies ``<answer>done</answer>``.

Wording, numbers, system prompts and tool-response styles vary so the model learns the format,
not one string. Everything is drawn from ``random.Random(seed)``: the same seed gives the same
dialogues, in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PYTHON_TOOL",
    "SHELL_TOOL",
    "Dialogue",
    "generate_dialogues",
    "math_dialogue",
    "shell_dialogue",
]

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source to run."}},
            "required": ["code"],
        },
    },
}

SHELL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command in the task directory and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "The command line to run."}},
            "required": ["cmd"],
        },
    },
}


@dataclass(frozen=True)
class Dialogue:
    """One conversation in OpenAI message format, with the tools offered in it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def _with_system(rng: random.Random, prompts: list[str | None]) -> list[dict[str, Any]]:
    prompt = rng.choice(prompts)
    return [] if prompt is None else [{"role": "system", "content": prompt}]


_MATH_SYSTEM: list[str | None] = [
    None,
    "You are a helpful assistant.",
    "Solve the problem. Use the python tool to compute, then give the final answer inside "
    "<answer></answer>.",
    "You are a careful math assistant. Use tools when they help.",
]

# (question template, python expression template); both filled with the same numbers.
_MATH_FORMS: list[tuple[str, str]] = [
    ("What is {a} + {b}?", "{a} + {b}"),
    ("What is {a} - {b}?", "{a} - {b}"),
    ("What is {a} * {b}?", "{a} * {b}"),
    ("Compute {a} + {b}.", "{a} + {b}"),
    ("Calculate {a} * {b}.", "{a} * {b}"),
    ("What is the sum of {a} and {b}?", "{a} + {b}"),
    ("What is {a} + {b} * {c}?", "{a} + {b} * {c}"),
    ("Please compute ({a} + {b}) * {c}.", "({a} + {b}) * {c}"),
    ("What is {a} minus {b}?", "{a} - {b}"),
]

_MATH_FINALS = [
    "The answer is <answer>{r}</answer>",
    "The answer is <answer>{r}</answer>",
    "The answer is <answer>{r}</answer>",
    "<answer>{r}</answer>",
    "{expr} = {r}. The answer is <answer>{r}</answer>",
]


def _number(rng: random.Random) -> int:
    return rng.randint(1, 99) if rng.random() < 0.8 else rng.randint(100, 999)


def _evaluate(expr: str) -> int:
    """The value of a tiny ``+ - * ( )`` integer expression, without ``eval``."""
    tokens = expr.replace("(", " ( ").replace(")", " ) ").split()
    pos = 0

    def atom() -> int:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            value = add()
            pos += 1  # the closing ")"
            return value
        return int(tok)

    def mul() -> int:
        nonlocal pos
        value = atom()
        while pos < len(tokens) and tokens[pos] == "*":
            pos += 1
            value *= atom()
        return value

    def add() -> int:
        nonlocal pos
        value = mul()
        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1
            rhs = mul()
            value = value + rhs if op == "+" else value - rhs
        return value

    return add()


def math_dialogue(rng: random.Random) -> Dialogue:
    """A question, one ``python`` call, its output, and the boxed answer."""
    question, expr_form = rng.choice(_MATH_FORMS)
    nums = {"a": _number(rng), "b": _number(rng), "c": rng.randint(2, 9)}
    expr = expr_form.format(**nums)
    result = _evaluate(expr)
    final = rng.choice(_MATH_FINALS).format(r=result, expr=expr)
    tools = [PYTHON_TOOL] if rng.random() < 0.85 else [PYTHON_TOOL, SHELL_TOOL]
    messages = _with_system(rng, _MATH_SYSTEM) + [
        {"role": "user", "content": question.format(**nums)},
        _call("python", {"code": f"print({expr})"}),
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": final},
    ]
    return Dialogue(messages=messages, tools=tools)


_SHELL_SYSTEM: list[str | None] = [
    None,
    "You are a helpful assistant.",
    "You work in a sandbox. Use the shell tool to change files. When the task is done, reply "
    "<answer>done</answer>.",
    "You are a coding agent with a shell.",
]

_SHELL_ASKS = [
    "Make the check script pass: it expects {f} to contain '{w}'.",
    "Create a file named {f} containing the word {w}.",
    "The check script needs {f} with the text '{w}'. Make it pass.",
    "Write {w} into {f} so that check.sh passes.",
    "Make check.sh pass. It checks that {f} says {w}.",
]
_FILES = [
    "greeting.txt",
    "out.txt",
    "answer.txt",
    "hello.txt",
    "result.txt",
    "note.txt",
    "status.txt",
    "name.txt",
    "word.txt",
    "flag.txt",
]
_WORDS = [
    "hello",
    "world",
    "ok",
    "done",
    "yes",
    "ready",
    "pass",
    "tiny",
    "blue",
    "green",
    "alpha",
    "beta",
    "rollout",
    "agent",
    "success",
    "hi",
]
_QUIET_OUTPUTS = ["", "(no output)", "exit code 0"]
_SHELL_FINALS = [
    "<answer>done</answer>",
    "<answer>done</answer>",
    "Created {f}. <answer>done</answer>",
    "The check passes now. <answer>done</answer>",
]


def shell_dialogue(rng: random.Random) -> Dialogue:
    """A file-content task solved with ``echo``, optionally verified, then ``done``."""
    fname, word = rng.choice(_FILES), rng.choice(_WORDS)
    tools = [SHELL_TOOL] if rng.random() < 0.85 else [SHELL_TOOL, PYTHON_TOOL]
    messages = _with_system(rng, _SHELL_SYSTEM) + [
        {"role": "user", "content": rng.choice(_SHELL_ASKS).format(f=fname, w=word)},
        _call("shell", {"cmd": f"echo {word} > {fname}"}),
        {"role": "tool", "content": rng.choice(_QUIET_OUTPUTS)},
    ]
    check = rng.random()
    if check < 0.25:
        messages += [_call("shell", {"cmd": f"cat {fname}"}), {"role": "tool", "content": word}]
    elif check < 0.45:
        messages += [_call("shell", {"cmd": "sh check.sh"}), {"role": "tool", "content": "PASS"}]
    messages.append({"role": "assistant", "content": rng.choice(_SHELL_FINALS).format(f=fname)})
    return Dialogue(messages=messages, tools=tools)


_FAMILIES: list[Callable[[random.Random], Dialogue]] = [math_dialogue, shell_dialogue]


def generate_dialogues(n: int, *, seed: int) -> list[Dialogue]:
    """``n`` dialogues alternating math and shell, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [_FAMILIES[i % len(_FAMILIES)](rng) for i in range(n)]
