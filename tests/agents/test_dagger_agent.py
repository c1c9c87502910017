"""``DAggerAgent`` on scripted student and teacher ``/generate`` servers (real tokenizer, real
backends over ``httpx.MockTransport``, the real local sandbox).

The student and the teacher are each a ``ScriptedGenerate``: a turn's action is whichever one
the seeded draw picked, so each script holds exactly the replies of the turns it acts in, and a
request beyond its script fails the test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.agents.base import AgentResult
from engine.agents.dagger import DAggerAgent, dagger_draw, teacher_acts
from engine.agents.tool_agent import ToolAgent
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.backends.toolcalls import render_tool_call
from engine.domain import TerminationReason
from engine.events.arrays import LogProbs
from engine.sandbox import LocalSandboxProvider
from engine.tasks.evaluators import math_agent_config
from engine.tasks.math import MathVerifier
from tests.agents.conftest import Reply, ScriptedGenerate, make_context, make_task, run_episode

QUESTION = "What is 6 * 7?"
ANSWER = "The answer is <answer>42</answer>"


def call(code: str) -> str:
    return render_tool_call("python", {"code": code})


def teacher_on(script: ScriptedGenerate) -> TeacherBackend:
    return TeacherBackend(
        config=TeacherConfig(url="http://teacher.invalid"),
        tokenizer=script.tokenizer,
        transport=httpx.MockTransport(script.handle),
    )


async def episode(
    tokenizer: Any,
    provider: LocalSandboxProvider,
    tmp_path: Path,
    *,
    student: list[Reply],
    teacher: list[Reply],
    beta: float | None,
    t_max: int | None = None,
    seed: int = 0,
) -> tuple[AgentResult, ScriptedGenerate, ScriptedGenerate]:
    student_script = ScriptedGenerate(tokenizer, student)
    teacher_script = ScriptedGenerate(tokenizer, teacher)
    agent = DAggerAgent(
        math_agent_config(),
        verifier=MathVerifier(),
        teacher=teacher_on(teacher_script),
        tokenizer=tokenizer,
    )
    task = make_task(QUESTION, "42")
    context = dataclasses.replace(
        make_context(
            task,
            sandboxes=provider,
            backends=student_script.backends,
            tmp_path=tmp_path / f"b{beta}-t{t_max}-s{seed}",
            max_turns=6,
        ),
        dagger_beta=beta,
        t_max=t_max,
        seed=seed,
    )
    result, reward = await run_episode(agent, task, context)
    assert isinstance(reward, dict) and reward["score"] == 1.0
    return result, student_script, teacher_script


def ids_of(tokenizer: Any, text: str) -> list[int]:
    eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], eos]


def starts(result: AgentResult) -> list[int]:
    return [t.prompt_tokens - len(result.prompt_token_ids) for t in result.turns]


async def test_beta_zero_is_the_student_only_trajectory(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    replies = [Reply(call("print(6 * 7)")), Reply(ANSWER)]
    plain_script = ScriptedGenerate(tokenizer, replies)
    plain = ToolAgent(math_agent_config(), verifier=MathVerifier(), tokenizer=tokenizer)
    task = make_task(QUESTION, "42")
    reference, _ = await run_episode(
        plain,
        task,
        make_context(
            task, sandboxes=provider, backends=plain_script.backends, tmp_path=tmp_path / "p"
        ),
    )
    for beta in (None, 0.0):
        result, _student, teacher = await episode(
            tokenizer, provider, tmp_path, student=replies, teacher=[], beta=beta, seed=17
        )
        assert teacher.requests == []  # never asked
        assert result.response_token_ids == reference.response_token_ids
        assert result.loss_mask == reference.loss_mask
        assert result.response_logprobs == reference.response_logprobs
        assert result.teacher_mask is not None and set(result.teacher_mask) == {0}
        assert result.student_cut_points == tuple(starts(result)) == (0, starts(result)[1])
        assert result.metrics["dagger_teacher_turns"] == 0.0
        assert result.metrics["dagger_beta"] == 0.0


async def test_beta_one_is_the_teacher_only_trajectory(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    """The teacher acts in every turn: the student is never sampled; the same actions give the
    same tokens as a student-only run, all out of the student's loss and all teacher's."""
    replies = [Reply(call("print(6 * 7)")), Reply(ANSWER)]
    student_only, _, _ = await episode(
        tokenizer, provider, tmp_path, student=replies, teacher=[], beta=0.0
    )
    result, student, teacher = await episode(
        tokenizer, provider, tmp_path, student=[], teacher=replies, beta=1.0, seed=5
    )
    assert student.requests == [] and len(teacher.requests) == 2
    assert result.termination_reason is TerminationReason.FINISH
    assert result.response_token_ids == student_only.response_token_ids
    assert set(result.loss_mask) == {0}
    assert set(result.response_logprobs) == {0.0}
    assert result.teacher_mask == student_only.loss_mask  # exactly the action tokens
    assert result.student_cut_points == ()
    assert result.metrics["dagger_teacher_turns"] == 2.0
    assert result.metrics["generated_tokens"] == 0.0
    # The teacher read the conversation the student's series holds (same template here).
    assert teacher.requests[0]["input_ids"] == list(result.prompt_token_ids)
    first = ids_of(tokenizer, call("print(6 * 7)"))
    assert list(result.response_token_ids[: len(first)]) == first


async def test_mixed_turns_mask_and_cut_points_against_a_hand_built_trajectory(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    seed, beta = 4, 0.5  # draws 0.98, 0.31, 0.97, 0.06: student, teacher, student, teacher
    pattern = [teacher_acts(dagger_draw(seed, t), beta=beta, t_max=None, turn=t) for t in range(4)]
    assert pattern == [False, True, False, True]
    student = [Reply(call("print(1)")), Reply(call("print(3)"))]
    teacher = [Reply(call("print(2)")), Reply(ANSWER)]
    result, s_script, t_script = await episode(
        tokenizer, provider, tmp_path, student=student, teacher=teacher, beta=beta, seed=seed
    )
    assert len(s_script.requests) == 2 and len(t_script.requests) == 2
    actions = [
        (ids_of(tokenizer, call("print(1)")), False),
        (ids_of(tokenizer, call("print(2)")), True),
        (ids_of(tokenizer, call("print(3)")), False),
        (ids_of(tokenizer, ANSWER), True),
    ]
    at = starts(result)
    assert len(at) == 4 and at[0] == 0
    n = len(result.response_token_ids)
    want_teacher = [0] * n
    want_loss = [0] * n
    for (ids, by_teacher), start in zip(actions, at, strict=True):
        assert list(result.response_token_ids[start : start + len(ids)]) == ids
        target = want_teacher if by_teacher else want_loss
        target[start : start + len(ids)] = [1] * len(ids)
    assert at[3] + len(actions[3][0]) == n  # the episode ends on the teacher's answer
    assert list(result.teacher_mask or []) == want_teacher
    assert list(result.loss_mask) == want_loss
    assert result.student_cut_points == (at[0], at[2])
    for t in range(4):
        assert result.metrics[f"dagger_draw_{t}"] == dagger_draw(seed, t)
        assert result.metrics[f"dagger_teacher_{t}"] == float(pattern[t])
    # The student's logprobs are the server's on its tokens, 0.0 on the teacher's.
    gen0 = s_script.outputs[0]
    assert result.response_logprobs[: len(gen0[0])] == LogProbs.from_values(gen0[1])
    assert set(result.response_logprobs[at[1] : at[1] + len(actions[1][0])]) == {0.0}

    # The same seed reproduces every decision and every token.
    again, _, _ = await episode(
        tokenizer,
        provider,
        tmp_path / "again",
        student=student,
        teacher=teacher,
        beta=beta,
        seed=seed,
    )
    assert again.response_token_ids == result.response_token_ids
    assert again.teacher_mask == result.teacher_mask


async def test_t_max_bounds_the_teacher_and_a_failed_label_leaves_the_student_turn(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    # t_max=1 at beta=1: the teacher acts in turn 0 only.
    result, student, teacher = await episode(
        tokenizer,
        provider,
        tmp_path,
        student=[Reply(ANSWER)],
        teacher=[Reply(call("print(6 * 7)"))],
        beta=1.0,
        t_max=1,
    )
    assert len(teacher.requests) == 1 and len(student.requests) == 1
    assert [result.metrics[f"dagger_teacher_{t}"] for t in range(2)] == [1.0, 0.0]
    assert result.student_cut_points == (starts(result)[1],)
    assert result.metrics["dagger_t_max"] == 1.0

    # t_max=0: no teacher at all, whatever beta says.
    result0, _, teacher0 = await episode(
        tokenizer, provider, tmp_path, student=[Reply(ANSWER)], teacher=[], beta=1.0, t_max=0
    )
    assert teacher0.requests == [] and result0.metrics["dagger_teacher_turns"] == 0.0

    # A teacher whose script is empty answers 500: no label, the student acts, it is counted.
    failed, student2, teacher2 = await episode(
        tokenizer,
        provider,
        tmp_path,
        student=[Reply(call("print(6 * 7)")), Reply(ANSWER)],
        teacher=[],
        beta=1.0,
    )
    assert len(teacher2.requests) >= 2 and len(student2.requests) == 2
    assert failed.metrics["dagger_teacher_turns"] == 0.0
    assert failed.metrics["dagger_label_failures"] == 2.0
    assert failed.teacher_mask is not None and set(failed.teacher_mask) == {0}
    assert sum(failed.loss_mask) == sum(len(ids) for ids, _ in student2.outputs)


def test_a_result_refuses_a_teacher_mask_or_cut_points_that_do_not_fit() -> None:
    base = {
        "response_token_ids": [5, 6, 7],
        "loss_mask": [1, 0, 0],
        "termination_reason": TerminationReason.FINISH,
    }
    ok = AgentResult(**base, teacher_mask=[0, 1, 1], student_cut_points=(0,))
    assert list(ok.teacher_mask or []) == [0, 1, 1]
    for bad, match in (
        ({"teacher_mask": [0, 1]}, "teacher_mask has 2 entries for 3"),
        ({"teacher_mask": [0, 2, 1]}, "teacher_mask entries must be 0 or 1"),
        ({"student_cut_points": (2, 1)}, "student_cut_points must be increasing"),
        ({"student_cut_points": (3,)}, "student_cut_points must be increasing"),
    ):
        with pytest.raises(ValueError, match=match):
            AgentResult(**base, **bad)
