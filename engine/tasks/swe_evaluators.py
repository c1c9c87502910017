"""Evaluator config of the bundled ``swe`` task: mini-swe-agent through the recording proxy.

Pass this file as ``--evaluator-config`` with ``engine/tasks/swe_rollout.yaml``. Its one
profile, ``swe``, runs ``InstalledAgent`` with the ``MiniSweAgent`` plug-in on ``SweTask``; a
``RecordingProxy`` per task captures the tokens unless ``args.capture_tokens`` is false (eval
of a black-box scaffold). ``build_agents`` reads ``tokenizer_path`` or ``model_dir`` (the
proxy's tokenizer), and optionally ``sglang_url``, ``scaffold_logs_dir`` (keep each run's
folder) and ``capture_tokens``. mini-swe-agent must be installed on the worker
(``pip install 'rollout-engine[scaffolds]'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.agents.base import BaseAgent
from engine.agents.installed import InstalledAgent, InstalledAgentConfig
from engine.agents.scaffolds import MiniSweAgent
from engine.backends.sglang import load_tokenizer
from engine.domain import EvaluatorProfile, Resource, StoppingCriteria
from engine.errors import ConfigError
from engine.proxy import RecordingProxy
from engine.sandbox import SandboxLimits
from engine.tasks.swe import SweTask

__all__ = ["DEFAULT_STOPPING", "build_agents", "evaluator_profiles", "swe_agent_config"]

DEFAULT_STOPPING = StoppingCriteria(
    max_turns=6, max_context_len=2048, max_new_tokens=96, timeout_s=240.0
)

_SANDBOX_LIMITS = SandboxLimits(
    cpu_time_s=10.0, memory_mb=512, max_procs=64, wall_timeout_s=30.0,
    max_output_bytes=16 * 1024,
)  # fmt: skip


def evaluator_profiles(args: Any) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="swe",
            batch_size=4,
            resource=Resource(concurrency=4, cpu=4.0, memory_gb=4.0),
            run_resource=Resource(cpu=0.5, memory_gb=1.0),
            eval_resource=Resource(cpu=0.25, memory_gb=0.5),
            default_stopping=DEFAULT_STOPPING,
        )
    ]


def _get(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def swe_agent_config(
    *, tokenizer: Any, capture_tokens: bool = True, logs_dir: Path | None = None,
    model_url: str | None = None,
) -> InstalledAgentConfig:  # fmt: skip
    return InstalledAgentConfig(
        scaffold=MiniSweAgent(),
        task=SweTask(),
        capture_tokens=capture_tokens,
        proxy=RecordingProxy if capture_tokens else None,
        tokenizer=tokenizer,
        model_url=model_url,
        sandbox_limits=_SANDBOX_LIMITS,
        logs_dir=logs_dir,
    )


def build_agents(args: Any) -> dict[str, BaseAgent]:
    path = _get(args, "tokenizer_path") or _get(args, "model_dir")
    if not path:
        raise ConfigError(
            "swe_evaluators.build_agents needs args.model_dir (or args.tokenizer_path): the "
            "policy's folder, whose tokenizer the recording proxy uses"
        )
    capture = _get(args, "capture_tokens")
    capture_tokens = capture is None or str(capture).lower() not in ("0", "false", "no")
    logs = _get(args, "scaffold_logs_dir")
    return {
        "swe": InstalledAgent(
            swe_agent_config(
                tokenizer=load_tokenizer(str(path)),
                capture_tokens=capture_tokens,
                logs_dir=Path(logs) if logs else None,
                model_url=_get(args, "sglang_url") or None,
            )
        )
    }
