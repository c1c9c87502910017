"""DAgger end to end on real models: the student (the agents' tinylm, served in-process) and a
teacher of *another vocabulary* (another seed and BPE budget, a tinylm subprocess), both over
real sockets, with the real local sandbox.

Both are overfit on the same math episode, so greedy decoding acts the same; at beta 1 every
action is the teacher's, labelled in the teacher's tokens and written back in the student's,
and the trajectory must be token for token the one the student produces on its own at beta 0,
with the masks swapped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from engine.agents.base import AgentResult
from engine.agents.dagger import DAggerAgent
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig, load_tokenizer
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.domain import TerminationReason
from engine.sandbox import LocalSandboxProvider
from engine.tasks.evaluators import math_agent_config
from engine.tasks.math import MathVerifier
from tests.agents.conftest import MATH_EPISODE, make_context, make_task, run_episode
from tests.conftest import overfit_tinylm
from tinylm.model import ModelSize
from tinylm.process import ServerProcess
from tinylm.server import TinyLMServer


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dagger-teacher") / "model"
    return overfit_tinylm(path, MATH_EPISODE, seed=11, size=ModelSize(vocab_size=700))


async def run_dagger(
    tokenizer: Any,
    server: TinyLMServer,
    teacher_server: ServerProcess,
    teacher_dir: Path,
    provider: LocalSandboxProvider,
    tmp_path: Path,
    beta: float,
) -> tuple[AgentResult, float]:
    teacher = TeacherBackend(
        config=TeacherConfig(url=teacher_server.url, tokenizer_path=teacher_dir)
    )
    backends = BackendPool(
        server.url,
        build=lambda url: SGLangBackend(config=SGLangConfig(url=url), tokenizer=tokenizer),
    )
    agent = DAggerAgent(
        math_agent_config(), verifier=MathVerifier(), teacher=teacher, tokenizer=tokenizer
    )
    task = make_task()
    context = dataclasses.replace(
        make_context(task, sandboxes=provider, backends=backends, tmp_path=tmp_path / str(beta)),
        dagger_beta=beta,
        seed=3,
    )
    try:
        result, reward = await run_episode(agent, task, context)
    finally:
        await backends.aclose()
        await teacher.aclose()
    assert isinstance(reward, dict)
    return result, reward["score"]


async def test_a_teacher_of_another_vocabulary_acts_in_the_students_tokens(
    tokenizer: Any,
    server: TinyLMServer,
    teacher_server: ServerProcess,
    teacher_dir: Path,
    provider: LocalSandboxProvider,
    tmp_path: Path,
) -> None:
    assert load_tokenizer(teacher_dir).get_vocab() != tokenizer.get_vocab()
    student, student_score = await run_dagger(
        tokenizer, server, teacher_server, teacher_dir, provider, tmp_path, beta=0.0
    )
    taught, taught_score = await run_dagger(
        tokenizer, server, teacher_server, teacher_dir, provider, tmp_path, beta=1.0
    )
    assert student_score == taught_score == 1.0
    assert taught.termination_reason is TerminationReason.FINISH
    assert taught.metrics["dagger_teacher_turns"] == 2.0
    assert taught.metrics["dagger_label_failures"] == 0.0
    assert taught.response_token_ids == student.response_token_ids
    assert taught.teacher_mask == student.loss_mask
    assert set(taught.loss_mask) == {0}
    assert taught.student_cut_points == () and student.student_cut_points == (
        0,
        student.student_cut_points[1],
    )
