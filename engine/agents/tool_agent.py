"""``ToolAgent``: a native token-level multi-turn tool agent.

One episode, for one sample: ``init`` opens and starts the episode's sandbox (labelled for the
attempt); ``run`` renders the conversation (system prompt, tools, the task's prompt) into the
prompt token ids, then loops: generate on the whole series; append the generated ids
*verbatim* with ``loss_mask`` 1 and the server's logprobs; parse ``<tool_call>`` blocks; run
each call in the sandbox; append the observation increment (``chat_tokens``) with
``loss_mask`` 0 and logprob 0.0. ``eval`` hands the finished episode to the configured
``Verifier`` (the agent knows no task type); ``cleanup`` stops the sandbox, whatever happened.

Stop conditions, checked after each generation in this order:

1. the text holds a final answer (``answer_pattern``): ``finish``;
2. the trajectory would have spanned more weight versions than its request allows (the
   backend ended the turn with ``finish_reason`` ``version_span``): ``version_span``;
3. the generation hit its token budget: ``max_context`` when that budget was what was left of
   ``max_context_len``, else ``length``;
4. no tool call and no malformed tool-call block: ``finish``;
5. this was turn ``max_turns``: ``max_turns`` (its calls are not run: nothing would read them);
6. the observation would leave no room for another token within ``max_context_len``:
   ``max_context`` (the observation is not appended).

Each turn's budget is ``min(max_new_tokens, max_context_len - len(series))``; every turn gets
a ``TurnRecord``; ``timeout_s`` is the evaluator's (it cancels the episode). When the sampling
params set ``sampling_seed``, each turn gets a seed derived from it, ``context.seed``, the
sample id and the turn, so a group's samples and turns differ and a re-run attempt reproduces
its episode; without it no seed is sent (not every SGLang deployment accepts one).

What the *model* gets wrong (unknown tool, bad arguments, a failing command) becomes an
observation and a ``tool_<outcome>`` metric; what the *infrastructure* gets wrong raises and
aborts the sample: ``GenerationAborted``, ``BackendProtocolError`` (no token ids, an error
finish), ``BackendError``, ``SandboxError``, ``AgentError`` (a template that cannot be
extended token-exactly).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import JsonValue

from engine.agents.base import (
    AgentResult,
    Episode,
    EpisodeAgent,
    EpisodeContext,
    Reward,
    TurnRecord,
    episode_labels,
)
from engine.agents.chat_tokens import ChatTokens, Message, TokenSeries
from engine.agents.tools import PythonTool, SandboxTool, ToolCounts, run_tool_calls
from engine.backends.base import FinishReason, GenerationResult, ModelBackend
from engine.backends.sglang import load_tokenizer
from engine.backends.toolcalls import parse_tool_calls
from engine.domain import StoppingCriteria, Task, TerminationReason
from engine.errors import (
    AgentError,
    BackendProtocolError,
    ConfigError,
    GenerationAborted,
    SandboxError,
)
from engine.sandbox import Sandbox, SandboxLimits

__all__ = [
    "FinishedEpisode",
    "ToolAgent",
    "ToolAgentConfig",
    "ToolEpisode",
    "TurnAction",
    "TurnInput",
    "Verdict",
    "Verifier",
    "derive_turn_seed",
    "episode_labels",
    "last_generation",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ToolAgentConfig:
    """What a ``ToolAgent`` offers the model and how it talks to the server and the sandbox.

    ``tokenizer_path``: a local Hugging Face folder with the policy's tokenizer and chat
    template (or pass ``tokenizer=``). ``sglang_url``: the endpoint in ``context.backends``
    (``None``: the worker's default). ``answer_pattern``: a regex whose match ends the episode
    as ``finish``. ``tool_timeout_s``: wall clock per call (capped by the sandbox's limits).
    ``max_observation_chars``: each tool output is clipped to about this. Calls past
    ``max_tool_calls_per_turn`` get an error observation. ``default_*`` stand where
    ``context.stopping`` leaves a limit unset.
    """

    tools: tuple[SandboxTool, ...] = (PythonTool(),)
    system_prompt: str | None = None
    tokenizer_path: Path | None = None
    sglang_url: str | None = None
    answer_pattern: str = r"<answer>(.*?)</answer>"
    sandbox_limits: SandboxLimits | None = None
    tool_timeout_s: float = 30.0
    max_observation_chars: int = 2000
    max_tool_calls_per_turn: int = 4
    default_max_turns: int = 8
    default_max_context_len: int = 4096
    default_max_new_tokens: int = 512

    def __post_init__(self) -> None:
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ConfigError(f"ToolAgentConfig.tools: tool names must be distinct, got {names}")
        for tool in self.tools:
            if not isinstance(tool, SandboxTool):
                raise ConfigError(
                    f"ToolAgentConfig.tools: {tool!r} is not a SandboxTool (name, schema, command)"
                )
        try:
            re.compile(self.answer_pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError(
                f"ToolAgentConfig.answer_pattern {self.answer_pattern!r} is not a regex: {exc}"
            ) from None
        if not self.tool_timeout_s > 0:
            raise ConfigError(
                f"ToolAgentConfig.tool_timeout_s must be > 0, got {self.tool_timeout_s}"
            )
        for name in (
            "max_observation_chars",
            "max_tool_calls_per_turn",
            "default_max_turns",
            "default_max_context_len",
            "default_max_new_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"ToolAgentConfig.{name} must be a positive integer, got {value!r}"
                )


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verifier's judgement: the score and a JSON detail for diagnostics."""

    score: float
    detail: Mapping[str, JsonValue] = field(default_factory=dict)

    def as_reward(self) -> dict[str, float]:
        """``{"score": score}`` plus the numeric and boolean detail entries as floats (a reward
        dict holds floats only; text detail goes to the log)."""
        reward = {"score": float(self.score)}
        for key, value in self.detail.items():
            if isinstance(value, bool | int | float) and key != "score":
                reward[key] = float(value)
        return reward


@dataclass(frozen=True, slots=True)
class FinishedEpisode:
    """What a verifier sees: the trajectory, the last generated turn's text, the sandbox."""

    result: AgentResult
    final_text: str
    sandbox: Sandbox


class Verifier(Protocol):
    """Scores a finished episode of one task type."""

    async def verify(self, task: Task, episode: FinishedEpisode) -> Verdict: ...


def derive_turn_seed(base: int, *, episode_seed: int, sample_id: str, turn: int) -> int:
    """The sampling seed of one turn: a function of its arguments only, in 0..2**31-1."""
    key = f"{base}\0{episode_seed}\0{sample_id}\0{turn}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def last_generation(result: AgentResult) -> tuple[int, ...]:
    """The token ids of the last run of ``loss_mask`` 1 tokens: the last generated turn."""
    end = len(result.loss_mask)
    while end > 0 and result.loss_mask[end - 1] == 0:
        end -= 1
    start = end
    while start > 0 and result.loss_mask[start - 1] == 1:
        start -= 1
    return tuple(result.response_token_ids.tolist()[start:end])


@dataclass(frozen=True, slots=True)
class _Limits:
    max_turns: int
    max_context: int
    max_new: int

    @classmethod
    def of(cls, cfg: ToolAgentConfig, stopping: StoppingCriteria) -> _Limits:
        return cls(
            max_turns=stopping.max_turns or cfg.default_max_turns,
            max_context=stopping.max_context_len or cfg.default_max_context_len,
            max_new=stopping.max_new_tokens or cfg.default_max_new_tokens,
        )


def _turn_params(
    sampling: Mapping[str, Any], context: EpisodeContext, turn: int, budget: int
) -> dict[str, Any]:
    params: dict[str, Any] = {**sampling, "max_new_tokens": budget}
    base_seed = sampling.get("sampling_seed")
    if isinstance(base_seed, int):
        params["sampling_seed"] = derive_turn_seed(
            base_seed, episode_seed=context.seed, sample_id=context.sample_id, turn=turn
        )
    return params


@dataclass(frozen=True, slots=True)
class TurnInput:
    """What ``ToolAgent._act`` decides one turn from."""

    context: EpisodeContext
    backend: ModelBackend
    input_ids: list[int]
    history: list[Message]
    sampling_params: Mapping[str, Any]
    turn: int


@dataclass(frozen=True, slots=True)
class TurnAction:
    """One turn's action as token ids of the policy's tokenizer. Untrained ones (a teacher's)
    enter the series with ``loss_mask`` 0 and logprob 0.0; ``gen`` carries the finish reason
    the stop conditions read."""

    gen: GenerationResult
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    trained: bool = True
    source: str = "policy"


class ToolAgent(EpisodeAgent):
    def __init__(
        self, config: ToolAgentConfig, *, verifier: Verifier, tokenizer: Any | None = None
    ) -> None:
        self.config = config
        self.verifier = verifier
        if tokenizer is None:
            if config.tokenizer_path is None:
                raise ConfigError("ToolAgent needs ToolAgentConfig.tokenizer_path or tokenizer=")
            tokenizer = load_tokenizer(config.tokenizer_path)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                f"ToolAgent: tokenizer {getattr(tokenizer, 'name_or_path', '?')} has no chat "
                "template"
            )
        self.tokenizer = tokenizer
        self.chat = ChatTokens(tokenizer, [tool.schema() for tool in config.tools])
        self._answer = re.compile(config.answer_pattern, re.DOTALL)

    def episode(self, task: Task) -> ToolEpisode:
        return ToolEpisode(self, task)

    def initial_messages(self, task: Task) -> list[Message]:
        """The conversation the episode starts from: system prompt and the task's prompt."""
        prompt = task.prompt
        messages: list[Message] = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [dict(m) for m in prompt]
        )
        if self.config.system_prompt is not None and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        return messages

    def backend(self, context: EpisodeContext) -> ModelBackend:
        """The worker's backend for this agent's endpoint; ``ConfigError`` if there is none or
        it cannot return token ids."""
        if context.backends is None:
            raise ConfigError(
                f"sample {context.sample_id}: the tool agent needs a model backend, and the "
                "worker has none"
            )
        try:
            backend = context.backends.get(self.config.sglang_url)
        except ConfigError as exc:
            raise ConfigError(f"sample {context.sample_id}: {exc}") from exc
        if not backend.capabilities.token_ids:
            raise ConfigError(f"ToolAgent needs a backend with token ids, got {backend!r}")
        return backend

    async def _loop(
        self, task: Task, context: EpisodeContext, sandbox: Sandbox, backend: ModelBackend
    ) -> AgentResult:
        limits = _Limits.of(self.config, context.stopping)
        sampling = context.sampling_params.as_request()
        history = self.initial_messages(task)
        series = TokenSeries(prompt=self.chat.prompt_ids(history))
        counts = ToolCounts()
        turns: list[TurnRecord] = []
        actions: list[TurnAction] = []
        reason: TerminationReason | None = None
        while reason is None:
            turn = len(turns)
            room = limits.max_context - len(series)
            if room <= 0:
                reason = TerminationReason.MAX_CONTEXT
                break
            started = time.monotonic()
            prompt_len = len(series)
            action = await self._act(
                TurnInput(
                    context=context,
                    backend=backend,
                    input_ids=series.ids(),
                    history=history,
                    sampling_params=_turn_params(
                        sampling, context, turn, min(limits.max_new, room)
                    ),
                    turn=turn,
                )
            )
            actions.append(action)
            reason, history, names = await self._take(
                action, turn, series, history, sandbox, counts, limits
            )
            turns.append(
                TurnRecord(
                    index=turn,
                    prompt_tokens=prompt_len,
                    response_tokens=len(action.token_ids),
                    tool_calls=names,
                    elapsed_s=max(0.0, time.monotonic() - started),
                    finish_reason=str(action.gen.finish_reason),
                    weight_version=action.gen.weight_version,
                )
            )
        result = self._result(series, turns, counts, reason)
        return self._finish_result(result, actions, context)

    async def _take(
        self,
        action: TurnAction,
        turn: int,
        series: TokenSeries,
        history: list[Message],
        sandbox: Sandbox,
        counts: ToolCounts,
        limits: _Limits,
    ) -> tuple[TerminationReason | None, list[Message], tuple[str, ...]]:
        """Append one turn's action and apply the stop conditions: ``(reason or None to go on,
        the conversation, the tools called)``."""
        gen, ids = action.gen, action.token_ids
        if action.trained:
            versions = gen.versions()
            if len(versions) != len(ids):  # not the generation's own tokens
                versions = (gen.weight_version,) * len(ids)
            series.generated(ids, action.logprobs, versions)
        else:  # not the policy's tokens: in the series, out of the loss
            series.observed(ids)
        text = self.chat.decode(ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text, id_prefix=f"call_{turn}_")
        names = tuple(call.name for call in parsed.tool_calls)
        if self._answer.search(text):
            return TerminationReason.FINISH, history, names
        if gen.finish_reason == FinishReason.VERSION_SPAN:
            return TerminationReason.VERSION_SPAN, history, names
        if gen.finish_reason == FinishReason.LENGTH:
            out_of_room = len(series) >= limits.max_context
            reason = TerminationReason.MAX_CONTEXT if out_of_room else TerminationReason.LENGTH
            return reason, history, names
        if not parsed.tool_calls and not parsed.errors:
            return TerminationReason.FINISH, history, names
        if turn + 1 >= limits.max_turns:
            return TerminationReason.MAX_TURNS, history, names
        cfg = self.config
        tool_messages = await run_tool_calls(
            parsed.tool_calls, parsed.errors, sandbox, counts, tools=cfg.tools,
            max_calls=cfg.max_tool_calls_per_turn, timeout_s=cfg.tool_timeout_s,
            max_chars=cfg.max_observation_chars,
        )  # fmt: skip
        observation = self.chat.observation(history, ids, tool_messages)
        if len(series) + len(observation.token_ids) >= limits.max_context:
            return TerminationReason.MAX_CONTEXT, history, names
        series.observed(observation.token_ids)
        raw = self.chat.reply_text(ids)
        return None, [*history, {"role": "assistant", "content": raw}, *tool_messages], names

    def _result(
        self,
        series: TokenSeries,
        turns: list[TurnRecord],
        counts: ToolCounts,
        reason: TerminationReason,
    ) -> AgentResult:
        metrics: dict[str, float] = {
            "n_turns": float(len(turns)),
            "n_tool_calls": float(counts.tool_calls),
            "n_tool_errors": float(counts.tool_errors),
            "response_tokens": float(len(series.response)),
            "generated_tokens": float(sum(series.mask)),
            "observation_tokens": float(len(series.mask) - sum(series.mask)),
        }
        metrics.update({k: float(v) for k, v in counts.outcomes.items()})
        return AgentResult(
            prompt_token_ids=tuple(series.prompt),
            response_token_ids=tuple(series.response),
            response_logprobs=tuple(series.logprobs),
            loss_mask=tuple(series.mask),
            response_versions=tuple(series.versions),
            turns=tuple(turns),
            termination_reason=reason,
            metrics=metrics,
            text=self.chat.decode(series.response, skip_special_tokens=False),
        )

    async def _act(self, step: TurnInput) -> TurnAction:
        """The policy's generation on the series so far; a subclass may act otherwise."""
        gen = await step.backend.generate(
            input_ids=step.input_ids, sampling_params=step.sampling_params
        )
        ids, logprobs = self._checked(gen, step.context, step.turn)
        return TurnAction(gen=gen, token_ids=ids, logprobs=logprobs)

    def final_text(self, result: AgentResult) -> str:
        """The text of the episode's last action, which the verifier reads."""
        return self.chat.decode(last_generation(result), skip_special_tokens=True)

    def _finish_result(
        self, result: AgentResult, actions: Sequence[TurnAction], context: EpisodeContext
    ) -> AgentResult:
        """The result, given every turn's action in order; a subclass may annotate it."""
        return result

    def _checked(
        self, gen: GenerationResult, context: EpisodeContext, turn: int
    ) -> tuple[tuple[int, ...], tuple[float, ...]]:
        where = f"sample {context.sample_id} turn {turn}"
        if gen.aborted:
            raise GenerationAborted(f"{where}: the model server aborted the generation")
        if str(gen.finish_reason).startswith("error:"):
            raise BackendProtocolError(
                f"{where}: the model server ended the generation with {gen.finish_reason!r}"
            )
        if gen.token_ids is None or gen.logprobs is None:
            raise BackendProtocolError(
                f"{where}: the backend returned no token ids/logprobs; the tool agent needs a "
                "token-level backend"
            )
        return gen.token_ids, gen.logprobs


