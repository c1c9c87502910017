"""slime trained on engine rollouts: its rollout function, its rollout manager, and a bypass.

slime's ``RolloutManager`` (``slime/ray/rollout.py``) loads ``--rollout-function-path`` and
``--eval-function-path`` and calls each as ``fn(args, rollout_id, data_source,
evaluation=...)`` (``slime/rollout/base_types.py``, ``call_rollout_fn``); a result that is
not a ``RolloutFnTrainOutput`` / ``RolloutFnEvalOutput`` is wrapped as one, so a training
call may return the groups (``list[list[Sample]]``, one list per prompt) and an eval call the
eval data (``{dataset: {"rewards", "truncated", "samples"}}``, as
``slime/rollout/sglang_rollout.py`` ``eval_rollout_single_dataset`` builds it).
:func:`generate_rollout` is such a function, over the engine (point both paths at
``integrations.slime.generate_rollout``).

The groups hold slime's own ``Sample`` (``slime/utils/types.py``), built by :func:`to_slime`
with every field ``RolloutManager._convert_samples_to_train_data`` reads: ``tokens``,
``response_length``, ``loss_mask`` (one entry per response token; tool output 0),
``rollout_log_probs``, ``reward``, ``status`` (``Sample.Status``, the same names as the
engine's), ``index``, ``group_index``, ``remove_sample``, ``teacher_log_probs``,
``rollout_id`` left ``None`` (one sample per execution), ``metadata`` (with ``source_name``,
what ``slime.utils.data.get_source`` reports; the engine's sample id, policy version and
termination reason), and ``weight_versions`` (one entry per model turn, as slime records the
server's ``weight_version`` per generate call).

``SchedulerRolloutManager`` is the manager's shape: ``_get_rollout_data(rollout_id)`` returns
the flattened samples and metrics (as slime's does), ``eval(rollout_id)`` the eval data,
``dispose()`` releases what it holds. It has two construction paths: the default one over the
engine's client (``SchedulerRolloutManager(args)``: the scheduler, workers and finalizer run
the episodes and the log records them), and :meth:`SchedulerRolloutManager.bypass`, which runs
the agents in-process on tasks the caller hands it, with no scheduler and no log (for
ablations: the same episodes without the engine around them). :func:`slime_actor_class`
composes it with slime's own ``RolloutManager`` (the Ray actor's plain class) where slime is
installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.agents.base import BaseAgent, EpisodeContext
from engine.backends.pool import BackendPool
from engine.client import RolloutClient
from engine.domain import SamplingParams, StoppingCriteria, Task
from engine.errors import ConfigError
from engine.events.catalog import RolloutKind
from engine.projections.samples import scalar_reward
from engine.sample import Sample

__all__ = [
    "BypassSource",
    "ClientSource",
    "SchedulerRolloutManager",
    "Source",
    "generate_rollout",
    "slime_actor_class",
    "slime_sample_class",
    "to_slime",
    "to_slime_groups",
]

EvalData = dict[str, dict[str, list[Any]]]


def slime_sample_class() -> type:
    """slime's ``Sample`` (``slime.utils.types``); a ``ConfigError`` where slime is missing."""
    try:
        from slime.utils.types import Sample as SlimeSample
    except ImportError as exc:
        raise ConfigError(
            f"integrations.slime builds slime's Sample, and slime does not import here ({exc}): "
            "run it where slime is installed, or pass sample_cls"
        ) from exc
    cls: type = SlimeSample
    return cls


def turn_versions(sample: Sample) -> list[str]:
    """The weight version of each model turn (each run of trained tokens), as strings."""
    if sample.token_versions is None:
        return []
    out: list[str] = []
    inside = False
    for version, trained in zip(sample.token_versions.tolist(), sample.loss_mask.tolist(),
                                strict=True):
        if trained and not inside and version >= 0:
            out.append(str(version))
        inside = bool(trained)
    return out


