"""A batch run: one admitted batch's episodes, run and recorded as events.

One ``BatchRun`` is built per batch delivery (seeds: task-scheduler §4), drains the batch and
is discarded. It holds no domain logic: the binding's ``BaseAgent`` owns each episode, one
``Episode`` per attempt (``agent.episode(task)``), and gets the worker's ports through its
``EpisodeContext``: the backend pool and the sandbox provider, labelled for the attempt.

Per sample, in this order (rollout-engine §3):

1. the batch's ``asyncio.Semaphore`` (``profile.resource.concurrency``) is taken and spans
   ``init -> run -> eval -> cleanup``;
2. ``init`` runs before any placement token is held;
3. one *local placement token* -- one of the batch's ``token_ids``, handed out one per
   running sample -- is taken (a sample waits for a free one) and held through ``run``,
   ``eval`` and ``cleanup``; ``SampleStarted`` (attempt, node) is emitted once it is held;
4. ``cleanup`` always runs once ``init`` was entered, even after a failure; afterwards the
   attempt's ``tmp_dir`` (a path reserved inside a per-batch directory, which the agent
   creates if it needs one) is removed;
5. the outcome is emitted: one ``TurnCompleted`` per ``AgentResult.turns`` entry, then
   ``SampleCompleted`` -- or ``SampleAborted`` when anything raised. With a
   :class:`PromptStore` (the worker's), prompt tokens are stored once per rollout and prompt
   (``PromptStored``, emitted before the first sample that refers to it) and each
   ``SampleCompleted`` carries only its ``prompt_key``: the n samples of a group share one;
6. the token goes back to the batch; tokens no remaining sample can use (more tokens held
   than ``min(unfinished samples, concurrency)``) are released at once with
   ``TokenReleased`` on the pool, and the rest when the batch ends.

Failure semantics: any exception, in any phase, aborts the sample (``SampleAborted``:
``classify_abort`` class, the agent's own termination reason when it had one, phase,
elapsed time vs the episode window, node, turns); the trainer then sees a masked dummy. The
episode window is ``StoppingCriteria.timeout_s`` of the sample's ``TaskFetched`` and covers
init, run and eval (not the wait for a token); when it elapses the phase is cancelled and
the sample is aborted as ``agent_timeout``. An agent that *returns* an abort reason
(``infra_*``, ``agent_timeout``) is aborted the same way. A training rollout needs response
tokens with logprobs; a result without them is aborted as ``infra_other``.

Cancellation (shutdown past the grace period) is not a failure: a cancelled sample emits
nothing, keeps its token with the batch, and is re-run by the worker that claims the batch.

The outcome events are decided by the pure functions of :mod:`engine.actors.outcomes`.

Events go through an ``EventSink`` (the worker's group-commit appender): emitting never
waits for Redis, order is preserved, and the worker flushes before it acks the batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from engine import metrics
from engine.actors.outcomes import (
    Attempt as _Attempt,
)
from engine.actors.outcomes import (
    ReportedAbort as _ReportedAbort,
)
from engine.actors.outcomes import (
    aborted_event,
    completed_events,
)
from engine.actors.verify import VerifyPolicy, selected, verify_result
from engine.agents.base import AgentResult, Episode, EpisodeContext, Reward, noop_phase
from engine.agents.binding import EvaluatorBinding
from engine.backends.base import GenerationResult, ModelBackend
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend
from engine.domain import (
    SamplingParams,
    StoppingCriteria,
    Task,
)
from engine.errors import AgentError, EpisodeTimeout
from engine.events.arrays import TokenIds
from engine.events.base import Event
from engine.events.catalog import (
    BatchAdmitted,
    PromptStored,
    RolloutKind,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    SampleVerified,
    TaskFetched,
    TokenReleased,
)
from engine.events.fastpath import field_layout, trusted
from engine.events.log import EMPTY_ID, EventLog
from engine.events.names import StreamNames
from engine.outcomes import TerminationReason
from engine.projections.rollout import ControlProjection, staleness_floor, version_meets
from engine.projections.rows import SampleRow, sample_row
from engine.projections.samples import task_of
from engine.runtime.live import LiveFold
from engine.sandbox.base import Sandbox, SandboxLimits, SandboxProvider

__all__ = [
    "PromptStore",
    "BatchPlan",
    "ControlWatch",
    "SampleGuard",
    "EpisodeSettings",
    "BatchRun",
    "EventSink",
    "LabelledProvider",
    "OnTaskDone",
    "sample_seed",
    "sandbox_labels",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


class PromptStore:
    """Which prompts this process has stored (``PromptStored``) per rollout, so a group's
    n samples carry a reference to one copy instead of n (see the module docstring).

    A prompt is marked stored when its event is emitted: the sink writes in emit order and
    keeps failed writes at the head of its queue, so the ``PromptStored`` is in the log
    before any event that refers to it. Another process keeps its own marks and may store
    the same prompt again; the fold keeps the first. Prompts of at most ``inline_bytes``
    bytes stay inline (a reference would not be smaller). The marks are bounded
    (``max_keys``, oldest forgotten first: a forgotten prompt is just stored again).
    """

    def __init__(self, *, inline_bytes: int = 64, max_keys: int = 65_536) -> None:
        self.inline_bytes = inline_bytes
        self.max_keys = max_keys
        self._stored: OrderedDict[tuple[str, str], None] = OrderedDict()

    def refer(self, rollout_id: str, prompt_ids: TokenIds) -> tuple[str, PromptStored | None]:
        """``(prompt_key, event to emit first or None)``; ``("", None)``: keep it inline."""
        data = prompt_ids.data
        if len(data) <= self.inline_bytes:
            return "", None
        key = hashlib.blake2b(data, digest_size=12).hexdigest()
        mark = (rollout_id, key)
        if mark in self._stored:
            self._stored.move_to_end(mark)
            return key, None
        self._stored[mark] = None
        while len(self._stored) > self.max_keys:
            self._stored.popitem(last=False)
        return key, PromptStored(rollout_id=rollout_id, prompt_key=key, prompt_ids=prompt_ids)


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
        watch: ControlWatch | None = None,
        abort_grace_s: float = 10.0,
        prompts: PromptStore | None = None,
    ) -> None:
        self.spec = spec
        self._watch = watch
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
        self._sem = asyncio.Semaphore(spec.profile.resource.concurrency)
        self._gated = bool(plan.tokens)
        self._held: set[str] = set(plan.tokens)
        self._free: asyncio.Queue[str] = asyncio.Queue()
        for token in plan.tokens:
            self._free.put_nowait(token)
        self._unfinished = len(plan.run_ids)
        self._releasing: list[str] = []
        self._release_scheduled = False
        self._rollout_stream = names.rollout(plan.admitted.rollout_id)
        # The batch's directory: named now, made only by an episode that needs its own.
        root = settings.tmp_root or Path(tempfile.gettempdir())
        self._batch_tmp = root / f"rollout-batch-{secrets.token_hex(8)}"
        request = plan.request
        self._train = request is None or request.kind is RolloutKind.TRAIN
        self._policy_version = request.policy_version if request is not None else 0
        self._seed = request.seed if request is not None else 0
        knobs: Mapping[str, Any] = request.knobs if request is not None else {}
        # Eval runs student-only (task-scheduler §5): an eval request's ``dagger_beta`` is
        # dropped; an explicit ``eval_dagger_beta`` knob re-injects one.
        self._dagger_beta = _float_knob(knobs, "dagger_beta" if self._train else "eval_dagger_beta")
        self._t_max = _int_knob(knobs, "t_max")
        # Issue 12: only a request with a staleness bound or an over-provisioned plan has
        # its samples guarded (checked before each sample and turn, rids under a prefix).
        self._guarded = watch is not None and request is not None and (
            request.max_staleness is not None or request.n_planned_prompts > request.n_prompts
        )
        self._verify = settings.verify.for_request(knobs)
        self.completed = 0
        self.aborted = 0
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
        self._release_surplus("surplus")
        try:
            if self.plan.run_ids:
                await asyncio.gather(*(self._sample(sid) for sid in self.plan.run_ids))
            self._release_now("sample_done")
            if self._held:
                self._release(sorted(self._held), "batch_done")
        finally:
            _remove_dir(self._batch_tmp)

    def _emit(self, events: Sequence[Event], stream: str | None = None) -> None:
        target = stream or self._rollout_stream
        self._sink.emit([(target, ev) for ev in events])

    def _release(self, token_ids: list[str], reason: str) -> None:
        for token in token_ids:
            self._held.discard(token)
        ad = self.plan.admitted
        self._emit(
            [
                TokenReleased(
                    rollout_id=ad.rollout_id,
                    batch_id=ad.batch_id,
                    token_ids=token_ids,
                    reason=reason,
                    causation=self.plan.causation,
                    lease=self.plan.lease,
                )
            ],
            self._names.pool,
        )

    def _release_surplus(self, reason: str) -> None:
        """Give back free tokens beyond what the unfinished samples can still use.

        Tokens freed by samples that end in the same event-loop tick leave in one
        ``TokenReleased``, emitted at the end of the tick: after those samples' terminal
        events (emission order is log order), and with one entry instead of one per sample.
        """
        needed = min(self._unfinished, self.spec.profile.resource.concurrency)
        while len(self._held) > needed and not self._free.empty():
            token = self._free.get_nowait()
            self._held.discard(token)
            self._releasing.append(token)
        if self._releasing and not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._release_now, reason)

    def _release_now(self, reason: str) -> None:
        self._release_scheduled = False
        tokens, self._releasing = self._releasing, []
        if tokens:
            self._release(tokens, reason)

    async def _take_token(self) -> str | None:
        if not self._gated:
            return None
        return await self._free.get()

    def _return_token(self, token: str | None) -> None:
        self._unfinished -= 1
        if token is not None:
            self._free.put_nowait(token)
        if self._gated:
            self._release_surplus("sample_done")

    # ------------------------------------------------------------------ sample

    async def _sample(self, sample_id: str) -> None:
        attempt = self.plan.attempts.get(sample_id, 1)
        rec = _Attempt()
        token: str | None = None
        outcome: list[Event]
        in_flight = self._in_flight
        in_flight.inc()
        try:
            outcome, token = await self._episode(sample_id, attempt, rec)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failure outside any phase (bad task data)
            outcome = [self._aborted(sample_id, attempt, rec, exc)]
        finally:
            in_flight.dec()
        done = "completed" if isinstance(outcome[-1], SampleCompleted) else "aborted"
        self._done_metric[done].inc()
        self._emit(outcome)
        self._return_token(token)
        self._report(sample_id, attempt, rec, outcome[-1])

    async def _episode(
        self, sample_id: str, attempt: int, rec: _Attempt
    ) -> tuple[list[Event], str | None]:
        ev = self.plan.tasks.get(sample_id)
        if ev is None:
            raise AgentError(
                f"sample {sample_id} of batch {self.plan.admitted.batch_id} has no TaskFetched "
                f"in rollout {self.plan.admitted.rollout_id}"
            )
        task = task_of(ev)
        stopping, sampling = self._generation(ev)
        rec.window_s = stopping.timeout_s
        guard = (
            SampleGuard(self.plan.request, self._watch, ev.rollout_id, sample_id, attempt)
            if self._guarded
            else None
        )
        if guard is not None:
            guard.before_turn()  # a sample that can no longer be used is not started
        episode = self.spec.agent.episode(task)
        token: str | None = None
        result: AgentResult | None = None
        reward: Reward | None = None
        failure: BaseException | None = None
        failed_phase = ""
        verified: SampleVerified | None = None
        async with self._sem:
            if guard is not None:
                guard.before_turn()  # it may have waited for the semaphore
            tmp = _LazyTmp(self._batch_tmp, sample_id, attempt)
            # One trajectory, one policy server (BackendPool.bind), released after cleanup.
            backends = (
                self._backends.bind(f"{ev.rollout_id}/{sample_id}/{attempt}")
                if self._backends is not None
                else None
            )
            if backends is not None and guard is not None:
                backends = _GuardedPool(backends, guard)
            ctx: EpisodeContext = _attempt_context(
                rollout_id=ev.rollout_id,
                sample_id=sample_id,
                attempt=attempt,
                stopping=stopping,
                sampling_params=sampling,
                backends=backends,
                sandboxes=self._labelled_sandboxes(sample_id, attempt),
                policy_version=self._policy_version,
                seed=sample_seed(self._seed, ev.index),
                node=None,
                dagger_beta=self._dagger_beta,
                t_max=self._t_max,
                _tmp=tmp,
            )
            try:
                rec.phase = "init"
                await self._timed(episode.init(ctx), rec, scoped=not noop_phase(episode, "init"))
                token = await self._take_token()
                if token is not None:
                    rec.node = self.plan.admitted.nodes.get(token, "")
                    gpus = self.plan.admitted.gpus.get(token)
                    rec.gpu = gpus[0] if gpus else None
                if rec.node:  # the context as it was, with the token's node
                    ctx = _with_node(ctx, rec.node)
                self._emit([self._started(sample_id, attempt, rec.node)])
                result, reward = await self._run_and_eval(episode, ctx, task, guard, rec)
                if selected(sample_id, self._verify.fraction):
                    verified = await verify_result(
                        backends, rollout_id=ev.rollout_id, sample_id=sample_id,
                        attempt=attempt, result=result, threshold=self._verify.threshold,
                    )  # fmt: skip
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failure, failed_phase = exc, rec.phase
            finally:
                rec.phase = "cleanup"
                try:
                    if noop_phase(episode, "cleanup"):  # returns at once: no timer
                        await episode.cleanup(ctx)
                    else:
                        async with asyncio.timeout(self._settings.cleanup_timeout_s):
                            await episode.cleanup(ctx)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if failure is None:
                        failure, failed_phase = exc, "cleanup"
                    else:
                        logger.warning("cleanup of %s failed after an abort: %s", sample_id, exc)
                finally:
                    if tmp.path is not None:  # the episode asked for its directory
                        _remove_dir(tmp.path)
                    if backends is not None:
                        backends.release()
        if failure is None and result is not None:
            try:
                events = self._finished(task, attempt, rec, result, reward)
                if verified is not None:  # folded before the sample is terminal
                    events.insert(len(events) - 1, verified)
                return events, token
            except Exception as exc:
                failure, failed_phase = exc, "eval"
        assert failure is not None
        rec.phase = failed_phase
        return [self._aborted(sample_id, attempt, rec, failure)], token

    async def _run(
        self, run: Coroutine[Any, Any, AgentResult], guard: SampleGuard | None
    ) -> AgentResult:
        """The run phase; a guarded one is watched: a sample that falls into the aborted
        tail of its rollout has its generations aborted on the model server
        (``/abort_request`` with its rid prefix) and ends as ``tail_aborted``; a guard's
        verdict (stale, tail) wins over what the agent made of a refused turn."""
        if guard is None or self._watch is None:
            return await run
        task = asyncio.ensure_future(run)
        try:
            while not task.done():
                # the waiter first: a change after the check below still wakes it
                waiter = asyncio.ensure_future(self._watch.wait_changed())
                try:
                    if not guard.tail_aborted():
                        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                if not task.done() and guard.tail_aborted():
                    guard.ended = TerminationReason.TAIL_ABORTED
                    if guard.servers:  # let the aborted generations end the run itself
                        await guard.abort_on_servers()
                        await asyncio.wait({task}, timeout=self._abort_grace_s)
                    if not task.done():
                        task.cancel()
                        await asyncio.wait({task})
                    ended = None if task.cancelled() else task.exception()
                    raise _ReportedAbort(TerminationReason.TAIL_ABORTED) from ended
            try:
                result = task.result()
            except Exception as exc:
                if guard.ended is not None:
                    raise _ReportedAbort(guard.ended) from exc
                raise
            if guard.ended is not None:
                raise _ReportedAbort(guard.ended)
            return result
        finally:
            if not task.done():
                task.cancel()

    def _generation(self, ev: TaskFetched) -> tuple[StoppingCriteria, SamplingParams]:
        """The sample's stopping criteria and sampling params: the planner resolved the
        cascade (request, evaluator profile, dataset) into the ``TaskFetched``."""
        return ev.stopping, ev.sampling_params

    async def _timed(
        self, step: Coroutine[Any, Any, T], rec: _Attempt, *, scoped: bool = True
    ) -> T:
        """Await one phase within what is left of the episode window (``scoped=False``: a
        phase known to return at once, timed without a timeout scope of its own)."""
        window = rec.window_s
        if window is not None and window - rec.used_s <= 0:
            step.close()
            raise EpisodeTimeout(f"episode window of {window:g} s elapsed before {rec.phase}")
        start = self._clock()
        try:
            if window is None or not scoped:
                return await step
            return await _within_window(step, window, rec)
        finally:
            rec.used_s += self._clock() - start

    async def _run_and_eval(
        self,
        episode: Episode,
        ctx: EpisodeContext,
        task: Task,
        guard: SampleGuard | None,
        rec: _Attempt,
    ) -> tuple[AgentResult, Reward]:
        """The run and eval phases under one timeout scope: nothing between them is outside
        the episode window, so the deadline of what is left when run starts serves both."""
        rec.phase = "run"
        window = rec.window_s
        if window is None:
            return await self._run_then_eval(episode, ctx, task, guard, rec)
        if window - rec.used_s <= 0:
            raise EpisodeTimeout(f"episode window of {window:g} s elapsed before run")
        return await _within_window(
            self._run_then_eval(episode, ctx, task, guard, rec), window, rec
        )

    async def _run_then_eval(
        self,
        episode: Episode,
        ctx: EpisodeContext,
        task: Task,
        guard: SampleGuard | None,
        rec: _Attempt,
    ) -> tuple[AgentResult, Reward]:
        clock = self._clock
        rec.phase = "run"
        start = clock()
        try:
            result = await self._run(episode.run(ctx), guard)
        finally:
            rec.used_s += clock() - start
        rec.turns = len(result.turns)
        rec.agent_reason = result.termination_reason
        self._check_result(task, result)
        rec.phase = "eval"
        window = rec.window_s
        if window is not None and window - rec.used_s <= 0:
            raise EpisodeTimeout(f"episode window of {window:g} s elapsed before eval")
        start = clock()
        try:
            reward = await episode.eval(ctx, result)
        finally:
            rec.used_s += clock() - start
        return result, reward

    # ------------------------------------------------------------------ outcomes

    def _started(self, sample_id: str, attempt: int, node: str) -> SampleStarted:
        ad = self.plan.admitted  # every value is already a str (the attempt an int)
        return trusted(
            SampleStarted,
            {
                "type": "SampleStarted",
                "producer": "",
                "causation": self.plan.causation,
                "rollout_id": ad.rollout_id,
                "sample_id": sample_id,
                "attempt": attempt,
                "batch_id": ad.batch_id,
                "worker": self._settings.worker_id,
                "node": node,
            },
            _STARTED_SET,
        )

    def _check_result(self, task: Task, result: AgentResult) -> None:
        """Refuse what ``run`` returned when it cannot become a sample (phase ``run``)."""
        if result.termination_reason.is_abort:
            raise _ReportedAbort(result.termination_reason)
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
        rec: _Attempt,
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
        self, sample_id: str, attempt: int, rec: _Attempt, exc: BaseException
    ) -> SampleAborted:
        self.aborted += 1
        return aborted_event(
            rollout_id=self.plan.admitted.rollout_id,
            sample_id=sample_id,
            attempt=attempt,
            rec=rec,
            exc=exc,
            causation=self.plan.causation,
        )

    def _report(self, sample_id: str, attempt: int, rec: _Attempt, terminal: Event) -> None:
        if self._on_task_done is None:
            return
        assert isinstance(terminal, SampleCompleted | SampleAborted)
        outcome = sample_row(
            self.plan.tasks.get(sample_id),
            terminal,
            attempt=attempt,
            turns=rec.turns,
            node=rec.node,
            batch_id=self.plan.admitted.batch_id,
        )
        try:
            self._on_task_done(outcome)
        except Exception:  # a progress printer must never fail a sample
            logger.exception("on_task_done callback failed")

    # ------------------------------------------------------------------ resources

    def _labelled_sandboxes(self, sample_id: str, attempt: int) -> LabelledProvider | None:
        if self._sandboxes is None:
            return None
        return LabelledProvider(
            self._sandboxes,
            sandbox_labels(
                worker=self._settings.worker_id,
                rollout_id=self.plan.admitted.rollout_id,
                batch_id=self.plan.admitted.batch_id,
                sample_id=sample_id,
                attempt=attempt,
            ),
        )


_STARTED_SET = field_layout(
    SampleStarted,
    ("type", "producer", "causation", "rollout_id", "sample_id", "attempt", "batch_id",
     "worker", "node"),
)  # fmt: skip


# ---------------------------------------------------------------- issue 12: ending work early


class ControlWatch:
    """``rl:control`` followed by a worker (a blocking read in its own task): the trainer's
    published version and the tails of over-provisioned rollouts that became ready, which
    every ``BatchRun`` of the worker reads before each sample and each turn. ``changed``
    wakes episodes waiting on it whenever something new was folded."""

    def __init__(self, log: EventLog, *, block_ms: int = 1000) -> None:
        self._fold = LiveFold(log, log.names.control, ControlProjection())
        self._log = log
        self._block_ms = block_ms
        self._changed = asyncio.Event()
        self._ready = asyncio.Event()

    @property
    def published(self) -> int | None:
        return self._fold.state.published

    def tail_of(self, rollout_id: str) -> tuple[str, frozenset[str]] | None:
        """``(mode, sample ids)`` of a ready rollout's tail; None: not ready with one."""
        return self._fold.state.tails.get(rollout_id)

    async def wait_changed(self) -> None:
        """Return once the next change has been folded."""
        event = self._changed
        await event.wait()

    async def caught_up(self) -> None:
        """Return once the stream's history has been folded (the first read)."""
        await self._ready.wait()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the stream until ``stop``; a Redis error is retried after a pause."""
        position = EMPTY_ID
        while not stop.is_set():
            try:
                envs, position = await self._log.read_after(
                    self._log.names.control,
                    position,
                    block_ms=0 if not self._ready.is_set() else self._block_ms,
                    count=2000,
                )
            except Exception as exc:  # a transient outage: the next read retries
                logger.warning("control watch: read failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            if envs:
                self._fold.apply(envs)
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()
            if not envs and not self._ready.is_set():
                self._ready.set()


class SampleGuard:
    """One attempt's checks against its rollout's staleness bound and partial-rollout tail.

    ``before_turn`` runs before every generation of the policy (each turn) and before the
    sample starts: it refuses to start work the sample can no longer use -- a turn of a
    sample whose earlier turns already ran on weights older than the bound (the trainer's
    current version minus ``max_staleness``; a turn of unknown version never meets a bound),
    or anything of a sample in the aborted tail of a rollout that became ready. ``ended``
    is then the reason, which wins over whatever the agent made of the refusal."""

    def __init__(
        self,
        request: RolloutRequested | None,
        watch: ControlWatch | None,
        rollout_id: str,
        sample_id: str,
        attempt: int,
    ) -> None:
        self.request = request
        self.watch = watch
        self.rollout_id = rollout_id
        self.sample_id = sample_id
        # Every generation of the attempt carries a rid under this prefix, so one
        # /abort_request (SGLang matches rids by prefix) reaches all of them.
        self.rid_prefix = f"{sample_id}/a{attempt}/"
        self.oldest: int | None = None  # oldest weight version a turn ran on (-1: unknown)
        self.turns = 0
        self.ended: TerminationReason | None = None
        self.servers: list[SGLangBackend] = []

    def floor(self) -> int | None:
        published = self.watch.published if self.watch is not None else None
        return staleness_floor(self.request, published)

    def tail_aborted(self) -> bool:
        if self.watch is None:
            return False
        tail = self.watch.tail_of(self.rollout_id)
        return tail is not None and tail[0] == "abort" and self.sample_id in tail[1]

    def verdict(self) -> TerminationReason | None:
        """Why the sample cannot go on (None: it can)."""
        if self.tail_aborted():
            return TerminationReason.TAIL_ABORTED
        floor = self.floor()
        if floor is not None and self.oldest is not None and not version_meets(
            self.oldest, floor
        ):
            return TerminationReason.STALE
        return None

    def before_turn(self) -> None:
        reason = self.verdict()
        if reason is not None:
            self.ended = self.ended or reason
            raise _ReportedAbort(self.ended)

    def record(self, result: GenerationResult) -> None:
        self.turns += 1
        version = result.weight_version if result.weight_version is not None else -1
        if self.oldest is None or version < self.oldest:
            self.oldest = version

    def next_rid(self) -> str:
        return f"{self.rid_prefix}t{self.turns}"

    async def abort_on_servers(self) -> None:
        """``/abort_request`` for the attempt's rid prefix on every server it generated on."""
        for server in self.servers:
            try:
                await server.abort(self.rid_prefix)
            except Exception as exc:  # the generation ends on its own then
                logger.warning("abort of %s on a model server failed: %s", self.rid_prefix, exc)