class ToolEpisode(Episode):
    def __init__(self, agent: ToolAgent, task: Task) -> None:
        self.agent = agent
        self.task = task
        self.sandbox: Sandbox | None = None
        self._started = False

    async def init(self, context: EpisodeContext) -> None:
        if self._started:
            raise AgentError(
                f"sample {context.sample_id} attempt {context.attempt} of rollout "
                f"{context.rollout_id}: this episode was already started"
            )
        self._started = True
        provider = context.sandboxes
        if provider is None:
            raise SandboxError(
                f"sample {context.sample_id}: the tool agent needs a sandbox provider, and the "
                "worker has none (run it with a sandbox, e.g. --sandbox local)"
            )
        sandbox = provider.create(
            labels=episode_labels(context), limits=self.agent.config.sandbox_limits
        )
        # Kept before start, so cleanup stops a sandbox that failed half-way up.
        self.sandbox = sandbox
        await sandbox.start()

    async def run(self, context: EpisodeContext) -> AgentResult:
        sandbox = self._sandbox(context, "run")
        backend = self.agent.backend(context)
        return await self.agent._loop(self.task, context, sandbox, backend)

    async def eval(self, context: EpisodeContext, result: AgentResult) -> Reward:
        sandbox = self._sandbox(context, "eval")
        agent = self.agent
        final_text = agent.final_text(result)
        verdict = await agent.verifier.verify(
            self.task, FinishedEpisode(result=result, final_text=final_text, sandbox=sandbox)
        )
        logger.debug(
            "sample %s verdict %s %s", self.task.sample_id, verdict.score, dict(verdict.detail)
        )
        return verdict.as_reward()

    async def cleanup(self, context: EpisodeContext) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            await sandbox.stop()

    def _sandbox(self, context: EpisodeContext, phase: str) -> Sandbox:
        if self.sandbox is None:
            raise AgentError(
                f"sample {context.sample_id} attempt {context.attempt}: {phase} before init or "
                "after cleanup (no sandbox)"
            )
        return self.sandbox
