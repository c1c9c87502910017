"""Termination rules of installed scaffolds (inference-backend §5), as pure cases.

The base classifier keys off how the process ended; each scaffold refines a clean exit. The
cases below are the seed's: OpenHands' precedence (first match wins), Terminus-2's
``mark_task_complete`` / step-budget rule, and mini-swe-agent's exit statuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.agents.installed import (
    INSTALLED_CONTEXT_CAP,
    InstalledAgent,
    InstalledAgentConfig,
    capped,
)
from engine.agents.scaffolds import (
    MiniSweAgent,
    OpenHandsRules,
    ScaffoldExit,
    ScaffoldReport,
    ScaffoldRun,
    Terminus2Rules,
    base_termination,
    mini_swe_agent_reason,
)
from engine.errors import ConfigError
from engine.outcomes import TerminationReason as R
from engine.tasks.swe import SweTask

CLEAN = 0


def ex(code: int | None = CLEAN, *, timed_out: bool = False, log: str = "",
       **report: Any) -> ScaffoldExit:  # fmt: skip
    return ScaffoldExit(
        exit_code=code, timed_out=timed_out, log_tail=log, report=ScaffoldReport(**report)
    )


# -- the base classifier --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit", "reason"),
    [
        (ex(None, timed_out=True), R.AGENT_TIMEOUT),
        # the wall clock wins over whatever the log says
        (ex(None, timed_out=True, log="Connection refused"), R.AGENT_TIMEOUT),
        (ex(1, log="litellm.APIConnectionError: Connection refused"), R.INFRA_CONN),
        (ex(1, status="InternalServerError"), R.INFRA_CONN),
        (ex(1, log="Traceback ... KeyError: 'x'"), R.INFRA_OTHER),
        (ex(-9), R.INFRA_OTHER),
        (ex(CLEAN), None),
    ],
)
def test_base_classifier(exit: ScaffoldExit, reason: R | None) -> None:
    assert base_termination(exit) == reason


# -- OpenHands: first match wins ------------------------------------------------------------


@pytest.mark.parametrize(
    ("exit", "reason"),
    [
        # 1. a finish call wins, even with an error recorded after it
        (ex(finished=True, error="ContextWindowExceededError"), R.FINISH),
        # 2. context window before the iteration budget
        (ex(context_exceeded=True, step_limit_hit=True), R.MAX_CONTEXT),
        # 3. the iteration budget
        (ex(step_limit_hit=True, error="Agent reached maximum iteration"), R.MAX_TURNS),
        # 4. stuck in a loop
        (ex(stuck=True, error="AgentStuckInLoopError"), R.MAX_TURNS),
        # 5. any other recorded error
        (ex(error="RuntimeError: tool crashed"), R.INFRA_OTHER),
        # 6. a clean, quiet exit
        (ex(), R.FINISH),
        # nonzero exits and kills go to the base classifier, whatever the report says
        (ex(2, finished=True), R.INFRA_OTHER),
        (ex(None, timed_out=True, finished=True), R.AGENT_TIMEOUT),
    ],
)
def test_openhands_precedence(exit: ScaffoldExit, reason: R) -> None:
    assert OpenHandsRules.termination_reason(exit) == reason


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ({"history": [{"action": "run"}, {"action": "finish"}], "error": None}, R.FINISH),
        ({"history": [{"action": "run"}], "agent_state": "finished"}, R.FINISH),
        ({"history": [{"action": "run"}],
          "error": "Agent reached maximum iteration in headless mode. Current iteration: 30, "
                   "max iteration: 30"}, R.MAX_TURNS),
        ({"history": [], "error": "litellm.ContextWindowExceededError: too long"},
         R.MAX_CONTEXT),
        ({"history": [], "error": "AgentStuckInLoopError: Agent got stuck in a loop"},
         R.MAX_TURNS),
        ({"history": [{"action": "run"}], "error": "sandbox died"}, R.INFRA_OTHER),
    ],
)  # fmt: skip
def test_openhands_reports_from_its_output(output: dict[str, Any], reason: R) -> None:
    report = OpenHandsRules.report_from_output(output)
    assert OpenHandsRules.termination_reason(ScaffoldExit(exit_code=0, report=report)) == reason


# -- Terminus-2 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("episodes", "code", "reason"),
    [
        ([{"is_task_complete": False}, {"is_task_complete": True}], 0, R.FINISH),
        # complete on the very last allowed step: still a finish (it is checked first)
        ([{"is_task_complete": False}] * 2 + [{"is_task_complete": True}], 0, R.FINISH),
        ([{"is_task_complete": False}] * 3, 0, R.MAX_TURNS),
        ([{"is_task_complete": False}], 0, R.FINISH),
        ([{"is_task_complete": True}], 1, R.INFRA_OTHER),
    ],
)
def test_terminus2(episodes: list[dict[str, Any]], code: int, reason: R) -> None:
    report = Terminus2Rules.report_from_run(episodes, max_episodes=3)
    assert Terminus2Rules.termination_reason(ScaffoldExit(exit_code=code, report=report)) == reason


# -- mini-swe-agent -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("Submitted", R.FINISH),
        ("LimitsExceeded", R.MAX_TURNS),
        ("TimeExceeded", R.AGENT_TIMEOUT),
        ("ContextWindowExceededError", R.MAX_CONTEXT),
        ("RepeatedFormatError", R.FINISH),
        ("", R.INFRA_OTHER),  # exited 0 without a trajectory
        ("SomethingElse", R.INFRA_OTHER),
    ],
)
def test_mini_swe_agent_statuses(status: str, reason: R) -> None:
    exit = ex(status=status)
    assert mini_swe_agent_reason(exit) == reason
    assert MiniSweAgent().termination_reason(exit) == reason


def _run(tmp_path: Path) -> ScaffoldRun:
    return ScaffoldRun(
        run_dir=tmp_path, base_url="http://127.0.0.1:1/v1", model_name="policy",
        bridge="unix:/tmp/x.sock", instruction="fix it", max_turns=5, max_new_tokens=64,
        timeout_s=100.0, context_cap=131072, sampling={"temperature": 0.0}, seed=7,
    )  # fmt: skip


def test_mini_swe_agent_parses_its_trajectory(tmp_path: Path) -> None:
    scaffold = MiniSweAgent()
    run = _run(tmp_path)
    assert scaffold.parse(run) == ScaffoldReport()  # no file yet
    (tmp_path / "trajectory.json").write_text(json.dumps({
        "info": {"exit_status": "Submitted", "submission": "",
                 "model_stats": {"api_calls": 3}},
        "messages": [{"role": "system", "content": "s"},
                     {"role": "assistant", "content": "THOUGHT: x"},
                     {"role": "exit", "content": "", "extra": {"exit_status": "Submitted"}}],
    }))  # fmt: skip
    report = scaffold.parse(run)
    assert (report.status, report.finished, report.steps) == ("Submitted", True, 3)
    assert [m["role"] for m in report.messages] == ["system", "assistant", "exit"]


def test_mini_swe_agent_config_points_at_the_run(tmp_path: Path) -> None:
    run = _run(tmp_path)
    invocation = MiniSweAgent().prepare(run)
    config = MiniSweAgent().config(run)
    assert config["model"]["model_kwargs"]["api_base"] == "http://127.0.0.1:1/v1"
    assert config["model"]["model_kwargs"]["temperature"] == 0.0
    assert config["model"]["model_kwargs"]["seed"] == 7
    assert config["agent"]["step_limit"] == 5
    assert config["environment"]["bridge"] == "unix:/tmp/x.sock"
    assert (tmp_path / "mini.yaml").is_file()
    assert "fix it" in invocation.argv
    assert invocation.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"


# -- the capture switch ---------------------------------------------------------------------


def test_capture_needs_a_proxy_and_a_tokenizer() -> None:
    with pytest.raises(ConfigError, match="capture_tokens needs a proxy"):
        InstalledAgentConfig(scaffold=MiniSweAgent(), task=SweTask())
    InstalledAgentConfig(scaffold=MiniSweAgent(), task=SweTask(), capture_tokens=False)


def test_capture_refuses_a_scaffold_that_rewrites_its_history() -> None:
    class Summarizing(MiniSweAgent):
        rewrites_history = True

    with pytest.raises(ConfigError, match="append-only"):
        InstalledAgentConfig(
            scaffold=Summarizing(), task=SweTask(), proxy=lambda **_: None,  # type: ignore[arg-type,return-value]
            tokenizer=object(),
        )  # fmt: skip
    # eval (no capture) may run it
    InstalledAgentConfig(scaffold=Summarizing(), task=SweTask(), capture_tokens=False)


# -- install ----------------------------------------------------------------------------------


class MarkerScaffold(MiniSweAgent):
    """Installed iff a marker file exists; installing creates it (or fails)."""

    marker: Path = Path("/nonexistent")
    install_works: bool = True

    def check_command(self) -> list[str]:
        return ["/bin/sh", "-c", f"test -f {self.marker}"]

    def install_command(self) -> list[str]:
        return ["/bin/sh", "-c", f"touch {self.marker}" if self.install_works else "exit 3"]


def marker_scaffold(marker: Path, install_works: bool = True) -> MarkerScaffold:
    scaffold = MarkerScaffold()
    object.__setattr__(scaffold, "marker", marker)
    object.__setattr__(scaffold, "install_works", install_works)
    return scaffold


async def test_a_missing_scaffold_is_installed_only_when_allowed(tmp_path: Path) -> None:
    marker = tmp_path / "installed"
    refuse = InstalledAgent(InstalledAgentConfig(
        scaffold=marker_scaffold(marker), task=SweTask(), capture_tokens=False))  # fmt: skip
    with pytest.raises(ConfigError, match="is not installed here.*exited 1.*pip install"):
        await refuse.ensure_installed()
    assert not marker.exists()
    agent = InstalledAgent(InstalledAgentConfig(
        scaffold=marker_scaffold(marker), task=SweTask(), capture_tokens=False,
        install=True))  # fmt: skip
    await agent.ensure_installed()
    assert marker.exists()


async def test_a_failed_install_is_reported(tmp_path: Path) -> None:
    agent = InstalledAgent(InstalledAgentConfig(
        scaffold=marker_scaffold(tmp_path / "m", install_works=False), task=SweTask(),
        capture_tokens=False, install=True))  # fmt: skip
    with pytest.raises(ConfigError, match="install command failed.*exited 3"):
        await agent.ensure_installed()


# -- the installed-scaffold context cap ---------------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "length", "expected"),
    [
        (R.FINISH, INSTALLED_CONTEXT_CAP - 1, R.FINISH),
        (R.FINISH, INSTALLED_CONTEXT_CAP, R.MAX_CONTEXT),
        (R.MAX_TURNS, INSTALLED_CONTEXT_CAP + 5, R.MAX_CONTEXT),
        (R.AGENT_TIMEOUT, INSTALLED_CONTEXT_CAP + 5, R.AGENT_TIMEOUT),  # an abort keeps its class
    ],
)
def test_a_series_at_the_cap_ends_as_max_context(reason: R, length: int, expected: R) -> None:
    assert INSTALLED_CONTEXT_CAP == 131072
    assert capped(reason, length, INSTALLED_CONTEXT_CAP) == expected
