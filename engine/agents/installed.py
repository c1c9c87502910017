"""``InstalledAgent``: a black-box scaffold as an episode.

A scaffold (mini-swe-agent, OpenHands, Terminus-2) is a program that only speaks the OpenAI
chat API. ``InstalledAgent`` runs one per task and owns everything around it; a plug-in
(``engine.agents.scaffolds``) supplies the commands and termination rules. Per task:

1. the sample's sandbox from ``context.sandboxes``, labelled for the attempt so a dead
   worker's sandboxes are reaped, with the task's files (``InstalledTask.prepare``);
2. in training, a recording proxy the scaffold is pointed at; with ``capture_tokens=False``
   (eval) the scaffold talks to the backend's ``base_url`` directly. This one switch turns
   eval into training;
3. the plug-in's check command must succeed (with ``install=True`` its install command runs
   once per agent first); a scaffold still missing is a ``ConfigError`` saying how to install;
4. the scaffold's process, in a private run folder, a clean environment (never the worker's:
   it holds credentials), a wall clock and its own process group; its commands reach the
   sandbox through the command bridge (``engine.agents.scaffold_host``);
5. the task's artifact and the scaffold's trajectory are collected and parsed into a
   ``ScaffoldReport``; the run folder is copied under ``logs_dir`` when set;
6. the plug-in classifies the termination (an abort class raises, so the sample is recorded
   as aborted with it);
7. proxy, bridge and process group go when ``run`` ends, the sandbox in ``cleanup``; the
   verifier runs in ``eval``, in the sandbox the agent edited.

The token-level result is the proxy's captured series. When capture turned itself off, a
training episode raises: no token data rather than a corrupt sample. The context cap is
``INSTALLED_CONTEXT_CAP``, not the episode's ``max_context_len``; a series reaching it ends as
``max_context``.

The recording proxy sits above the agents in the layer map, so it is passed in: ``proxy`` is
any factory with ``RecordingProxy``'s keyword signature.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from engine.agents.base import Episode, EpisodeAgent, EpisodeContext, episode_labels
from engine.agents.result import AgentResult, Reward
from engine.agents.scaffold_host import CommandBridge, base_env, check_command, run_scaffold
from engine.agents.scaffolds.base import Scaffold, ScaffoldExit, ScaffoldReport, ScaffoldRun
from engine.backends.base import ModelBackend
from engine.domain import Task
from engine.errors import (
    AgentError,
    BackendUnavailable,
    ConfigError,
    EpisodeTimeout,
    SandboxError,
)
from engine.outcomes import TerminationReason
from engine.sandbox import Sandbox, SandboxLimits

__all__ = [
    "INSTALLED_CONTEXT_CAP",
    "CaptureProxy",
    "InstalledAgent",
    "InstalledAgentConfig",
    "InstalledEpisode",
    "InstalledTask",
    "ProxyFactory",
    "capped",
]

log = logging.getLogger(__name__)

INSTALLED_CONTEXT_CAP = 131072


class CapturedSeries(Protocol):
    """What a proxy hands back after the run: the series as an ``AgentResult``."""

    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...

    @property
    def response_token_ids(self) -> tuple[int, ...]: ...

    def agent_result(
        self, termination_reason: TerminationReason, *, text: str = ""
    ) -> AgentResult: ...


class CaptureProxy(Protocol):
    """A per-task recording proxy (``engine.proxy.RecordingProxy``)."""

    @property
    def url(self) -> str: ...

    @property
    def capture_valid(self) -> bool: ...

    @property
    def invalid_reason(self) -> str | None: ...

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def trajectory(self) -> CapturedSeries | None: ...


class ProxyFactory(Protocol):
    """Builds one task's proxy: ``RecordingProxy(backend=..., tokenizer=..., task_id=...)``."""

    def __call__(
        self, *, backend: ModelBackend, tokenizer: Any, task_id: str | None = None
    ) -> CaptureProxy: ...


