"""A batch run: one admitted batch's episodes, run and recorded as events.

One ``BatchRun`` is built per batch delivery, drains the batch and is discarded. It holds no
domain logic: the binding's ``BaseAgent`` owns each episode, one ``Episode`` per attempt, and
gets the worker's ports through its ``EpisodeContext`` (``engine.actors.attempt_context``):
the backend pool bound to the attempt (one policy server per trajectory; a guarded sample's
``SampleGuard`` as a hook around each generation) and the sandbox provider, labelled for the
attempt (``engine.actors.sandbox_labels``). Per sample, in this order:

1. the batch's semaphore (``profile.resource.concurrency``) is taken, for init to cleanup;
2. ``init`` runs before any placement token is held;
3. one *local placement token* (one of the batch's ``token_ids``) is taken and held through
   ``run``, ``eval`` and ``cleanup``; ``SampleStarted`` (attempt, node) is emitted then;
4. ``cleanup`` always runs once ``init`` was entered; then the attempt's ``tmp_dir`` (inside
   a per-batch directory, created only if the agent asks for it) is removed;
5. the outcome is emitted: one ``TurnCompleted`` per turn, then ``SampleCompleted`` -- or
   ``SampleAborted``. With a ``PromptStore`` (``engine.actors.prompt_store``) a group's
   prompt tokens are stored once and each ``SampleCompleted`` refers to them;
6. the token goes back (``engine.actors.batch_tokens``).

Failure semantics: any exception, in any phase, aborts the attempt (``SampleAborted``:
``classify_abort`` class, the agent's own termination reason, phase, elapsed time vs the
episode window, node, turns). A model-server failure that reached the agent is no outcome:
the sample runs again as a new attempt while its ``RetryBudget`` lasts (the pool retries a
failed turn first); a spent budget is named in the abort, and a sample that waited past the
outage limit with every policy server down fails its rollout. The episode window
(``StoppingCriteria.timeout_s`` of the ``TaskFetched``) covers init, run and eval; when it
elapses the sample is aborted as ``agent_timeout``. A training result without response
logprobs is ``infra_other``. Cancellation (shutdown past the grace period) is no failure:
the sample emits nothing, keeps its token, and is re-run by the worker that claims it.
Outcome events are decided by the pure functions of :mod:`engine.actors.outcomes`.

Events go through an ``EventSink`` (the worker's group-commit appender): emitting never
waits for Redis, order is kept, and the worker flushes before it acks the batch."""

from __future__ import annotations

import asyncio
import logging
import secrets
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine import metrics
from engine.actors.attempt_context import LazyTmp, attempt_context, remove_dir, with_node
from engine.actors.batch_tokens import BatchTokens
from engine.actors.episode_window import check_left, timed, within_window
from engine.actors.outcomes import (
    Attempt,
    ReportedAbort,
    aborted_event,
    caused_by,
    completed_events,
    rerun_attempt,
    started_event,
)
from engine.actors.prompt_store import PromptStore
from engine.actors.sample_guard import SampleGuard
from engine.actors.sandbox_labels import LabelledProvider, sandbox_labels
from engine.actors.verify import VerifyPolicy, selected, verify_result
from engine.agents.base import AgentResult, Episode, EpisodeContext, Reward, noop_phase
from engine.agents.binding import EvaluatorBinding
from engine.backends.health import RetryBudget
from engine.backends.pool import BackendPool
from engine.domain import Task
from engine.errors import AgentError, ServersDown
from engine.events.base import Event
from engine.events.catalog import (
    BatchAdmitted,
    RolloutFailed,
    RolloutKind,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleVerified,
    TaskFetched,
    TokenReleased,
)
from engine.events.names import StreamNames
from engine.projections.control import ControlState
from engine.projections.rows import SampleRow, sample_row
from engine.projections.samples import task_of
from engine.runtime.follower import Follower
from engine.sandbox.base import SandboxProvider

__all__ = [
    "BatchPlan",
    "BatchRun",
    "EpisodeSettings",
    "EventSink",
    "OnTaskDone",
    "sample_seed",
]

