"""Synthetic tool-use dialogues that teach tinylm the shape of a good episode.

Two families, in the bundled tasks' templates (the engine's ``engine/tasks/data``) and
rendered with the system prompts and tool specs the bundled agents really use, so the model is
trained on the context it is served in. The prompts are the caller's (:class:`SystemPrompts`):
tinylm imports nothing from the engine, whose side passes its agents' prompts in. The model's
job is a short copy from the request; the generator draws its own numbers and names from the
seed (never the bundled items):

- **math** (tool ``python``, arguments ``{"code": str}``): "Compute 38 plus 6.", "What is
  26 * 15?", "Calculate 12 - 5." and the like; the assistant calls ``print(38 + 6)``, the tool
  answers ``44``, and the assistant copies it into ``<answer>44</answer>``;
- **shell** (tool ``shell``, arguments ``{"cmd": str}``): "Create a directory named X."
  (``mkdir X``), "Write the number K into F." (``echo K > F``), "Create an empty file named F."
  (``touch F``), "Create numbers.txt with the numbers 1 to K, one per line."
  (``seq 1 K > numbers.txt``), "Create a file named F that contains exactly the word W."
  (``echo W > F``); the tool answers ``(no output)`` and the assistant replies
  ``<answer>done</answer>``.

Some dialogues continue with follow-up requests of the same family, which gives each training
sequence more copy examples per pass over the long system turn. Everything is drawn from
``random.Random(seed)``: the same seed gives the same dialogues, in the same order.
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
    "SystemPrompts",
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


@dataclass(frozen=True, slots=True)
class SystemPrompts:
    """The system prompts of the agents the model will be served to, one per family."""

    math: str
    shell: str


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


def _with_system(
    rng: random.Random, prompts: list[tuple[str | None, float]]
) -> list[dict[str, Any]]:
    """A system turn drawn from ``(prompt, weight)`` pairs (``None``: no system turn)."""
    prompt = rng.choices([p for p, _ in prompts], weights=[w for _, w in prompts])[0]
    return [] if prompt is None else [{"role": "system", "content": prompt}]


def _system_choices(served: str) -> list[tuple[str | None, float]]:
    # The agents' own system prompt is the most likely: a tiny model copes best with the
    # exact context it will be served in.
    return [(served, 0.9), (None, 0.05), ("You are a helpful assistant.", 0.05)]


# (question template, operator); the python call is ``print({a} {op} {b})``.
_MATH_FORMS: list[tuple[str, str]] = [
    ("Compute {a} plus {b}.", "+"),
    ("Compute {a} minus {b}.", "-"),
    ("Compute {a} times {b}.", "*"),
    ("What is {a} + {b}?", "+"),
    ("What is {a} - {b}?", "-"),
    ("What is {a} * {b}?", "*"),
    ("Calculate {a} + {b}.", "+"),
    ("Calculate {a} - {b}.", "-"),
    ("Calculate {a} * {b}.", "*"),
    ("What is the sum of {a} and {b}?", "+"),
    ("What is {a} minus {b}?", "-"),
]


def _number(rng: random.Random) -> int:
    return rng.randint(1, 99) if rng.random() < 0.9 else rng.randint(100, 999)


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


def _tasks(rng: random.Random) -> int:
    """How many tasks one dialogue holds: often one (the served shape), else follow-ups.

    Follow-up requests in the same conversation reuse the long system turn, so each training
    sequence carries several copy-the-request examples for little extra compute.
    """
    return 1 if rng.random() < _SINGLE_TASK else rng.randint(2, _MAX_TASKS)


_SINGLE_TASK = 0.4
_MAX_TASKS = 4


def _math_turns(rng: random.Random) -> list[dict[str, Any]]:
    question, op = rng.choice(_MATH_FORMS)
    a, b = _number(rng), _number(rng)
    if op == "-" and b > a and rng.random() < 0.8:
        a, b = b, a
    expr = f"{a} {op} {b}"
    result = _evaluate(expr)
    return [
        {"role": "user", "content": question.format(a=a, b=b)},
        _call("python", {"code": f"print({expr})"}),
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": f"<answer>{result}</answer>"},
    ]


def math_dialogue(rng: random.Random, prompts: SystemPrompts) -> Dialogue:
    """A question, one ``python`` call copying its operands, the output, the boxed answer
    (sometimes followed by more questions in the same conversation)."""
    messages = _with_system(rng, _system_choices(prompts.math))
    for _ in range(_tasks(rng)):
        messages += _math_turns(rng)
    return Dialogue(messages=messages, tools=[PYTHON_TOOL])


# Names to create and words to write; unseen ones are copied piece by piece, so variety (and
# the odd digit suffix) matters more than any particular word.
_WORDS = (
    "alpha apple amber anchor answer atlas autumn banana beta blue bravo bread bridge build "
    "cache candle carbon cedar cherry cloud cobalt coffee comet copper coral cotton count data "
    "delta desert dist docs done echo ember falcon fern flame forest frost garden gamma ginger "
    "glass grape green greeting harbor hazel hello honey indigo iron ivory jade jasper kernel "
    "kiwi lemon lib lime logs mango maple marble meadow melon memo mint moon nectar noble note "
    "ocean ok olive onion orange orbit out output paper peach pearl pepper pixel plum pine "
    "quartz queue radar raven ready river robin ruby salt sand silver slate solar spark spruce "
    "src star stone storm sugar summer tango temp tiger tmp topaz tulip union vapor velvet "
    "violet walnut water willow winter world yellow zebra zinc"
).split()
_EXTENSIONS = [".txt", ".txt", ".flag", ".log"]


def _name(rng: random.Random) -> str:
    word = rng.choice(_WORDS)
    return f"{word}{rng.randint(1, 9)}" if rng.random() < 0.15 else word


def _file(rng: random.Random, extensions: list[str] = _EXTENSIONS) -> str:
    return _name(rng) + rng.choice(extensions)


def _shell_task(rng: random.Random) -> tuple[str, str]:
    """One task in the bundled shell templates: ``(request, command that does it)``."""
    kind = rng.randrange(5)
    if kind == 0:
        name = _name(rng)
        return f"Create a directory named {name}.", f"mkdir {name}"
    if kind == 1:
        fname, n = _file(rng, [".txt"]), _number(rng)
        return f"Write the number {n} into {fname}.", f"echo {n} > {fname}"
    if kind == 2:
        fname = _file(rng)
        return f"Create an empty file named {fname}.", f"touch {fname}"
    if kind == 3:
        k = rng.randint(2, 20)
        return (
            f"Create numbers.txt with the numbers 1 to {k}, one per line.",
            f"seq 1 {k} > numbers.txt",
        )
    fname, word = _file(rng, [".txt"]), rng.choice(_WORDS)
    return (
        f"Create a file named {fname} that contains exactly the word {word}.",
        f"echo {word} > {fname}",
    )


def shell_dialogue(rng: random.Random, prompts: SystemPrompts) -> Dialogue:
    """A file-system task solved by one ``shell`` command copying its names, then ``done``
    (sometimes followed by more tasks in the same conversation)."""
    messages = _with_system(rng, _system_choices(prompts.shell))
    for _ in range(_tasks(rng)):
        request, cmd = _shell_task(rng)
        messages += [
            {"role": "user", "content": request},
            _call("shell", {"cmd": cmd}),
            {"role": "tool", "content": "(no output)"},
            {"role": "assistant", "content": "<answer>done</answer>"},
        ]
    return Dialogue(messages=messages, tools=[SHELL_TOOL])


_FAMILIES: list[Callable[[random.Random, SystemPrompts], Dialogue]] = [
    math_dialogue,
    shell_dialogue,
]


def generate_dialogues(n: int, *, seed: int, prompts: SystemPrompts) -> list[Dialogue]:
    """``n`` dialogues alternating math and shell, deterministic in ``seed``."""
    rng = random.Random(seed)
    return [_FAMILIES[i % len(_FAMILIES)](rng, prompts) for i in range(n)]