class InstalledTask(Protocol):
    """The task side of an installed-scaffold episode (``engine.tasks.swe.SweTask``)."""

    def instruction(self, task: Task) -> str:
        """The task as the scaffold's user states it."""
        ...

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        """Put the task's files into the fresh sandbox."""
        ...

    async def collect(self, task: Task, sandbox: Sandbox) -> dict[str, str]:
        """The artifact of the run (e.g. the edited files), frozen before scoring."""
        ...

    async def verify(self, task: Task, sandbox: Sandbox) -> Reward:
        """Score the sandbox as the scaffold left it."""
        ...


@dataclass(frozen=True, kw_only=True)
class InstalledAgentConfig:
    """How an ``InstalledAgent`` runs its scaffold.

    ``capture_tokens``: the proxy records the series; off, the scaffold talks to
    ``model_url`` (or the worker's endpoint) and the result carries no tokens. A scaffold that
    rewrites its history is refused with capture (the append-only guard would drop every
    episode). ``default_*`` stand where ``context.stopping`` leaves a limit unset.
    ``command_timeout_s`` bounds one scaffold command. ``logs_dir`` keeps each run's folder as
    ``<logs_dir>/<rollout>/<sample>.<attempt>/``. ``install`` is off by default: a worker that
    installs software mid-rollout is rarely what an operator wants.
    """

    scaffold: Scaffold
    task: InstalledTask
    capture_tokens: bool = True
    proxy: ProxyFactory | None = None
    tokenizer: Any = None
    model_url: str | None = None
    model_name: str = "policy"
    sandbox_limits: SandboxLimits | None = None
    command_timeout_s: float = 30.0
    default_max_turns: int = 20
    default_max_new_tokens: int = 512
    default_timeout_s: float = 600.0
    context_cap: int = INSTALLED_CONTEXT_CAP
    logs_dir: Path | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    install: bool = False

    def __post_init__(self) -> None:
        where = f"InstalledAgentConfig for scaffold {self.scaffold.name!r}"
        if self.capture_tokens and (self.proxy is None or self.tokenizer is None):
            raise ConfigError(
                f"{where}: capture_tokens needs a proxy factory (engine.proxy.RecordingProxy) "
                "and the policy's tokenizer; set capture_tokens=False for eval"
            )
        if self.capture_tokens and self.scaffold.rewrites_history:
            raise ConfigError(
                f"{where}: the scaffold rewrites or summarizes its history, which the "
                "recording proxy cannot capture (append-only); turn that off in the scaffold "
                "or run it with capture_tokens=False"
            )
        if self.command_timeout_s <= 0 or self.default_timeout_s <= 0:
            raise ConfigError(f"{where}: timeouts must be positive")
        if self.context_cap < 1:
            raise ConfigError(f"{where}: context_cap must be positive, got {self.context_cap}")


class InstalledAgent(EpisodeAgent):
    def __init__(self, config: InstalledAgentConfig) -> None:
        self.config = config
        # A fact about the machine, not an episode, so every episode shares it.
        self._installed = False
        self._install_lock = asyncio.Lock()

    async def ensure_installed(self) -> None:
        """Check (and with ``config.install``, install) the scaffold, once per agent."""
        if self._installed:
            return
        async with self._install_lock:
            if self._installed:
                return
            scaffold = self.config.scaffold
            problem = await check_command(scaffold.check_command())
            install = scaffold.install_command() if self.config.install else None
            if problem is not None and install is not None:
                log.info("installing scaffold %s: %s", scaffold.name, " ".join(install))
                failed = await check_command(install)
                problem = (
                    await check_command(scaffold.check_command())
                    if failed is None
                    else (f"its install command failed: {failed}")
                )
            if problem is not None:
                raise ConfigError(
                    f"scaffold {scaffold.name} is not installed here ({problem}); "
                    f"{scaffold.install_hint}"
                )
            self._installed = True

    def episode(self, task: Task) -> InstalledEpisode:
        return InstalledEpisode(self, task)