def to_slime(sample: Sample, sample_cls: Any) -> Any:
    """slime's ``Sample`` for an engine sample (the fields listed in the module docstring)."""
    metadata: dict[str, Any] = dict(sample.metadata)
    metadata.setdefault("source_name", metadata.get("dataset"))
    metadata["engine_sample_id"] = sample.sample_id
    metadata["engine_policy_version"] = sample.policy_version
    if sample.termination_reason is not None:
        metadata["engine_termination_reason"] = str(sample.termination_reason)
    label = sample.label
    return sample_cls(
        group_index=sample.group_index,
        index=sample.index,
        prompt=sample.prompt,
        tokens=sample.tokens.tolist(),
        response=sample.response,
        response_length=sample.response_length,
        label=label if label is None or isinstance(label, str) else str(label),
        reward=sample.reward if isinstance(sample.reward, dict) else float(sample.reward),
        loss_mask=[int(x) for x in sample.loss_mask.tolist()],
        weight_versions=turn_versions(sample),
        rollout_log_probs=(None if sample.rollout_log_probs is None
                           else [float(x) for x in sample.rollout_log_probs.tolist()]),
        remove_sample=sample.remove_sample,
        teacher_log_probs=(None if sample.teacher_log_probs is None
                           else [float(x) for x in sample.teacher_log_probs.tolist()]),
        status=sample_cls.Status(sample.status.value),
        metadata=metadata,
    )


def to_slime_groups(samples: Sequence[Sample], sample_cls: type) -> list[list[Any]]:
    """One list per prompt (group), by group then index: the ``list[list[Sample]]`` slime's
    training rollout function returns."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group_index].append(s)
    return [[to_slime(s, sample_cls) for s in sorted(groups[g], key=lambda s: s.index)]
            for g in sorted(groups)]


def eval_data(samples: Sequence[Sample], sample_cls: type) -> EvalData:
    """slime's eval data: per dataset, the rewards, the truncated flags and the samples."""
    by: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        if not s.remove_sample:
            by[str(s.metadata.get("dataset", "eval"))].append(s)
    return {
        name: {
            "rewards": [scalar_reward(s.reward) for s in group],
            "truncated": [s.status.value == "truncated" for s in group],
            "samples": [to_slime(s, sample_cls) for s in group],
        }
        for name, group in sorted(by.items())
    }


class Source(Protocol):
    """Where a manager's samples come from."""

    async def train(self, rollout_id: int, *, n_prompts: int, n_samples_per_prompt: int,
                    seed: int) -> list[Sample]: ...

    async def evaluate(self, rollout_id: int, *, seed: int) -> list[Sample]: ...

    async def aclose(self) -> None: ...