class _GuardedBackend:
    """A policy backend (not SGLang's) whose every generation is checked by the attempt's
    guard first and reports its version."""

    def __init__(self, inner: ModelBackend, guard: SampleGuard) -> None:
        self._inner = inner
        self._guard = guard

    @property
    def supports_token_ids(self) -> bool:
        return self._inner.supports_token_ids

    async def generate(self, **kwargs: Any) -> GenerationResult:
        self._guard.before_turn()
        result = await self._inner.generate(**kwargs)
        self._guard.record(result)
        return result

    def __getattr__(self, name: str) -> Any:  # tokenize, decode, score, abort, ...
        if name.startswith("__") or name in ("_inner", "_guard"):
            raise AttributeError(name)  # never recurse (copy, pickle, a half-built object)
        return getattr(self._inner, name)


class _GuardedSGLang(SGLangBackend):
    """An ``SGLangBackend`` sharing the pool's client, guarded like :class:`_GuardedBackend`;
    still an ``SGLangBackend`` for callers that need one (the recording proxy)."""

    def __init__(self, inner: SGLangBackend, guard: SampleGuard) -> None:  # no super(): a view
        self.__dict__.update(inner.__dict__)
        self._guard = guard
        if inner not in guard.servers:
            guard.servers.append(inner)

    async def generate(self, *, rid: str | None = None, **kwargs: Any) -> GenerationResult:
        self._guard.before_turn()
        result = await super().generate(rid=rid or self._guard.next_rid(), **kwargs)
        self._guard.record(result)
        return result

    async def aclose(self) -> None:
        """The pool owns the client; a trajectory's view closes nothing."""