@dataclass
class _RunRecord:
    run: ScaffoldRun
    exit: ScaffoldExit
    reason: TerminationReason
    artifact: dict[str, str]
    elapsed_s: float
    bridge_commands: int
    sandbox_failures: list[str]


class InstalledEpisode(Episode):
    """One attempt: the sandbox from ``run`` to ``cleanup``, and what the run left."""

    def __init__(self, agent: InstalledAgent, task: Task) -> None:
        self.agent = agent
        self.task = task
        self.sandbox: Sandbox | None = None
        self.record: _RunRecord | None = None

    async def run(self, context: EpisodeContext) -> AgentResult:
        backend = await self._prepare(context)
        proxy, bridge, run, exit, elapsed = await self._run_scaffold(context, backend)
        cfg = self.agent.config
        reason = cfg.scaffold.termination_reason(exit)
        if bridge.sandbox_failures and reason.is_abort:
            reason = TerminationReason.INFRA_SANDBOX
        assert self.sandbox is not None
        artifact = await cfg.task.collect(self.task, self.sandbox)
        self.record = _RunRecord(
            run=run,
            exit=exit,
            reason=reason,
            artifact=artifact,
            elapsed_s=elapsed,
            bridge_commands=bridge.commands,
            sandbox_failures=list(bridge.sandbox_failures),
        )
        kept = _keep_logs(cfg.logs_dir, context, run.run_dir, artifact)
        if reason.is_abort:
            raise _abort_error(reason, cfg.scaffold.name, exit, kept or run.run_dir, bridge)
        return self._result(context, proxy, reason, exit.report)

    async def _prepare(self, context: EpisodeContext) -> ModelBackend:
        """Start the sandbox with the task's files, install the scaffold; its backend."""
        cfg = self.agent.config
        if context.sandboxes is None:
            raise SandboxError(
                f"sample {context.sample_id}: scaffold {cfg.scaffold.name} needs a sandbox "
                "provider, and the worker has none (run it with --sandbox local or docker)"
            )
        if context.backends is None:
            raise BackendUnavailable(
                f"sample {context.sample_id}: the worker has no model endpoint for the scaffold"
            )
        self.sandbox = context.sandboxes.create(
            labels=episode_labels(context), limits=cfg.sandbox_limits
        )
        await self.sandbox.start()
        await cfg.task.prepare(self.task, self.sandbox)
        await self.agent.ensure_installed()
        return context.backends.get(cfg.model_url)

    async def _run_scaffold(
        self, context: EpisodeContext, backend: ModelBackend
    ) -> tuple[CaptureProxy | None, CommandBridge, ScaffoldRun, ScaffoldExit, float]:
        cfg = self.agent.config
        assert self.sandbox is not None
        run_dir = context.tmp_dir / "scaffold"
        run_dir.mkdir(parents=True, exist_ok=True)
        stopping = context.stopping
        timeout_s = stopping.timeout_s or cfg.default_timeout_s
        began = time.monotonic()
        async with contextlib.AsyncExitStack() as stack:
            proxy: CaptureProxy | None = None
            if cfg.capture_tokens:
                assert cfg.proxy is not None
                proxy = cfg.proxy(
                    backend=backend,
                    tokenizer=cfg.tokenizer,
                    task_id=f"{context.sample_id}.{context.attempt}",
                )
                await stack.enter_async_context(proxy)
                base_url = proxy.url + "/v1"
            else:
                base_url = backend.base_url.rstrip("/") + "/v1"
            bridge = await stack.enter_async_context(
                CommandBridge(self.sandbox, command_timeout_s=cfg.command_timeout_s)
            )
            run = ScaffoldRun(
                run_dir=run_dir,
                base_url=base_url,
                model_name=cfg.model_name,
                bridge=bridge.address,
                instruction=cfg.task.instruction(self.task),
                max_turns=stopping.max_turns or cfg.default_max_turns,
                max_new_tokens=stopping.max_new_tokens or cfg.default_max_new_tokens,
                timeout_s=timeout_s,
                context_cap=cfg.context_cap,
                sampling=context.sampling_params.as_request(),
                seed=context.seed,
            )
            invocation = cfg.scaffold.prepare(run)
            exit_code, timed_out, log_tail = await run_scaffold(
                invocation.argv,
                env={**base_env(run_dir), **cfg.extra_env, **invocation.env},
                cwd=run_dir,
                timeout_s=timeout_s,
            )
            # The proxy stops with this block, so its series is final below.
        elapsed = time.monotonic() - began
        exit = ScaffoldExit(
            exit_code=exit_code,
            timed_out=timed_out,
            log_tail=log_tail,
            report=cfg.scaffold.parse(run),
        )
        return proxy, bridge, run, exit, elapsed

    def _result(
        self,
        context: EpisodeContext,
        proxy: CaptureProxy | None,
        reason: TerminationReason,
        report: ScaffoldReport,
    ) -> AgentResult:
        cfg = self.agent.config
        record = self.record
        assert record is not None
        code = record.exit.exit_code
        metrics = {
            "scaffold_exit_code": float(code if code is not None else -1),
            "scaffold_steps": float(report.steps),
            "scaffold_seconds": round(record.elapsed_s, 3),
            "bridge_commands": float(record.bridge_commands),
        }
        text = report.submission or _last_assistant(report)
        if proxy is None:
            return AgentResult(termination_reason=reason, metrics=metrics, text=text)
        series = proxy.trajectory()
        if series is None:
            raise AgentError(
                f"sample {context.sample_id}: scaffold {cfg.scaffold.name} ran, but token "
                f"capture was turned off ({proxy.invalid_reason or 'nothing was generated'}); "
                "the episode has no token data to train on"
            )
        length = len(series.prompt_token_ids) + len(series.response_token_ids)
        result = series.agent_result(capped(reason, length, cfg.context_cap), text=text)
        return result.model_copy(
            update={"metrics": {**result.metrics, **metrics, "capture_valid": 1.0}}
        )

    async def eval(self, context: EpisodeContext, result: AgentResult) -> Reward:
        if self.sandbox is None or self.record is None:
            raise AgentError(
                f"sample {context.sample_id} attempt {context.attempt}: eval before run"
            )
        return await self.agent.config.task.verify(self.task, self.sandbox)

    async def cleanup(self, context: EpisodeContext) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.stop()


