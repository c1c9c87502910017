"""The mini-swe-agent plug-in: the ``mini`` program from PyPI (``mini-swe-agent``) as a scaffold.

Installed with the engine's ``scaffolds`` extra, never as an engine dependency. Per task it
writes one YAML config into the run folder and runs ``python -m minisweagent.run.mini`` with
the text-based LiteLLM model (a ``THOUGHT`` and exactly one fenced ``bash`` block per reply)
pointed at the run's base URL, ``rollout_sandbox_env.SandboxEnvironment`` (each action runs in
the task's sandbox through the command bridge, not on the host), ``step_limit`` from
``max_turns`` and its own wall clock a little inside the engine's.

A clean exit ends by ``info.exit_status``: ``Submitted`` -> ``finish``; ``LimitsExceeded`` ->
``max_turns``; ``TimeExceeded`` -> ``agent_timeout``; ``ContextWindowExceededError`` ->
``max_context``; ``RepeatedFormatError`` -> ``finish`` (the model ended the run by not
following the format: a well-formed episode whose reward says so); anything else ->
``infra_other``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.agents.scaffolds.base import (
    Scaffold,
    ScaffoldExit,
    ScaffoldInvocation,
    ScaffoldReport,
    ScaffoldRun,
    base_termination,
)
from engine.outcomes import TerminationReason

__all__ = [
    "ACTION_REGEX",
    "INSTANCE_TEMPLATE",
    "MSWEA_VERSION",
    "OBSERVATION_TEMPLATE",
    "SUBMIT_COMMAND",
    "SYSTEM_TEMPLATE",
    "MiniSweAgent",
    "mini_swe_agent_reason",
]

MSWEA_VERSION = "2.4.6"
"""The mini-swe-agent release this plug-in is written and tested against."""

SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
ACTION_REGEX = r"```bash\s*\n(.*?)\n```"

SYSTEM_TEMPLATE = (
    """\
