"""Sandbox tools of the native tool agent: their schemas, their commands, their observations.

A ``SandboxTool`` turns one model-written call into one sandbox command: ``python`` (argument
``code``) runs ``<python> -c <code>`` as an argv, so no shell quoting is involved; ``shell``
(argument ``cmd``) runs under ``/bin/sh -c`` in the working directory. Their schema wording is
the one the tinylm corpus trains on, so the reference model sees familiar text.

Everything the *model* can get wrong is a ``ToolCallError`` (unknown tool, arguments that are
not a JSON object, a missing or empty argument, a NUL byte): the agent shows it as an error
observation, never aborts the sample for it. Failures of the sandbox itself stay
``SandboxError`` and propagate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from engine.agents.chat_tokens import Message
from engine.backends.base import ToolCall
from engine.sandbox import ExecOutcome, ExecResult, Sandbox, classify

__all__ = [
    "PythonTool",
    "SandboxTool",
    "ShellTool",
    "ToolCallError",
    "ToolCounts",
    "clip_text",
    "render_exec",
    "resolve_call",
    "run_tool_calls",
]


class ToolCallError(ValueError):
    """A tool call the model wrote cannot be run; the message is shown to the model."""


@runtime_checkable
class SandboxTool(Protocol):
    """One tool the agent offers: a name, its schema, and the command a call becomes."""

    @property
    def name(self) -> str: ...

    def schema(self) -> dict[str, Any]:
        """The OpenAI function description the chat template renders."""
        ...

    def command(self, arguments: Mapping[str, Any]) -> str | list[str]:
        """The sandbox command for a call; ``ToolCallError`` if the arguments do not fit."""
        ...


def _function_schema(name: str, description: str, argument: str, help_text: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: {"type": "string", "description": help_text}},
                "required": [argument],
            },
        },
    }


def _string_argument(tool: str, arguments: Mapping[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolCallError(
            f"tool {tool!r} needs a string argument {key!r}, got "
            f"{'nothing' if value is None else type(value).__name__}"
        )
    if not value.strip():
        raise ToolCallError(f"tool {tool!r}: argument {key!r} is empty")
    if "\0" in value:
        raise ToolCallError(f"tool {tool!r}: argument {key!r} contains a NUL byte")
    return value


@dataclass(frozen=True, kw_only=True)
class PythonTool:
    """``python``: run a Python program with ``executable -c code`` in the sandbox."""

    executable: str = "python3"
    name: str = "python"

    def schema(self) -> dict[str, Any]:
        return _function_schema(
            self.name,
            "Run a Python program and return what it prints.",
            "code",
            "Python source to run.",
        )

    def command(self, arguments: Mapping[str, Any]) -> list[str]:
        return [self.executable, "-c", _string_argument(self.name, arguments, "code")]


@dataclass(frozen=True, kw_only=True)
class ShellTool:
    """``shell``: run a command line with ``/bin/sh -c`` in the sandbox's working directory."""

    name: str = "shell"

    def schema(self) -> dict[str, Any]:
        return _function_schema(
            self.name,
            "Run a shell command in the task directory and return its output.",
            "cmd",
            "The command line to run.",
        )

    def command(self, arguments: Mapping[str, Any]) -> str:
        return _string_argument(self.name, arguments, "cmd")


def resolve_call(
    call: ToolCall, tools: Sequence[SandboxTool]
) -> tuple[SandboxTool, str | list[str]]:
    """The tool a call names and the command it becomes; ``ToolCallError`` saying why not."""
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None:
        offered = ", ".join(t.name for t in tools) or "none"
        raise ToolCallError(f"unknown tool {call.name!r} (tools offered: {offered})")
    try:
        arguments = call.parsed_arguments()
    except ValueError as exc:
        raise ToolCallError(str(exc)) from None
    return tool, tool.command(arguments)


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and its tail."""
    if len(text) <= limit:
        return text
    head = (limit * 2) // 3
    tail = limit - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n...[{cut} characters cut]...\n{text[len(text) - tail :]}"


_LIMIT_WORDS = {
    ExecOutcome.CPU_LIMIT: "CPU time limit",
    ExecOutcome.MEMORY_LIMIT: "memory limit",
    ExecOutcome.PIDS_LIMIT: "process limit",
    ExecOutcome.DISK_LIMIT: "file size limit",
}


def render_exec(result: ExecResult, *, limit_chars: int) -> str:
    """The observation text for one command: stdout, stderr, and a bracketed line for anything
    but a clean exit. The output is clipped to about ``limit_chars``, the status line never."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    if result.stderr.strip():
        parts.append(result.stderr.rstrip("\n"))
    status: list[str] = []
    outcome = classify(result)
    if outcome is ExecOutcome.NONZERO_EXIT:
        status.append(f"[exit code {result.exit_code}]")
    elif outcome is ExecOutcome.TIMEOUT:
        status.append(f"[timed out after {result.elapsed_s:.1f} s; the command was killed]")
    elif outcome is ExecOutcome.SIGNALED:
        status.append(f"[killed by {result.killed_by} (exit code {result.exit_code})]")
    elif outcome in _LIMIT_WORDS:
        status.append(
            f"[killed: the sandbox's {_LIMIT_WORDS[outcome]} was hit "
            f"(exit code {result.exit_code})]"
        )
    joined = "\n".join(parts)
    output = clip_text(joined, limit_chars)
    if result.truncated or output != joined:
        status.append("[output truncated]")
    if not output and not status:
        return "(no output)"
    return "\n".join([output, *status] if output else status)


@dataclass
class ToolCounts:
    """What an episode's tool calls did: calls run, calls that failed, failures by outcome."""

    tool_calls: int = 0
    tool_errors: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def error(self, outcome: str) -> None:
        self.tool_errors += 1
        key = f"tool_{outcome}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1


async def run_tool_calls(
    calls: Sequence[ToolCall],
    errors: Sequence[str],
    sandbox: Sandbox,
    counts: ToolCounts,
    *,
    tools: Sequence[SandboxTool],
    max_calls: int,
    timeout_s: float,
    max_chars: int,
) -> list[Message]:
    """One tool message per call, in order (a call past ``max_calls`` or one that cannot be
    resolved gets an error message instead of running), then one per malformed block."""
    messages: list[Message] = []
    for index, call in enumerate(calls):
        if index >= max_calls:
            counts.error("invalid_call")
            messages.append(tool_message(
                call.name, f"error: not run, at most {max_calls} tool calls are run per turn"
            ))  # fmt: skip
            continue
        try:
            _tool, command = resolve_call(call, tools)
        except ToolCallError as exc:
            counts.error("invalid_call")
            messages.append(tool_message(call.name, clip_text(f"error: {exc}", max_chars)))
            continue
        counts.tool_calls += 1
        result = await sandbox.exec(command, timeout_s=timeout_s)
        outcome = classify(result)
        if outcome is not ExecOutcome.OK:
            counts.error(outcome.value)
        messages.append(tool_message(call.name, render_exec(result, limit_chars=max_chars)))
    for problem in errors:
        counts.error("invalid_call")
        messages.append(tool_message("invalid", clip_text(f"error: {problem}", max_chars)))
    return messages


def tool_message(name: str, content: str) -> Message:
    return {"role": "tool", "name": name, "content": content}