class ClientSource:
    """The engine: one request per call, the samples read back from the log. The request's
    ``policy_version`` is slime's ``rollout_id`` (slime updates the weights once per rollout)
    unless ``version_of`` says otherwise; ``request`` holds extra ``request`` arguments."""

    def __init__(
        self, client: RolloutClient, *, timeout_s: float | None = 900.0,
        request: dict[str, Any] | None = None,
        version_of: Callable[[int], int] = lambda rollout_id: rollout_id,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.request = dict(request or {})
        self.version_of = version_of

    async def train(self, rollout_id: int, *, n_prompts: int, n_samples_per_prompt: int,
                    seed: int) -> list[Sample]:
        rid = await self.client.request(
            iteration=rollout_id, n_prompts=n_prompts, n_samples_per_prompt=n_samples_per_prompt,
            policy_version=self.version_of(rollout_id), seed=seed, **self.request)
        _ready, samples = await self.client.wait_load(rid, timeout=self.timeout_s)
        return samples

    async def evaluate(self, rollout_id: int, *, seed: int) -> list[Sample]:
        rid = await self.client.request(
            iteration=rollout_id, n_prompts=1, kind=RolloutKind.EVAL,
            policy_version=self.version_of(rollout_id), seed=seed)
        _ready, samples = await self.client.wait_load(rid, timeout=self.timeout_s)
        return samples

    async def aclose(self) -> None:
        await self.client.aclose()


TaskSource = Callable[[int, int, int], Sequence[Task]]
"""``tasks(rollout_id, n_prompts, n_samples_per_prompt)``: the bypass's tasks of one call."""


class BypassSource:
    """The agents in-process, no scheduler and no log: each task's episode runs init -> run
    -> eval -> cleanup here (all of a call's tasks at once), an exception makes the sample a
    masked dummy, as the evaluator would. For ablations against the scheduled path."""

    def __init__(
        self, agent: BaseAgent, tasks: TaskSource, *, eval_tasks: TaskSource | None = None,
        backends: BackendPool | None = None, stopping: StoppingCriteria | None = None,
        sampling_params: SamplingParams | None = None,
    ) -> None:
        self.agent = agent
        self.tasks = tasks
        self.eval_tasks = eval_tasks
        self.backends = backends
        self.stopping = stopping or StoppingCriteria()
        self.sampling_params = sampling_params or SamplingParams()

    async def _one(self, task: Task, rollout_id: int, seed: int) -> Sample:
        tmp = Path(tempfile.mkdtemp(prefix="slime-bypass-"))
        context = EpisodeContext(
            rollout_id=task.rollout_id, sample_id=task.sample_id, attempt=1,
            stopping=self.stopping, sampling_params=self.sampling_params, tmp_dir=tmp,
            backends=self.backends, policy_version=rollout_id, seed=seed,
        )
        episode = self.agent.episode(task)
        try:
            await episode.init(context)
            result = await episode.run(context)
            reward = await episode.eval(context, result)
            return Sample.from_agent_result(task, result, reward, policy_version=rollout_id)
        except Exception:  # the evaluator's rule: a failed episode is a masked dummy
            return Sample.masked_dummy(task, policy_version=rollout_id)
        finally:
            with contextlib.suppress(Exception):
                await episode.cleanup(context)
            shutil.rmtree(tmp, ignore_errors=True)

    async def _run(self, tasks: Sequence[Task], rollout_id: int, seed: int) -> list[Sample]:
        return list(await asyncio.gather(*(self._one(t, rollout_id, seed) for t in tasks)))

    async def train(self, rollout_id: int, *, n_prompts: int, n_samples_per_prompt: int,
                    seed: int) -> list[Sample]:
        tasks = self.tasks(rollout_id, n_prompts, n_samples_per_prompt)
        return await self._run(tasks, rollout_id, seed)

    async def evaluate(self, rollout_id: int, *, seed: int) -> list[Sample]:
        if self.eval_tasks is None:
            raise ConfigError("this bypass manager was given no eval_tasks")
        return await self._run(self.eval_tasks(rollout_id, 0, 0), rollout_id, seed)

    async def aclose(self) -> None:
        return None


class SchedulerRolloutManager:
    """slime's rollout manager over a :class:`Source` (see the module docstring). ``args``:
    slime's; it reads ``rollout_batch_size``, ``n_samples_per_prompt`` and ``rollout_seed``."""

    def __init__(self, args: Any, source: Source | None = None, *,
                 sample_cls: type | None = None) -> None:
        self.args = args
        self._runner = asyncio.Runner()
        if source is None:
            source = ClientSource(self._runner.run(_connect()))
        self.source: Source = source
        self.sample_cls = sample_cls or slime_sample_class()

    @classmethod
    def bypass(cls, args: Any, agent: BaseAgent, tasks: TaskSource, *,
               sample_cls: type | None = None, **options: Any) -> SchedulerRolloutManager:
        """The second construction path: agents in-process, no log (:class:`BypassSource`)."""
        return cls(args, BypassSource(agent, tasks, **options), sample_cls=sample_cls)

    def _seed(self, rollout_id: int) -> int:
        return int(getattr(self.args, "rollout_seed", 0) or 0) * 100_003 + rollout_id

    def _run(self, call: Awaitable[list[Sample]]) -> list[Sample]:
        async def awaited() -> list[Sample]:
            return await call

        return self._runner.run(awaited())

    def generate_groups(self, rollout_id: int) -> list[list[Any]]:
        """The groups of one training rollout (what slime's rollout function returns)."""
        samples = self._run(self.source.train(
            rollout_id, n_prompts=int(self.args.rollout_batch_size),
            n_samples_per_prompt=int(self.args.n_samples_per_prompt),
            seed=self._seed(rollout_id)))
        return to_slime_groups(samples, self.sample_cls)

    def _get_rollout_data(self, rollout_id: int) -> tuple[list[Any], dict[str, Any]]:
        """The flattened samples and their metrics, as slime's ``_get_rollout_data``."""
        flat = [s for group in self.generate_groups(rollout_id) for s in group]
        kept = [s for s in flat if not s.remove_sample]
        rewards = [float(s.reward) if not isinstance(s.reward, dict)
                   else float(s.reward.get("score", 0.0)) for s in kept]
        metrics = {
            "rollout/samples": len(flat),
            "rollout/removed": len(flat) - len(kept),
            "rollout/reward": sum(rewards) / len(rewards) if rewards else 0.0,
        }
        return flat, metrics

    def eval(self, rollout_id: int) -> EvalData:
        """One eval pass: per dataset, rewards, truncated flags and samples."""
        samples = self._run(self.source.evaluate(rollout_id, seed=self._seed(rollout_id)))
        return eval_data(samples, self.sample_cls)

    def dispose(self) -> None:
        self._runner.run(self.source.aclose())
        self._runner.close()


async def _connect() -> RolloutClient:
    return RolloutClient.connect(producer="slime")


_MANAGERS: dict[int, SchedulerRolloutManager] = {}


def generate_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> list[list[Any]] | EvalData:
    """slime's rollout function (``--rollout-function-path`` / ``--eval-function-path``):
    the engine's groups, or its eval data. ``data_source`` is slime's and goes unused: the
    engine's scheduler reads its own datasets. One manager per process, on the engine's
    settings (``ROLLOUT_REDIS_URL``, ...)."""
    manager = _MANAGERS.get(id(args))
    if manager is None:
        manager = _MANAGERS[id(args)] = SchedulerRolloutManager(args)
    if evaluation:
        return manager.eval(rollout_id)
    return manager.generate_groups(rollout_id)


def slime_actor_class() -> Any:
    """slime's ``RolloutManager`` with this manager's ``_get_rollout_data`` / ``eval`` /
    ``dispose``, as a Ray actor: Ray refuses to subclass an actor class, so the plain class
    is taken from the decorator's metadata and the subclass decorated again. Its
    ``__init__(args, pg)`` runs slime's, then connects the engine; its ``eval`` logs the eval
    data as slime's does (``log_eval_rollout_data``). Not exercised here: slime does not
    install from the registry."""
    import ray
    from slime.observability.rollout_metrics import log_eval_rollout_data
    from slime.ray.rollout import RolloutManager

    base = RolloutManager.__ray_metadata__.modified_class

    class SlimeSchedulerRolloutManager(SchedulerRolloutManager, base):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any, pg: Any) -> None:
            base.__init__(self, args, pg)
            SchedulerRolloutManager.__init__(self, args)

        def eval(self, rollout_id: int) -> EvalData:
            data = SchedulerRolloutManager.eval(self, rollout_id)
            log_eval_rollout_data(rollout_id, self.args, data, None)  # as slime's eval does
            return data

        def dispose(self) -> None:
            SchedulerRolloutManager.dispose(self)
            base.dispose(self)

    return ray.remote(SlimeSchedulerRolloutManager)
