"""The ``shell`` task's verifier: run the task's check command in the episode's sandbox.

The label is an ``sh`` command line that exits 0 when the task is done (``test "$(cat memo.txt)"
= "lemon"``), run after the agent in the *same* sandbox, within ``check_timeout_s``: exit 0
scores 1.0, anything else 0.0. The detail holds the exit code, the outcome and the first
``excerpt_chars`` of stderr and stdout. A sandbox failing meanwhile raises ``SandboxError``
(the sample aborts as ``infra_sandbox``).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import JsonValue

from engine.agents.tool_agent import FinishedEpisode, Verdict
from engine.domain import Task
from engine.errors import ConfigError
from engine.sandbox import ExecOutcome, Sandbox, classify

__all__ = ["ShellVerifier", "check_command", "run_check"]


def check_command(task: Task) -> str:
    """The task's check command; ``ConfigError`` naming the task when it has none."""
    label = task.label
    if not isinstance(label, str) or not label.strip() or "\0" in label:
        raise ConfigError(
            f"shell task {task.sample_id} (dataset {task.dataset_name!r}, line "
            f"{task.source_line}): the label must be a non-empty sh command line, got {label!r}"
        )
    return label


async def run_check(
    sandbox: Sandbox, command: str, *, timeout_s: float, excerpt_chars: int = 500
) -> Verdict:
    result = await sandbox.exec(command, timeout_s=timeout_s)
    outcome = classify(result)
    detail: dict[str, JsonValue] = {
        "exit_code": result.exit_code,
        "outcome": outcome.value,
        "passed": outcome is ExecOutcome.OK,
        "stderr": result.stderr[:excerpt_chars],
        "stdout": result.stdout[:excerpt_chars],
    }
    return Verdict(score=1.0 if outcome is ExecOutcome.OK else 0.0, detail=detail)


@dataclass(frozen=True, kw_only=True)
class ShellVerifier:
    """``Verifier`` of the ``shell`` task type."""

    check_timeout_s: float = 30.0
    excerpt_chars: int = 500

    def __post_init__(self) -> None:
        if not self.check_timeout_s > 0:
            raise ConfigError(
                f"ShellVerifier.check_timeout_s must be > 0, got {self.check_timeout_s}"
            )

    async def verify(self, task: Task, episode: FinishedEpisode) -> Verdict:
        return await run_check(
            episode.sandbox,
            check_command(task),
            timeout_s=self.check_timeout_s,
            excerpt_chars=self.excerpt_chars,
        )