class _GuardedPool(BackendPool):
    """A bound view of the worker's pool whose policy backends are guarded."""

    def __init__(self, view: BackendPool, guard: SampleGuard) -> None:  # no super(): a view
        self._shared = view._shared
        self._key = view._key
        self._guard = guard

    def get(self, url: str | None = None, *, key: str | None = None) -> ModelBackend:
        backend = super().get(url, key=key)
        if url and url.rstrip("/") not in {u.rstrip("/") for u in self.default_urls}:
            return backend  # another endpoint (a teacher, a judge): not the policy
        if isinstance(backend, SGLangBackend):
            return _GuardedSGLang(backend, self._guard)
        return cast(ModelBackend, _GuardedBackend(backend, self._guard))


def sandbox_labels(
    *, worker: str, rollout_id: str, batch_id: str, sample_id: str = "", attempt: int = 0
) -> dict[str, str]:
    """Labels stamped on every sandbox an episode opens; reaping selects on them."""
    labels = {"rollout.worker": worker, "rollout.rollout": rollout_id, "rollout.batch": batch_id}
    if sample_id:
        labels["rollout.sample"] = sample_id
        labels["rollout.attempt"] = str(attempt)
    return labels


class LabelledProvider:
    """A sandbox provider that stamps the episode's labels on every sandbox it creates, so
    the worker that claims a dead worker's batch can reap what that worker left running."""

    def __init__(self, inner: SandboxProvider, labels: Mapping[str, str]) -> None:
        self._inner = inner
        self._labels = dict(labels)

    def create(self, *, labels: Mapping[str, str], limits: SandboxLimits | None = None) -> Sandbox:
        return self._inner.create(labels={**labels, **self._labels}, limits=limits)

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        return await self._inner.reap(label_selector)


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