def _keep_logs(
    logs_dir: Path | None, context: EpisodeContext, run_dir: Path, artifact: dict[str, str]
) -> Path | None:
    (run_dir / "artifact.json").write_text(json.dumps(artifact, indent=2, sort_keys=True))
    if logs_dir is None:
        return None
    dest = logs_dir / context.rollout_id / f"{context.sample_id}.{context.attempt}"
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("home"))
    return dest


def capped(reason: TerminationReason, series_length: int, context_cap: int) -> TerminationReason:
    """``max_context`` when a captured series reached the installed-scaffold cap and the run
    ended on its own terms (an abort keeps its class); else ``reason``."""
    if series_length >= context_cap and not reason.is_abort:
        return TerminationReason.MAX_CONTEXT
    return reason


def _last_assistant(report: ScaffoldReport) -> str:
    for message in reversed(report.messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


def _abort_error(
    reason: TerminationReason, name: str, exit: ScaffoldExit, logs: Path, bridge: CommandBridge
) -> Exception:
    status = exit.report.status or "no status"
    what = (
        "ran past its wall clock"
        if exit.timed_out
        else f"ended with exit code {exit.exit_code} ({status})"
    )
    message = f"scaffold {name} {what}; its logs are in {logs}"
    if reason is TerminationReason.AGENT_TIMEOUT:
        return EpisodeTimeout(message)
    if reason is TerminationReason.INFRA_CONN:
        return BackendUnavailable(f"{message}; the model server could not be reached")
    if reason is TerminationReason.INFRA_SANDBOX:
        return SandboxError(f"{message}; sandbox failures: {bridge.sandbox_failures[:3]}")
    return AgentError(message)
