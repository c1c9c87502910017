"""The scaffold plug-in port: what an installed scaffold supplies to ``InstalledAgent``.

A scaffold is a program the engine does not control (mini-swe-agent, OpenHands, Terminus-2): it
speaks the OpenAI chat API to a model and runs commands somewhere. ``InstalledAgent``
(``engine.agents.installed``) owns everything around it, once per task: the sandbox, the
recording proxy, the command bridge, the process, its logs and the teardown. The plug-in
supplies only what differs between scaffolds, as plain data in and out:

- ``check_command``: an argv that exits 0 when the scaffold is installed; ``install_command``
  installs it (run when the agent is allowed to install), ``install_hint`` says how otherwise;
- ``prepare(run)``: write its config files into ``run.run_dir`` and return the argv and extra
  environment of the run (shell commands in, files out);
- ``parse(run, stdout_tail)``: read the artifacts the run left (its trajectory file) into a
  ``ScaffoldReport``;
- ``termination_reason(exit)``: how the run ended, from a pure ``ScaffoldExit``.

Termination classification: the base classifier keys off how the process
ended (wall clock ran out: ``agent_timeout``; a nonzero exit: ``infra_conn`` when its log says
the model could not be reached, else ``infra_other``); each scaffold refines the *clean* exit
from its own report. The rules are pure functions of a ``ScaffoldExit``, so every case is a
unit test (``tests/agents/test_installed_termination.py``).
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
    """Everything a scaffold is told about one task's run.

    ``base_url`` is the OpenAI base URL (ending in ``/v1``): the recording proxy when tokens are
    captured, the model server itself otherwise. ``bridge`` is the address of the command
    bridge that runs a command in the task's sandbox (``"unix:/path"``). ``instruction`` is the
    task as the scaffold's user sees it. ``max_turns``/``max_new_tokens``/``timeout_s`` come
    from the episode's stopping criteria; ``context_cap`` is the installed-scaffold context cap
    (131072, not the episode's ``max_context_len``).
    """

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

    ``status`` is the scaffold's own word for the end (mini-swe-agent's ``exit_status``,
    OpenHands' error or final state); ``finished`` whether the agent declared the task done
    (a submit / finish / ``mark_task_complete`` call); ``steps`` the model calls it made;
    ``step_limit_hit`` whether its step budget ended it; ``context_exceeded`` whether its
    context window did; ``messages`` the trajectory as the scaffold recorded it.
    """

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

    ``exit_code`` is ``None`` when the process was killed (it ran past its wall clock).
    ``log_tail`` is the end of its combined stdout/stderr.
    """

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
    """The base classifier: ``None`` for a clean exit (the scaffold refines it).

    First match wins: the wall clock ran out (``agent_timeout``); a nonzero exit whose log or
    report names a connection failure (``infra_conn``); any other nonzero exit or kill
    (``infra_other``).
    """
    if exit.timed_out:
        return TerminationReason.AGENT_TIMEOUT
    if exit.exit_code == 0:
        return None
    evidence = f"{exit.report.status} {exit.report.error} {exit.log_tail}"
    if _CONNECTION.search(evidence):
        return TerminationReason.INFRA_CONN
    return TerminationReason.INFRA_OTHER


class Scaffold(abc.ABC):
    """A scaffold plug-in (see the module docstring)."""

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
    """OpenHands' termination precedence, first match wins.

    On a nonzero exit or a kill the base classifier decides. On a clean exit:

    1. the agent called ``finish`` (its final state is FINISHED)         -> ``finish``
    2. the context window was exceeded (``ContextWindowExceededError``)  -> ``max_context``
    3. the iteration budget was hit ("maximum iteration")               -> ``max_turns``
    4. the stuck-in-a-loop detector ended it                            -> ``max_turns``
    5. any other error recorded in the run's output                     -> ``infra_other``
    6. otherwise                                                        -> ``finish``

    A finish wins over what follows it: the task was declared done, and the reward decides.
    """

    @staticmethod
    def report_from_output(output: Mapping[str, Any]) -> ScaffoldReport:
        """A report from one line of OpenHands' ``output.jsonl`` (``error``, ``history``)."""
        error = str(output.get("error") or "")
        history = output.get("history") or []
        finished = any(
            isinstance(ev, Mapping) and ev.get("action") == "finish" for ev in history
        ) or str(output.get("agent_state", "")).lower() == "finished"
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
    """Terminus-2's termination: a clean exit with a
    ``mark_task_complete`` call is ``finish``, else ``max_turns`` if the step budget was hit,
    else ``finish``; nonzero exits (and kills) defer to the base classifier."""

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
