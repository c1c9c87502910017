"""The bundled ``dagger`` binding: its rollout config is served by the bundled profiles, and
its agent without a worker teacher says which setting is missing."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest

from engine.agents.dagger import DAggerAgent
from engine.config.evaluators import load_profiles
from engine.config.rollout import load_rollout_config
from engine.errors import ConfigError
from engine.sandbox import LocalSandboxConfig, LocalSandboxProvider
from engine.sandbox.base import MANAGED_LABEL
from engine.tasks import DAGGER_ROLLOUT_CONFIG, EVALUATOR_CONFIG
from engine.tasks.evaluators import build_agents
from tests.agents.conftest import ScriptedGenerate, make_context, make_task, run_episode


def test_the_dagger_rollout_config_routes_to_the_dagger_binding() -> None:
    config = load_rollout_config(DAGGER_ROLLOUT_CONFIG)
    assert config.task_types == {"dagger"}
    assert "dagger" in load_profiles(EVALUATOR_CONFIG, argparse.Namespace())


async def test_a_teacher_turn_without_a_worker_teacher_names_the_setting(
    tinylm_dir: Path, tmp_path: Path
) -> None:
    agent = build_agents(argparse.Namespace(model_dir=tinylm_dir))["dagger"]
    assert isinstance(agent, DAggerAgent) and agent.teacher is None
    student = ScriptedGenerate(agent.tokenizer, [])
    task = make_task()
    # Not pytest's tmp_path: that is 0700, and sandboxes may run under another uid.
    root = Path(tempfile.mkdtemp(prefix="rollout-lanes-tests-"))
    root.chmod(0o711)
    provider = LocalSandboxProvider(LocalSandboxConfig(root=root))
    context = dataclasses.replace(
        make_context(task, sandboxes=provider, backends=student.backends, tmp_path=tmp_path),
        dagger_beta=1.0,
    )
    try:
        with pytest.raises(ConfigError, match=r"no teacher: start it with --teacher-url"):
            await run_episode(agent, task, context)
    finally:
        await provider.reap({MANAGED_LABEL: "1"})
        provider.close()
        shutil.rmtree(root, ignore_errors=True)
    assert student.requests == []  # the student was not asked either