async def _within_window(step: Coroutine[Any, Any, T], window: float, rec: _Attempt) -> T:
    """Await ``step`` under one timeout scope of what is left of the episode ``window``; its
    expiry is an ``EpisodeTimeout`` naming the phase it cut (``rec.phase`` by then)."""
    cm = asyncio.timeout(window - rec.used_s)
    try:
        async with cm:
            return await step
    except TimeoutError:
        if cm.expired():
            raise EpisodeTimeout(
                f"episode window of {window:g} s elapsed during {rec.phase}"
            ) from None
        raise


def _with_node(ctx: EpisodeContext, node: str) -> EpisodeContext:
    """``dataclasses.replace(ctx, node=node)`` without re-running ``__post_init__`` (every
    other field was checked when ``ctx`` was built): a per-sample copy on the hot path."""
    copy = _new(type(ctx))
    copy.__dict__.update(ctx.__dict__)
    _set(copy, "node", node)
    return copy


class _LazyTmp:
    """An attempt's ``tmp_dir``: a path reserved (not created) inside the batch's directory
    when the episode first reads it. Neither exists until an agent makes its own
    (``ctx.tmp_dir.mkdir(parents=True)``); most episodes never do (then no path is built and
    nothing is removed after cleanup), so a worker killed mid-batch leaves no empty
    directory behind. The batch's name carries a random part, and ``BatchRun.run`` removes
    it. ``path`` is None until read; copies of the attempt's context share the holder."""

    __slots__ = ("_batch", "_sample_id", "_attempt", "path")

    def __init__(self, batch: Path, sample_id: str, attempt: int) -> None:
        self._batch = batch
        self._sample_id = sample_id
        self._attempt = attempt
        self.path: Path | None = None

    def get(self) -> Path:
        if self.path is None:
            self.path = _attempt_dir(self._batch, self._sample_id, self._attempt)
        return self.path

    @classmethod
    def given(cls, path: Path) -> _LazyTmp:
        tmp = _new(cls)
        tmp.path = path
        return tmp