logger = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where an actor's events go: ``emit`` queues (in order), ``flush`` waits for Redis."""

    def emit(self, items: Sequence[tuple[str, Event]]) -> None: ...

    async def flush(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class EpisodeSettings:
    """Worker-level settings every episode of the worker shares."""

    worker_id: str
    tmp_root: Path | None = None
    cleanup_timeout_s: float = 120.0
    verify: VerifyPolicy = VerifyPolicy()  # re-scoring of completed samples (actors/verify.py)
    model_retries: int = 4  # a sample's retries of model-server failures (RetryBudget)
    retry_backoff_s: float = 0.5


OnTaskDone = Callable[[SampleRow], None]
"""The progress callback: hears each sample's row when it reaches its terminal event."""


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """One run of one batch: which samples to run, with which attempt and tokens."""

    admitted: BatchAdmitted
    request: RolloutRequested | None
    tasks: Mapping[str, TaskFetched]
    run_ids: tuple[str, ...]
    attempts: Mapping[str, int]
    tokens: tuple[str, ...]
    causation: str | None = None
    lease: int = 0  # the work entry's delivery count: carried by every TokenReleased


class _Held:
    """What one attempt holds from the semaphore on (its context, view of the pool, token)
    and what its phases left (result, reward, verification, or the failure and its phase)."""

    __slots__ = (
        "ctx", "tmp", "backends", "token", "result", "reward", "verified", "failure", "phase"
    )  # fmt: skip

    def __init__(self, ctx: EpisodeContext, tmp: LazyTmp, backends: BackendPool | None) -> None:
        self.ctx = ctx
        self.tmp = tmp
        self.backends = backends
        self.token: str | None = None
        self.result: AgentResult | None = None
        self.reward: Reward | None = None
        self.verified: SampleVerified | None = None
        self.failure: BaseException | None = None
        self.phase = ""

    def fail(self, exc: BaseException, phase: str) -> None:
        self.failure, self.phase = exc, phase


class BatchRun:
    """Runs one ``BatchPlan`` (see the module docstring)."""

    def __init__(
        self,
        spec: EvaluatorBinding,
        plan: BatchPlan,
        *,
        sink: EventSink,
        names: StreamNames,
        settings: EpisodeSettings,
        backends: BackendPool | None = None,
        sandboxes: SandboxProvider | None = None,
        on_task_done: OnTaskDone | None = None,
        clock: Callable[[], float] = time.monotonic,
        control: Follower[ControlState] | None = None,
        abort_grace_s: float = 10.0,
        prompts: PromptStore | None = None,
    ) -> None:
        self.spec = spec
        self._control = control
        self._abort_grace_s = abort_grace_s
        self.plan = plan
        self._sink = sink
        self._names = names
        self._settings = settings
        self._backends = backends
        self._sandboxes = sandboxes
        self._on_task_done = on_task_done
        self._clock = clock
        self._prompts = prompts
        concurrency = spec.profile.resource.concurrency
        self._sem = asyncio.Semaphore(concurrency)
        self._tokens = BatchTokens(
            plan.tokens, samples=len(plan.run_ids), concurrency=concurrency, release=self._release
        )
        self._rollout_stream = names.rollout(plan.admitted.rollout_id)
        # The batch's directory: named now, made only by an episode that needs its own.
        root = settings.tmp_root or Path(tempfile.gettempdir())
        self._batch_tmp = root / f"rollout-batch-{secrets.token_hex(8)}"
        request = plan.request
        self._train = request is None or request.kind is RolloutKind.TRAIN
        self._policy_version = request.policy_version if request is not None else 0
        self._seed, self._pinned, self._max_version_span = (
            (request.seed, request.pinned_version, request.max_version_span) if request
            else (0, None, None)
        )  # fmt: skip
        knobs: Mapping[str, Any] = request.knobs if request is not None else {}
        # Eval runs student-only: an eval request's ``dagger_beta`` is dropped; an explicit
        # ``eval_dagger_beta`` knob re-injects one.
        self._dagger_beta = _float_knob(knobs, "dagger_beta" if self._train else "eval_dagger_beta")
        self._t_max = _int_knob(knobs, "t_max")
        # Only a request with a staleness bound or an over-provisioned plan can have samples
        # become unusable while they run: only those are guarded (engine.actors.sample_guard).
        self._guarded = control is not None and request is not None and (
            request.max_staleness is not None or request.n_planned_prompts > request.n_prompts
        )  # fmt: skip
        self._verify = settings.verify.for_request(knobs)
        self.completed = 0
        self.aborted = 0
        self._failed = False  # this run failed the rollout (every policy server down)
        self._budgets: dict[str, RetryBudget] = {}  # per running sample
        # The metric children this batch records into, looked up once per batch instead of
        # twice per sample (prometheus-client's ``labels()`` hashes and locks every call).
        evaluator = spec.evaluator_id
        self._in_flight = metrics.SAMPLES_IN_FLIGHT.labels(evaluator)
        self._done_metric = {
            "completed": metrics.SAMPLES_DONE.labels(evaluator, "completed"),
            "aborted": metrics.SAMPLES_DONE.labels(evaluator, "aborted"),
        }

    # ------------------------------------------------------------------ batch

    async def run(self) -> None:
        """Run every planned sample; release the batch's tokens by the end."""
        self._tokens.release_surplus("surplus")
        try:
            if self.plan.run_ids:
                await asyncio.gather(*(self._sample(sid) for sid in self.plan.run_ids))
            self._tokens.release_rest()
        finally:
            remove_dir(self._batch_tmp)

    def _emit(self, events: Sequence[Event], stream: str | None = None) -> None:
        target = stream or self._rollout_stream
        self._sink.emit([(target, ev) for ev in events])

    def _release(self, token_ids: list[str], reason: str) -> None:
        ad, plan = self.plan.admitted, self.plan
        released = TokenReleased(
            rollout_id=ad.rollout_id, batch_id=ad.batch_id, token_ids=token_ids, reason=reason,
            causation=plan.causation, lease=plan.lease,
        )  # fmt: skip
        self._emit([released], self._names.pool)

    # ------------------------------------------------------------------ sample

    async def _sample(self, sample_id: str) -> None:
        attempt = self.plan.attempts.get(sample_id, 1)
        budget = None
        if self._backends is not None:  # model-server failures are retried (RetryBudget)
            budget = self._budgets[sample_id] = RetryBudget(
                tries=self._settings.model_retries, backoff_s=self._settings.retry_backoff_s
            )
        token: str | None = None
        outcome: list[Event]
        in_flight = self._in_flight
        in_flight.inc()
        try:
            while True:
                rec = Attempt()
                try:
                    outcome, token, failure = await self._episode(sample_id, attempt, rec)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a failure outside any phase (bad task data)
                    outcome, failure = [self._aborted(sample_id, attempt, rec, exc)], exc
                if budget is None or not rerun_attempt(outcome[-1], failure, budget):
                    break
                self._tokens.give_back(token)  # the next attempt takes one again
                token = None
                self.aborted -= 1
                metrics.MODEL_RETRIES.labels("attempt").inc()
                logger.warning("sample %s attempt %d: a model server failed it (%s); re-run",
                               sample_id, attempt, budget.last)  # fmt: skip
                await asyncio.sleep(budget.pause_s())
                attempt += 1
        finally:
            in_flight.dec()
            self._budgets.pop(sample_id, None)
        done = "completed" if isinstance(outcome[-1], SampleCompleted) else "aborted"
        self._done_metric[done].inc()
        if failure is not None and caused_by(failure, ServersDown):
            self._fail_rollout(failure)
        self._emit(outcome)
        self._tokens.give_back(token)
        self._report(sample_id, attempt, rec, outcome[-1])

    def _fail_rollout(self, failure: BaseException) -> None:
        """Every policy server stayed down past the outage limit: the rollout fails (before
        its samples' aborts in its stream, so no decision is made from them)."""
        if not self._failed:
            self._failed = True
            reason = f"worker {self._settings.worker_id}: {failure}"
            ad = self.plan.admitted
            failed = RolloutFailed(rollout_id=ad.rollout_id, reason=reason,
                                   causation=self.plan.causation)  # fmt: skip
            self._emit([failed], self._names.control)
            self._emit([failed])

    async def _episode(
        self, sample_id: str, attempt: int, rec: Attempt
    ) -> tuple[list[Event], str | None, BaseException | None]:
        ev = self.plan.tasks.get(sample_id)
        if ev is None:
            raise AgentError(
                f"sample {sample_id} of batch {self.plan.admitted.batch_id} has no TaskFetched "
                f"in rollout {self.plan.admitted.rollout_id}"
            )
        task = task_of(ev)
        rec.window_s = ev.stopping.timeout_s
        guard = (
            SampleGuard(self.plan.request, self._control, ev.rollout_id, sample_id, attempt)
            if self._guarded
            else None
        )
        if guard is not None:
            guard.before_turn()  # a sample that can no longer be used is not started
        episode = self.spec.agent.episode(task)
        async with self._sem:
            if guard is not None:
                guard.before_turn()  # it may have waited for the semaphore
            held = self._hold(ev, sample_id, attempt, guard)
            try:
                await self._phases(episode, task, sample_id, attempt, held, guard, rec)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                held.fail(exc, rec.phase)
            finally:
                await self._cleanup(episode, held, rec)
        outcome = self._outcome(task, sample_id, attempt, held, rec)
        return outcome, held.token, held.failure

    def _hold(
        self, ev: TaskFetched, sample_id: str, attempt: int, guard: SampleGuard | None
    ) -> _Held:
        """The attempt's directory, bound view of the pool and context."""
        tmp = LazyTmp(self._batch_tmp, sample_id, attempt)
        # One trajectory, one policy server while it is up (BackendPool.bind; a pinned eval:
        # one serving its version), released after cleanup; generations named SAMPLE/aATTEMPT/tN.
        backends = (
            self._backends.bind(
                f"{sample_id}/a{attempt}",
                hooks=(guard,) if guard is not None else (),
                budget=self._budgets.get(sample_id), version=self._pinned,
                max_version_span=self._max_version_span,
            )  # fmt: skip
            if self._backends is not None
            else None
        )
        ctx: EpisodeContext = attempt_context(
            rollout_id=ev.rollout_id,
            sample_id=sample_id,
            attempt=attempt,
            stopping=ev.stopping,
            sampling_params=ev.sampling_params,
            backends=backends,
            sandboxes=self._labelled_sandboxes(sample_id, attempt),
            policy_version=self._policy_version,
            seed=sample_seed(self._seed, ev.index),
            node=None,
            dagger_beta=self._dagger_beta,
            t_max=self._t_max,
            _tmp=tmp,
        )
        return _Held(ctx, tmp, backends)

    async def _phases(
        self,
        episode: Episode,
        task: Task,
        sample_id: str,
        attempt: int,
        held: _Held,
        guard: SampleGuard | None,
        rec: Attempt,
    ) -> None:
        """``init``, the token, ``run`` and ``eval``, then the verification re-score."""
        rec.phase = "init"
        init = episode.init(held.ctx)
        await timed(init, rec, self._clock, scoped=not noop_phase(episode, "init"))
        token = held.token = await self._tokens.take()
        ad = self.plan.admitted
        if token is not None:
            rec.node = ad.nodes.get(token, "")
            gpus = ad.gpus.get(token)
            rec.gpu = gpus[0] if gpus else None
        if rec.node:  # the context as it was, with the token's node
            held.ctx = with_node(held.ctx, rec.node)
        self._emit([
            started_event(
                rollout_id=ad.rollout_id, sample_id=sample_id, attempt=attempt,
                batch_id=ad.batch_id, worker=self._settings.worker_id, node=rec.node,
                causation=self.plan.causation,
            )
        ])  # fmt: skip
        held.result, held.reward = await self._run_and_eval(episode, held.ctx, task, guard, rec)
        if selected(sample_id, self._verify.fraction):
            held.verified = await verify_result(
                held.backends, rollout_id=ad.rollout_id, sample_id=sample_id,
                attempt=attempt, result=held.result, threshold=self._verify.threshold,
            )  # fmt: skip

    async def _cleanup(self, episode: Episode, held: _Held, rec: Attempt) -> None:
        """``cleanup`` (bounded by ``cleanup_timeout_s``), then the attempt's directory and its
        trajectory on the pool are released; a failure of its own aborts a sample that had
        none."""
        rec.phase = "cleanup"
        try:
            if noop_phase(episode, "cleanup"):  # returns at once: no timer
                await episode.cleanup(held.ctx)
            else:
                async with asyncio.timeout(self._settings.cleanup_timeout_s):
                    await episode.cleanup(held.ctx)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if held.failure is None:
                held.fail(exc, "cleanup")
            else:
                logger.warning("cleanup of %s failed after an abort: %s", held.ctx.sample_id, exc)
        finally:
            if held.tmp.path is not None:  # the episode asked for its directory
                remove_dir(held.tmp.path)
            if held.backends is not None:
                held.backends.release()

    def _outcome(
        self, task: Task, sample_id: str, attempt: int, held: _Held, rec: Attempt
    ) -> list[Event]:
        if held.failure is None and held.result is not None:
            try:
                events = self._finished(task, attempt, rec, held.result, held.reward)
                if held.verified is not None:  # folded before the sample is terminal
                    events.insert(len(events) - 1, held.verified)
                return events
            except Exception as exc:
                held.fail(exc, "eval")
        assert held.failure is not None
        rec.phase = held.phase
        note, budget = "", self._budgets.get(sample_id)
        if budget is not None and budget.spent:
            note = budget.describe()
            metrics.RETRY_BUDGETS_SPENT.inc()
        return [self._aborted(sample_id, attempt, rec, held.failure, note)]

    async def _run_and_eval(
        self,
        episode: Episode,
        ctx: EpisodeContext,
        task: Task,
        guard: SampleGuard | None,
        rec: Attempt,
    ) -> tuple[AgentResult, Reward]:
        """The run and eval phases under one timeout scope: nothing between them is outside
        the episode window, so the deadline of what is left when run starts serves both."""
        rec.phase = "run"
        if rec.window_s is None:
            return await self._run_then_eval(episode, ctx, task, guard, rec)
        check_left(rec)
        return await within_window(self._run_then_eval(episode, ctx, task, guard, rec), rec)

    async def _run_then_eval(
        self,
        episode: Episode,
        ctx: EpisodeContext,
        task: Task,
        guard: SampleGuard | None,
        rec: Attempt,
    ) -> tuple[AgentResult, Reward]:
        clock = self._clock
        rec.phase = "run"
        start = clock()
        try:
            if guard is None:
                result = await episode.run(ctx)
            else:
                result = await guard.supervise(episode.run(ctx), abort_grace_s=self._abort_grace_s)
        finally:
            rec.used_s += clock() - start
        rec.turns = len(result.turns)
        rec.agent_reason = result.termination_reason
        self._check_result(task, result)
        rec.phase = "eval"
        check_left(rec)
        start = clock()
        try:
            reward = await episode.eval(ctx, result)
        finally:
            rec.used_s += clock() - start
        return result, reward

    # ------------------------------------------------------------------ outcomes

    def _check_result(self, task: Task, result: AgentResult) -> None:
        """Refuse what ``run`` returned when it cannot become a sample (phase ``run``)."""
        if result.termination_reason.is_abort:
            raise ReportedAbort(result.termination_reason)
        if self._train and not result.has_logprobs:
            raise AgentError(
                f"task {task.sample_id} (dataset {task.dataset_name!r}): a training sample needs "
                f"response tokens with one logprob each, got {len(result.response_token_ids)} "
                f"tokens and {len(result.response_logprobs)} logprobs"
            )

    def _finished(
        self,
        task: Task,
        attempt: int,
        rec: Attempt,
        result: AgentResult,
        reward: Reward | None,
    ) -> list[Event]:
        rollout_id = self.plan.admitted.rollout_id
        key, stored = (
            self._prompts.refer(rollout_id, result.prompt_token_ids)
            if self._prompts is not None
            else ("", None)
        )
        events = completed_events(
            rollout_id=rollout_id,
            sample_id=task.sample_id,
            attempt=attempt,
            rec=rec,
            result=result,
            reward=reward,
            policy_version=self._policy_version,
            causation=self.plan.causation,
            prompt_key=key,
        )
        if stored is not None:
            events.insert(0, stored)
        self.completed += 1
        return events

    def _aborted(
        self, sample_id: str, attempt: int, rec: Attempt, exc: BaseException, note: str = ""
    ) -> SampleAborted:
        self.aborted += 1
        return aborted_event(
            rollout_id=self.plan.admitted.rollout_id, sample_id=sample_id, attempt=attempt,
            rec=rec, exc=exc, causation=self.plan.causation, note=note,
        )  # fmt: skip

    def _report(self, sample_id: str, attempt: int, rec: Attempt, terminal: Event) -> None:
        if self._on_task_done is None:
            return
        assert isinstance(terminal, SampleCompleted | SampleAborted)
        outcome = sample_row(
            self.plan.tasks.get(sample_id), terminal, attempt=attempt, turns=rec.turns,
            node=rec.node, batch_id=self.plan.admitted.batch_id,
        )  # fmt: skip
        try:
            self._on_task_done(outcome)
        except Exception:  # a progress printer must never fail a sample
            logger.exception("on_task_done callback failed")

    # ------------------------------------------------------------------ resources

    def _labelled_sandboxes(self, sample_id: str, attempt: int) -> LabelledProvider | None:
        if self._sandboxes is None:
            return None
        ad = self.plan.admitted
        labels = sandbox_labels(
            worker=self._settings.worker_id, rollout_id=ad.rollout_id, batch_id=ad.batch_id,
            sample_id=sample_id, attempt=attempt,
        )  # fmt: skip
        return LabelledProvider(self._sandboxes, labels)


def sample_seed(request_seed: int, index: int) -> int:
    """A sample's sampling seed: distinct per sample of a group (so the group's samples
    differ), the same for every attempt of the sample (so a re-run can reproduce it), and a
    function of the request's seed only -- never of global random state."""
    return (request_seed * 1_000_003 + index) % 2**31


def _float_knob(knobs: Mapping[str, Any], name: str) -> float | None:
    """A number knob of the rollout request (``None`` when unset or not a number)."""
    value = knobs.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int_knob(knobs: Mapping[str, Any], name: str) -> int | None:
    """An integer knob of the rollout request (``None`` when unset or not an integer)."""
    value = knobs.get(name)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
