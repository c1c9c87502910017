"""The scaffold plug-in port: what an installed scaffold supplies to ``InstalledAgent``.

A scaffold is a program the engine does not control: it speaks the OpenAI chat API to a model
and runs commands somewhere. ``InstalledAgent`` owns everything around it; the plug-in
supplies only what differs between scaffolds, as plain data in and out: ``check_command``
(exits 0 when installed), ``install_command`` / ``install_hint``, ``prepare(run)`` (write its
config into ``run.run_dir``; the argv and environment), ``parse(run)`` (its artifacts as a
``ScaffoldReport``) and ``termination_reason(exit)``.

Termination: the base classifier keys off how the process ended (wall clock: ``agent_timeout``;
a nonzero exit: ``infra_conn`` when its log says the model could not be reached, else
``infra_other``); each scaffold refines the *clean* exit from its own report. The rules are
pure functions of a ``ScaffoldExit``, so every case is a unit test.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.outcomes import TerminationReason

__all__ = [
    "OpenHandsRules",
    "Scaffold",
    "ScaffoldExit",
    "ScaffoldInvocation",
    "ScaffoldReport",
    "ScaffoldRun",
    "Terminus2Rules",
    "base_termination",
]


@dataclass(frozen=True, kw_only=True)
class ScaffoldRun:
    """Everything a scaffold is told about one task's run. ``base_url`` ends in ``/v1`` (the
    recording proxy when tokens are captured, else the model server); ``bridge`` is the
    command bridge's address (``"unix:/path"``)."""

    run_dir: Path
    base_url: str
    model_name: str
    bridge: str
    instruction: str
    max_turns: int
    max_new_tokens: int
    timeout_s: float
    context_cap: int
    sampling: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class ScaffoldInvocation:
    """How to start the scaffold: argv and the environment it adds to a clean base."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ScaffoldReport:
    """What the scaffold's artifacts say about its run (a missing artifact: the defaults).
    ``status`` is the scaffold's own word for the end; ``finished`` whether the agent declared
    the task done; ``steps`` the model calls it made."""

    status: str = ""
    finished: bool = False
    steps: int = 0
    step_limit_hit: bool = False
    context_exceeded: bool = False
    stuck: bool = False
    error: str = ""
    messages: tuple[Mapping[str, Any], ...] = ()
    submission: str = ""


@dataclass(frozen=True, kw_only=True)
class ScaffoldExit:
    """How a scaffold's process ended, and its report: the input of every termination rule.
    ``exit_code`` is ``None`` when the process was killed on its wall clock."""

    exit_code: int | None
    timed_out: bool = False
    log_tail: str = ""
    report: ScaffoldReport = ScaffoldReport()


_CONNECTION = re.compile(
    r"connection (refused|reset|error|aborted)|apiconnectionerror|connecterror|"
    r"internalservererror|serviceunavailable|bad gateway|\b50[234]\b|server disconnected",
    re.IGNORECASE,
)


def base_termination(exit: ScaffoldExit) -> TerminationReason | None:
    """The base classifier; ``None`` for a clean exit, which the scaffold refines."""
    if exit.timed_out:
        return TerminationReason.AGENT_TIMEOUT
    if exit.exit_code == 0:
        return None
    evidence = f"{exit.report.status} {exit.report.error} {exit.log_tail}"
    if _CONNECTION.search(evidence):
        return TerminationReason.INFRA_CONN
    return TerminationReason.INFRA_OTHER


class Scaffold(abc.ABC):
    name: str = "scaffold"
    install_hint: str = ""
    rewrites_history: bool = False
    """Whether the scaffold summarizes or rewrites its conversation (then it cannot be captured)."""

    @abc.abstractmethod
    def check_command(self) -> Sequence[str]:
        """An argv that exits 0 when the scaffold can run on this machine."""

    def install_command(self) -> Sequence[str] | None:
        """An argv that installs the scaffold on this machine, or ``None`` if it cannot."""
        return None

    @abc.abstractmethod
    def prepare(self, run: ScaffoldRun) -> ScaffoldInvocation:
        """Write the run's config into ``run.run_dir``; the argv and environment to start."""

    @abc.abstractmethod
    def parse(self, run: ScaffoldRun) -> ScaffoldReport:
        """Read the run's artifacts (``ScaffoldReport()`` when it left none)."""

    def termination_reason(self, exit: ScaffoldExit) -> TerminationReason:
        """The base classifier, then this scaffold's rules for a clean exit."""
        reason = base_termination(exit)
        return reason if reason is not None else self.clean_exit(exit.report)

    def clean_exit(self, report: ScaffoldReport) -> TerminationReason:
        """How a run that exited 0 ended (default: ``finish``)."""
        return TerminationReason.FINISH


class OpenHandsRules:
    """OpenHands' termination precedence on a clean exit, first match wins. A ``finish``
    call wins over any error after it: the task was declared done, and the reward decides."""

    @staticmethod
    def report_from_output(output: Mapping[str, Any]) -> ScaffoldReport:
        """A report from one line of OpenHands' ``output.jsonl`` (``error``, ``history``)."""
        error = str(output.get("error") or "")
        history = output.get("history") or []
        finished = (
            any(isinstance(ev, Mapping) and ev.get("action") == "finish" for ev in history)
            or str(output.get("agent_state", "")).lower() == "finished"
        )
        lowered = error.lower()
        return ScaffoldReport(
            status=str(output.get("agent_state", "")),
            finished=finished,
            steps=sum(1 for ev in history if isinstance(ev, Mapping) and ev.get("action")),
            step_limit_hit="maximum iteration" in lowered,
            context_exceeded="contextwindowexceeded" in lowered.replace(" ", "")
            or "context window" in lowered,
            stuck="stuck in a loop" in lowered or "agentstuckinlooperror" in lowered,
            error=error,
        )

    @staticmethod
    def termination_reason(exit: ScaffoldExit) -> TerminationReason:
        reason = base_termination(exit)
        if reason is not None:
            return reason
        r = exit.report
        if r.finished:
            return TerminationReason.FINISH
        if r.context_exceeded:
            return TerminationReason.MAX_CONTEXT
        if r.step_limit_hit or r.stuck:
            return TerminationReason.MAX_TURNS
        if r.error:
            return TerminationReason.INFRA_OTHER
        return TerminationReason.FINISH


class Terminus2Rules:
    """Terminus-2's termination on a clean exit: ``max_turns`` when the step budget was hit
    without a ``mark_task_complete`` call, else ``finish``."""

    @staticmethod
    def report_from_run(
        episodes: Sequence[Mapping[str, Any]], *, max_episodes: int
    ) -> ScaffoldReport:
        """A report from Terminus-2's per-episode responses (``is_task_complete`` flags)."""
        complete = any(bool(ep.get("is_task_complete")) for ep in episodes)
        return ScaffoldReport(
            finished=complete,
            steps=len(episodes),
            step_limit_hit=len(episodes) >= max_episodes,
        )

    @staticmethod
    def termination_reason(exit: ScaffoldExit) -> TerminationReason:
        reason = base_termination(exit)
        if reason is not None:
            return reason
        if exit.report.finished:
            return TerminationReason.FINISH
        if exit.report.step_limit_hit:
            return TerminationReason.MAX_TURNS
        return TerminationReason.FINISH