class _AttemptContext(EpisodeContext):
    """The ``EpisodeContext`` a ``BatchRun`` builds per attempt: the same fields, with
    ``tmp_dir`` made on first read (:class:`_LazyTmp`). Built by :func:`_attempt_context`;
    ``dataclasses.replace`` of one (which passes ``tmp_dir``) works as on the base class."""

    @property
    def tmp_dir(self) -> Path:
        tmp: _LazyTmp = self.__dict__["_tmp"]
        return tmp.get()

    @tmp_dir.setter
    def tmp_dir(self, value: Path) -> None:  # the dataclass __init__ (replace) sets it
        self.__dict__["_tmp"] = _LazyTmp.given(value)

    def __repr__(self) -> str:
        return EpisodeContext.__repr__(self).replace(type(self).__qualname__, "EpisodeContext", 1)


def _attempt_context(**fields: Any) -> _AttemptContext:
    """An :class:`_AttemptContext` of ``fields`` (every field but ``tmp_dir``, plus the
    ``_tmp`` holder), checked like ``EpisodeContext(...)`` without its per-field setattr."""
    ctx = _new(_AttemptContext)
    ctx.__dict__.update(fields)
    ctx.__post_init__()
    return ctx


_new = object.__new__
_set = object.__setattr__


def _attempt_dir(batch: Path, sample_id: str, attempt: int) -> Path:
    return batch / f"{_safe(sample_id)}-a{attempt}"


def _safe(name: str) -> str:
    if _PLAIN.fullmatch(name):  # the usual sample id: nothing to replace (one C pass)
        return name
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


_PLAIN = re.compile(r"[A-Za-z0-9._-]*")


def _remove_dir(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)