You are a helpful assistant that fixes bugs in a small repository with shell commands.
Every reply is a THOUGHT line, then exactly ONE ```bash block with ONE command.
When the tests pass, submit with: """
    + SUBMIT_COMMAND
)

INSTANCE_TEMPLATE = """\
{{task}}

Each command runs in a new shell in the repository's root directory."""

OBSERVATION_TEMPLATE = """\
{% if output.exception_info %}<exception>{{output.exception_info}}</exception>
{% endif %}<returncode>{{output.returncode}}</returncode>
<output>
{{output.output[:4000]}}</output>"""

FORMAT_ERROR_TEMPLATE = """\
Format error: {{error}} Reply with a THOUGHT line and exactly ONE ```bash block."""

ENV_MODULE_DIR = Path(__file__).resolve().parent / "mswea"

_REASONS: dict[str, TerminationReason] = {
    "Submitted": TerminationReason.FINISH,
    "LimitsExceeded": TerminationReason.MAX_TURNS,
    "TimeExceeded": TerminationReason.AGENT_TIMEOUT,
    "ContextWindowExceededError": TerminationReason.MAX_CONTEXT,
    "RepeatedFormatError": TerminationReason.FINISH,
}


def mini_swe_agent_reason(exit: ScaffoldExit) -> TerminationReason:
    reason = base_termination(exit)
    if reason is not None:
        return reason
    return _REASONS.get(exit.report.status, TerminationReason.INFRA_OTHER)


@dataclass(frozen=True, kw_only=True)
class MiniSweAgent(Scaffold):
    """mini-swe-agent as a scaffold plug-in. ``python`` is the interpreter that has
    ``minisweagent``; the tiny model is trained on the default templates; ``model_retries`` is
    small so that a dead server fails the episode soon."""

    python: str = sys.executable
    system_template: str = SYSTEM_TEMPLATE
    instance_template: str = INSTANCE_TEMPLATE
    observation_template: str = OBSERVATION_TEMPLATE
    format_error_template: str = FORMAT_ERROR_TEMPLATE
    action_regex: str = ACTION_REGEX
    max_consecutive_format_errors: int = 3
    model_retries: int = 2
    name: str = "mini-swe-agent"
    install_hint: str = (
        f"install it with: pip install 'mini-swe-agent=={MSWEA_VERSION}' "
        "(or the engine's extra: pip install 'rollout-engine[scaffolds]')"
    )

    def check_command(self) -> list[str]:
        return [self.python, "-c", "import minisweagent.run.mini, litellm"]

    def install_command(self) -> list[str]:
        return [self.python, "-m", "pip", "install", "--quiet", f"mini-swe-agent=={MSWEA_VERSION}"]

    def config(self, run: ScaffoldRun) -> dict[str, Any]:
        """The YAML config of one run (also what the tests and the docs show)."""
        kwargs: dict[str, Any] = {
            "api_base": run.base_url,
            "api_key": "rollout",
            "max_tokens": run.max_new_tokens,
            "drop_params": True,
        }
        for key in ("temperature", "top_p"):
            if run.sampling.get(key) is not None:
                kwargs[key] = run.sampling[key]
        if run.seed is not None:
            kwargs["seed"] = run.seed
        return {
            "agent": {
                "system_template": self.system_template,
                "instance_template": self.instance_template,
                "step_limit": run.max_turns,
                "cost_limit": 0,
                # Inside the engine's own wall clock, so mini stops itself and saves its run.
                "wall_time_limit_seconds": max(1, int(run.timeout_s * 0.9)),
                "max_consecutive_format_errors": self.max_consecutive_format_errors,
                "output_path": str(self.trajectory_path(run)),
            },
            "model": {
                "model_name": f"openai/{run.model_name}",
                "model_class": "litellm_textbased",
                "cost_tracking": "ignore_errors",
                "model_kwargs": kwargs,
                "action_regex": self.action_regex,
                "observation_template": self.observation_template,
                "format_error_template": self.format_error_template,
            },
            "environment": {
                "environment_class": "rollout_sandbox_env.SandboxEnvironment",
                "bridge": run.bridge,
                "timeout": 30,
            },
        }

    @staticmethod
    def trajectory_path(run: ScaffoldRun) -> Path:
        return run.run_dir / "trajectory.json"

    def prepare(self, run: ScaffoldRun) -> ScaffoldInvocation:
        config_path = run.run_dir / "mini.yaml"
        config_path.write_text(yaml.safe_dump(self.config(run), sort_keys=False))
        (run.run_dir / "task.txt").write_text(run.instruction)
        argv = [
            self.python, "-m", "minisweagent.run.mini",
            "-c", str(config_path),
            "--agent-class", "default",
            "--model-class", "litellm_textbased",
            "--environment-class", "rollout_sandbox_env.SandboxEnvironment",
            "--yolo", "--exit-immediately",
            "--cost-limit", "0",
            "-t", run.instruction,
            "-o", str(self.trajectory_path(run)),
        ]  # fmt: skip
        env = {
            "PYTHONPATH": str(ENV_MODULE_DIR),
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(run.run_dir / "mswea-config"),
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(self.model_retries),
            # LiteLLM fetches a price list from the internet on import unless told not to.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "OPENAI_API_KEY": "rollout",
        }
        return ScaffoldInvocation(argv=argv, env=env)

    def parse(self, run: ScaffoldRun) -> ScaffoldReport:
        path = self.trajectory_path(run)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return ScaffoldReport()
        info = data.get("info") or {}
        status = str(info.get("exit_status") or "")
        messages = tuple(m for m in data.get("messages") or () if isinstance(m, dict))
        calls = int((info.get("model_stats") or {}).get("api_calls") or 0)
        error = ""
        if messages and messages[-1].get("role") == "exit":
            extra = messages[-1].get("extra") or {}
            error = str(extra.get("exception_str") or "")
        return ScaffoldReport(
            status=status,
            finished=status == "Submitted",
            steps=calls,
            step_limit_hit=status == "LimitsExceeded",
            context_exceeded=status == "ContextWindowExceededError",
            error=error,
            messages=messages,
            submission=str(info.get("submission") or ""),
        )

    def clean_exit(self, report: ScaffoldReport) -> TerminationReason:
        return _REASONS.get(report.status, TerminationReason.INFRA_OTHER)
