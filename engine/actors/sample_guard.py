"""``SampleGuard``: one attempt's checks against its rollout's staleness bound and aborted tail.

A ``BatchRun`` guards the samples of a request with a staleness bound or an over-provisioned
plan (the others cannot become unusable while they run). The guard is a hook of the attempt's
bound view of the worker's ``BackendPool`` (``pool.bind(key, hooks=(guard,))``,
``engine/backends/hooks.py``), so it runs around every generation of the policy, whatever the
backend's class:

- before each generation (and before the sample starts) it refuses work the sample can no
  longer use: a turn of a sample whose earlier turns already ran on weights older than the
  bound (the trainer's current version minus ``max_staleness``; a turn of unknown version
  never meets a bound; not under the ``keep`` policy, whose stale samples run to the end),
  or anything of a sample in the aborted tail of a rollout that became
  ready. ``ended`` is then the reason, which wins over whatever the agent made of the refusal;
- it keeps each generation in flight by its rid (the attempt's view of the pool names every
  call, ``engine/backends/pool.py``) and the server it runs on, so that ending the attempt
  aborts each one by its exact rid: SGLang 0.5.23 with one tokenizer worker drops an abort
  whose rid no request holds exactly (``TokenizerManager.abort_request``), so a prefix
  would reach nothing;
- after each generation it records the weight version the server reported.

``supervise`` runs the attempt's ``run`` phase and ends it when the sample falls into the
aborted tail of its rollout while it runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from engine.actors.outcomes import ReportedAbort
from engine.agents.result import AgentResult
from engine.backends.base import GenerationResult, ModelBackend
from engine.backends.hooks import CallKind, ModelCall
from engine.events.catalog import RolloutRequested
from engine.outcomes import TerminationReason
from engine.projections.control import ControlState
from engine.projections.rollout import staleness_floor, version_meets
from engine.runtime.follower import Follower, FollowerClosed

__all__ = ["SampleGuard"]

logger = logging.getLogger(__name__)


class SampleGuard:
    """See the module docstring."""

    def __init__(
        self,
        request: RolloutRequested | None,
        control: Follower[ControlState] | None,
        rollout_id: str,
        sample_id: str,
        attempt: int,
    ) -> None:
        self.request = request
        self.control = control  # the worker's follower of rl:control
        self.rollout_id = rollout_id
        self.sample_id = sample_id
        self.attempt = attempt
        self.oldest: int | None = None  # oldest weight version a turn ran on (-1: unknown)
        self.turns = 0
        self.ended: TerminationReason | None = None
        self.in_flight: dict[str, ModelBackend] = {}  # rid -> its server (abort capability)

    def floor(self) -> int | None:
        """The bound the attempt is held to; None under the ``keep`` policy, whose stale
        samples run to the end (their rewards count in their groups)."""
        if self.request is not None and self.request.staleness_policy == "keep":
            return None
        published = self.control.state.published if self.control is not None else None
        return staleness_floor(self.request, published)

    def tail_aborted(self) -> bool:
        if self.control is None:
            return False
        tail = self.control.state.tail_of(self.rollout_id)
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
            raise ReportedAbort(self.ended)

    def record(self, result: GenerationResult) -> None:
        self.turns += 1
        version = result.weight_version if result.weight_version is not None else -1
        if self.oldest is None or version < self.oldest:
            self.oldest = version

    # -- the hook of the attempt's backends ----------------------------------------------------

    async def before(self, call: ModelCall) -> None:
        if call.kind is not CallKind.GENERATE:
            return  # a re-score or a pass-through is no turn of the policy
        self.before_turn()
        if call.rid is not None and call.backend.capabilities.abort:
            self.in_flight[call.rid] = call.backend

    def after(
        self, call: ModelCall, result: GenerationResult | None, error: BaseException | None
    ) -> None:
        if call.rid is not None:
            self.in_flight.pop(call.rid, None)
        if result is not None:
            self.record(result)

    # -- the run phase -------------------------------------------------------------------------

    async def abort_on_servers(self) -> None:
        """``/abort_request`` for each generation in flight, by its exact rid, on its server."""
        for rid, server in list(self.in_flight.items()):
            try:
                await server.abort(rid)
            except Exception as exc:  # the generation ends on its own then
                logger.warning("abort of %s on %r failed: %s", rid, server, exc)

    async def supervise(
        self, run: Coroutine[Any, Any, AgentResult], *, abort_grace_s: float
    ) -> AgentResult:
        """The run phase, watched: a sample that falls into the aborted tail of its rollout
        has its generations aborted on the model servers and ends as ``tail_aborted`` (the
        run is cancelled if it has not ended ``abort_grace_s`` later); a verdict of the guard
        (stale, tail) wins over what the agent made of a refused turn."""
        control = self.control
        if control is None:
            return await run
        task = asyncio.ensure_future(run)
        try:
            while not task.done():
                # the waiter first: a change after the check below still wakes it
                waiter = asyncio.ensure_future(control.changed(control.version))
                try:
                    if not self.tail_aborted():
                        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    if waiter.done() and isinstance(waiter.exception(), FollowerClosed):
                        await asyncio.wait({task})  # nothing changes any more
                finally:
                    waiter.cancel()
                if not task.done() and self.tail_aborted():
                    await self._end_tail(task, abort_grace_s)
            try:
                result = task.result()
            except Exception as exc:
                if self.ended is not None:
                    raise ReportedAbort(self.ended) from exc
                raise
            if self.ended is not None:
                raise ReportedAbort(self.ended)
            return result
        finally:
            if not task.done():
                task.cancel()

    async def _end_tail(self, task: asyncio.Future[AgentResult], grace_s: float) -> None:
        self.ended = TerminationReason.TAIL_ABORTED
        if self.in_flight:  # let the aborted generations end the run itself
            await self.abort_on_servers()
            await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
        ended = None if task.cancelled() else task.exception()
        raise ReportedAbort(TerminationReason.TAIL_ABORTED) from ended
