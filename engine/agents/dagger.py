"""``DAggerAgent``: the native tool agent with a teacher that may act instead of the student.

DAgger rollin, per turn of a ``ToolAgent`` episode:

1. a draw ``u`` in [0, 1) is made from ``context.seed`` and the turn index alone
   (``dagger_draw``), so a re-run attempt reproduces every decision;
2. the teacher acts when ``u < context.dagger_beta`` (``None``: 0, student-only, as in eval)
   and the turn is below ``context.t_max`` (``None``: no limit): ``TeacherBackend.label_turn``
   answers in the teacher's own format, and its action is written in the student's format
   (``<tool_call>`` blocks, the student's tokenizer, its end-of-turn token). Those tokens enter
   the series with ``loss_mask`` 0 and logprob 0.0, and the sandbox runs the teacher's calls;
3. otherwise, or when the teacher gives no usable label (a failure, or a reply over the
   turn's token budget), the student's turn stands.

The trajectory also records ``AgentResult.teacher_mask`` (1 on every teacher token),
``student_cut_points`` (where each student turn begins) and the metrics ``dagger_beta``,
``dagger_t_max`` (-1: none), ``dagger_teacher_turns``, ``dagger_label_failures``,
``dagger_draw_<turn>`` and ``dagger_teacher_<turn>``.

The agent uses the teacher it is given and never closes it. Without one, a turn the teacher
should act on fails the sample with a ``ConfigError`` naming the missing setting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.agents.base import AgentResult, EpisodeContext
from engine.agents.tool_agent import (
    ToolAgent,
    ToolAgentConfig,
    TurnAction,
    TurnInput,
    Verifier,
)
from engine.backends.base import GenerationResult
from engine.backends.teacher import TeacherBackend, TeacherLabel
from engine.backends.toolcalls import render_tool_call
from engine.errors import ConfigError

__all__ = ["DAggerAgent", "DAggerConfig", "dagger_draw", "teacher_acts"]

TEACHER = "teacher"


@dataclass(frozen=True, kw_only=True)
class DAggerConfig:
    """How the teacher is asked: its sampling parameters (greedy unless given); each request
    also gets the turn's ``max_new_tokens``."""

    teacher_sampling: Mapping[str, Any] = field(default_factory=lambda: {"temperature": 0.0})


def dagger_draw(seed: int, turn: int) -> float:
    """The turn's draw in [0, 1): a function of the episode seed and the turn index only."""
    digest = hashlib.blake2b(f"dagger\0{seed}\0{turn}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


def teacher_acts(draw: float, *, beta: float | None, t_max: int | None, turn: int) -> bool:
    """Whether the teacher executes turn ``turn`` given its ``draw``."""
    if beta is None or beta <= 0.0:
        return False
    if t_max is not None and turn >= t_max:
        return False
    return draw < beta


class DAggerAgent(ToolAgent):
    """A ``ToolAgent`` whose turns the teacher may execute."""

    def __init__(
        self,
        config: ToolAgentConfig,
        *,
        verifier: Verifier,
        teacher: TeacherBackend | None,
        dagger: DAggerConfig | None = None,
        tokenizer: Any | None = None,
    ) -> None:
        super().__init__(config, verifier=verifier, tokenizer=tokenizer)
        self.teacher = teacher
        self.dagger = dagger or DAggerConfig()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ConfigError(
                f"DAggerAgent: tokenizer {getattr(self.tokenizer, 'name_or_path', '?')} has no "
                "end-of-turn (eos) token to close a teacher's turn with"
            )
        self._eos = eos
        self._schemas = [tool.schema() for tool in config.tools]

    async def _act(self, step: TurnInput) -> TurnAction:
        context = step.context
        if not teacher_acts(
            dagger_draw(context.seed, step.turn),
            beta=context.dagger_beta,
            t_max=context.t_max,
            turn=step.turn,
        ):
            return await super()._act(step)
        budget = int(step.sampling_params["max_new_tokens"])
        where = f"sample {context.sample_id} turn {step.turn}"
        if self.teacher is None:
            raise ConfigError(
                f"{where}: dagger_beta {context.dagger_beta} asks the teacher to act, but this "
                "worker has no teacher: start it with --teacher-url (ROLLOUT_TEACHER_URL)"
            )
        label = await self.teacher.label_turn(
            step.history,
            tools=self._schemas,
            sampling_params={**self.dagger.teacher_sampling, "max_new_tokens": budget},
            where=where,
        )
        try:
            ids = None if label is None else self.student_tokens(label)
        except ValueError:  # a call whose arguments are no JSON object: no usable label
            ids = None
        if ids is None or len(ids) > budget:
            student = await super()._act(step)
            return TurnAction(
                gen=student.gen,
                token_ids=student.token_ids,
                logprobs=student.logprobs,
                source="student:no_label",
            )
        assert label is not None
        gen = GenerationResult(
            text=label.text,
            token_ids=ids,
            logprobs=tuple(0.0 for _ in ids),
            finish_reason=label.finish_reason,
        )
        return TurnAction(
            gen=gen, token_ids=ids, logprobs=gen.logprobs or (), trained=False, source=TEACHER
        )

    def student_tokens(self, label: TeacherLabel) -> tuple[int, ...]:
        """The teacher's action written as the student would: prose, then one ``<tool_call>``
        block per call, in the student's tokens, closed with its end-of-turn token."""
        parts = [label.content] if label.content else []
        parts += [render_tool_call(call.name, call.parsed_arguments()) for call in label.tool_calls]
        return (*self.chat.encode("\n".join(parts)), self._eos)

    def final_text(self, result: AgentResult) -> str:
        """The last turn's action, the student's or the teacher's (a teacher's tokens are
        ``loss_mask`` 0, so ``last_generation`` alone would miss them)."""
        if not result.turns:
            return ""
        last = result.turns[-1]
        start = last.prompt_tokens - len(result.prompt_token_ids)
        ids = result.response_token_ids.tolist()[start : start + last.response_tokens]
        return self.chat.decode(ids, skip_special_tokens=True)

    def _finish_result(
        self, result: AgentResult, actions: Sequence[TurnAction], context: EpisodeContext
    ) -> AgentResult:
        n = len(result.response_token_ids)
        base = len(result.prompt_token_ids)
        mask = [0] * n
        cuts: list[int] = []
        metrics = dict(result.metrics)
        beta = context.dagger_beta
        metrics["dagger_beta"] = float(beta or 0.0)
        metrics["dagger_t_max"] = float(-1 if context.t_max is None else context.t_max)
        failures = 0
        for record, action in zip(result.turns, actions, strict=True):
            start = record.prompt_tokens - base
            metrics[f"dagger_draw_{record.index}"] = dagger_draw(context.seed, record.index)
            is_teacher = action.source == TEACHER
            metrics[f"dagger_teacher_{record.index}"] = float(is_teacher)
            failures += action.source == "student:no_label"
            if is_teacher:
                mask[start : start + len(action.token_ids)] = [1] * len(action.token_ids)
            elif action.token_ids:
                cuts.append(start)
        metrics["dagger_teacher_turns"] = float(sum(a.source == TEACHER for a in actions))
        metrics["dagger_label_failures"] = float(failures)
        fields = {name: getattr(result, name) for name in type(result).model_fields}
        fields.update(teacher_mask=mask, student_cut_points=tuple(cuts), metrics=metrics)
        return type(result)(**fields)
