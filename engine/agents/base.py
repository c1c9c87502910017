"""The episode contract: one ``BaseAgent`` owns the whole episode of one sample.

The evaluator makes one ``Episode`` per attempt with ``agent.episode(task)`` and drives it
through ``init`` (cheap, before any placement token is held) -> ``run`` (the multi-turn loop,
returns an ``AgentResult``) -> ``eval`` (a float, or a dict of named scores) -> ``cleanup``
(always, also after a failure). It holds one placement token from before ``run`` until after
``cleanup``. An exception from any phase aborts the sample (the evaluator classifies it and
substitutes a masked dummy), so agents raise rather than return half-valid results.

One agent instance serves many concurrent episodes, so what an attempt carries between phases
(its sandbox) lives on its ``Episode``, never on the agent: an agent whose episodes carry
nothing implements the phases itself (``BaseAgent``), one whose episodes do subclasses
``EpisodeAgent``. The worker's ports (``backends``, ``sandboxes``) arrive in the
``EpisodeContext``; agents use them and never build or close them.

An ``AgentResult``'s ``loss_mask`` is as long as ``response_token_ids`` and 1 on the tokens
the policy is trained on (not tool output, not teacher tokens); ``response_logprobs`` is empty
(not captured) or as long.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path

from engine.agents.result import AgentResult, Reward, TurnRecord, check_response_arrays
from engine.backends.pool import BackendPool
from engine.domain import SamplingParams, StoppingCriteria, Task
from engine.errors import AgentError
from engine.sandbox.base import SandboxProvider

__all__ = [
    "AgentResult",
    "BaseAgent",
    "Episode",
    "EpisodeAgent",
    "EpisodeContext",
    "Reward",
    "TurnRecord",
    "check_response_arrays",
    "episode_labels",
    "noop_phase",
]


@dataclass(frozen=True, kw_only=True)
class EpisodeContext:
    """Everything an episode may use besides its task; built by the evaluator per attempt.

    ``stopping`` and ``sampling_params`` are resolved through the cascade; ``attempt`` counts
    deliveries from 1; ``seed`` comes from the request, so a re-run attempt can reproduce
    sampling; per-iteration knobs travel here, never in environment variables; ``tmp_dir`` is
    the attempt's own, removed after ``cleanup``; ``backends`` / ``sandboxes`` are ``None``
    where the worker has none (an agent that needs one raises).
    """

    rollout_id: str
    sample_id: str
    attempt: int
    stopping: StoppingCriteria
    sampling_params: SamplingParams
    tmp_dir: Path
    backends: BackendPool | None = None
    sandboxes: SandboxProvider | None = None
    policy_version: int = 0
    seed: int = 0
    node: str | None = None  # the node the sample's placement token lives on
    dagger_beta: float | None = None
    t_max: int | None = None

    def __post_init__(self) -> None:
        if self.attempt < 1:
            raise ValueError(f"attempt counts from 1, got {self.attempt}")
        if self.dagger_beta is not None and not 0.0 <= self.dagger_beta <= 1.0:
            raise ValueError(f"dagger_beta must be within [0, 1], got {self.dagger_beta}")
        if self.t_max is not None and self.t_max < 0:
            raise ValueError(f"t_max must be non-negative, got {self.t_max}")


def episode_labels(context: EpisodeContext) -> dict[str, str]:
    """The labels an episode's sandbox carries, so a worker can reap a dead one's sandboxes."""
    return {
        "rollout.rollout": context.rollout_id,
        "rollout.sample": context.sample_id,
        "rollout.attempt": str(context.attempt),
    }


class Episode(abc.ABC):
    """One attempt at one sample. Each phase gets the attempt's ``EpisodeContext`` (the same
    throughout, except ``node``, set once the placement token is held)."""

    async def init(self, context: EpisodeContext) -> None:
        """Prepare the episode before any placement token is held; keep it cheap."""
        return None

    @abc.abstractmethod
    async def run(self, context: EpisodeContext) -> AgentResult:
        """Run the whole multi-turn episode and return its trajectory."""

    @abc.abstractmethod
    async def eval(self, context: EpisodeContext, result: AgentResult) -> Reward:
        """Score ``result``: a float, or a dict of named scores."""

    async def cleanup(self, context: EpisodeContext) -> None:
        """Release what the episode started; runs after success and after failure alike."""
        return None


class BaseAgent(abc.ABC):
    """An episode handler: subclasses implement ``run`` and ``eval``. Per-episode state
    belongs in locals, in ``context.tmp_dir`` or on an ``Episode``, never on ``self``."""

    def episode(self, task: Task) -> Episode:
        """A new episode of ``task`` (one per attempt), running the agent's own phases."""
        return _AgentPhases(self, task)

    async def init(self, task: Task, context: EpisodeContext) -> None:
        """Prepare the episode before any placement token is held; keep it cheap."""
        return None

    @abc.abstractmethod
    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        """Run the whole multi-turn episode and return its trajectory."""

    @abc.abstractmethod
    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        """Score ``result``: a float, or a dict of named scores."""

    async def cleanup(self, task: Task, context: EpisodeContext) -> None:
        """Release what the episode started; runs after success and after failure alike."""
        return None


class EpisodeAgent(BaseAgent):
    """An agent whose episodes carry state between phases (a sandbox, a session): its
    ``Episode`` implements the phases, and the agent's own phase methods refuse to run."""

    @abc.abstractmethod
    def episode(self, task: Task) -> Episode:
        """A new episode of ``task`` (one per attempt)."""

    def _no_episode(self, phase: str, context: EpisodeContext) -> AgentError:
        return AgentError(
            f"sample {context.sample_id}: {type(self).__name__}.{phase} was called on the "
            f"agent; its phases run on an episode (agent.episode(task).{phase}(context))"
        )

    async def init(self, task: Task, context: EpisodeContext) -> None:
        raise self._no_episode("init", context)

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        raise self._no_episode("run", context)

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        raise self._no_episode("eval", context)

    async def cleanup(self, task: Task, context: EpisodeContext) -> None:
        raise self._no_episode("cleanup", context)


class _AgentPhases(Episode):
    def __init__(self, agent: BaseAgent, task: Task) -> None:
        self._agent = agent
        self._task = task

    async def init(self, context: EpisodeContext) -> None:
        await self._agent.init(self._task, context)

    async def run(self, context: EpisodeContext) -> AgentResult:
        return await self._agent.run(self._task, context)

    async def eval(self, context: EpisodeContext, result: AgentResult) -> Reward:
        return await self._agent.eval(self._task, context, result)

    async def cleanup(self, context: EpisodeContext) -> None:
        await self._agent.cleanup(self._task, context)


_NOOP: dict[tuple[type, str], bool] = {}


def noop_phase(episode: Episode, phase: str) -> bool:
    """Whether ``phase`` (``"init"`` or ``"cleanup"``) of ``episode`` is the inherited no-op,
    which the evaluator runs without a timeout scope of its own (a scope per sample and phase
    is a measurable share of a fast episode's cost)."""
    if type(episode) is _AgentPhases:
        owner: type = type(episode._agent)
        base: type = BaseAgent
    else:
        owner, base = type(episode), Episode
    key = (owner, phase)
    known = _NOOP.get(key)
    if known is None:
        known = _NOOP[key] = getattr(owner, phase) is getattr(base, phase)
    return known
