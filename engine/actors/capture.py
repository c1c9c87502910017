"""The capture worker: force-decodes kept trajectories on the teacher.

Contract
--------
* Input: ``CaptureRequested`` on ``rl:capture`` (group ``capture``), from the finalizer
  once every sample of a per-token-loss rollout is terminal.
* Each named sample completed and not yet scored is force-decoded (``prompt_ids +
  response_ids``, up to ``concurrency`` at once) and gets a ``TeacherScored`` on the
  rollout stream: the teacher's logprob of every response token, its top-K ids and
  logprobs (row-major, K per position) and the action mask (the loss mask without DAgger
  teacher tokens). Lane shaping happens when samples are built (``engine.projections.lanes``).
* A call is tried ``max_tries`` times with a growing pause; a persistent failure sends
  ``RolloutFailed`` to the rollout stream and ``rl:control``, and the request is acked.
* One request at a time on the actor runtime; a stop hands the one in progress back. The
  entry is acked once its events are written, and a redelivery skips the samples already
  scored, so a crash costs at most the scoring in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.events.arrays import LogProbs, TokenIds
from engine.events.catalog import CaptureRequested, RolloutFailed, SampleCompleted, TeacherScored
from engine.events.log import EventLog
from engine.projections.lanes import action_mask_of
from engine.projections.rollout import RolloutProjection
from engine.runtime.appender import GroupAppender
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer
from engine.runtime.loop import serve
from engine.runtime.readback import read_back
from engine.runtime.rebuild import rebuild

__all__ = ["BackendScorer", "CaptureConfig", "CaptureWorker", "TeacherScorer", "TeacherScores"]

logger = logging.getLogger(__name__)

GROUP = "capture"

TeacherScores = tuple[Sequence[float], Sequence[Sequence[int]], Sequence[Sequence[float]]]
"""``(logprobs, topk_ids, topk_logprobs)``: one entry per response token; rows of K."""


class TeacherScorer(Protocol):

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int
    ) -> TeacherScores: ...


class _ForceDecoder(Protocol):
    async def score_response(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        top_logprobs_num: int | None = None,
    ) -> Any: ...


class BackendScorer:
    """:class:`TeacherScorer` on ``engine.backends.teacher.TeacherBackend``."""

    def __init__(self, backend: _ForceDecoder) -> None:
        self.backend = backend

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int
    ) -> TeacherScores:
        result = await self.backend.score_response(
            prompt_ids, response_ids, top_logprobs_num=top_k
        )
        return result.logprobs, result.top_token_ids, result.top_logprobs


@dataclass(frozen=True, kw_only=True)
class CaptureConfig:
    consumer: str
    concurrency: int = 8
    max_tries: int = 3
    retry_pause_s: float = 0.5
    heartbeat_ms: int = 10_000
    claim_idle_ms: int = 60_000
    block_ms: int | None = None
    group: str = GROUP
    outage_limit_s: float | None = 300.0


class _TeacherFailed(Exception):
    pass


class CaptureWorker:
    def __init__(self, log: EventLog, scorer: TeacherScorer, config: CaptureConfig) -> None:
        self.log = log
        self.names = log.names
        self.scorer = scorer
        self.config = config
        self.sink = GroupAppender(log)
        self.consumer = GroupConsumer(
            log,
            group=config.group,
            consumer=config.consumer,
            streams=[self.names.capture],
            heartbeat_ms=config.heartbeat_ms,
            claim_idle_ms=config.claim_idle_ms,
            block_ms=config.block_ms,
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self._sem = asyncio.Semaphore(config.concurrency)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve capture requests until ``stop``."""
        try:
            await serve(
                self.consumer,
                stop or asyncio.Event(),
                self._handle,
                capacity=1,
                settle_writes=self.sink.flush,  # nothing queued for a request given up
            )
        finally:
            await self.sink.aclose()

    async def _handle(self, d: Delivery) -> None:
        ev = d.env.event
        if isinstance(ev, CaptureRequested):
            await self.capture(ev, causation=d.env.ref)

    async def capture(self, request: CaptureRequested, *, causation: str | None = None) -> int:
        """Score the request's samples; returns how many were scored now."""
        stream = self.names.rollout(request.rollout_id)
        state = (await rebuild(self.log, stream, RolloutProjection())).state
        ids = [
            sid
            for sid in request.sample_ids
            if (rec := state.samples.get(sid)) is not None and rec.completed and not rec.scored
        ]
        rollout = await read_back(self.log, stream, state, ids)
        todo = [rollout.completed(state.samples[sid]) for sid in ids]
        results = await asyncio.gather(
            *(self._score_one(s, request.top_k, causation) for s in todo),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        for r in failures:
            if not isinstance(r, _TeacherFailed):
                raise r
        scored = [r for r in results if isinstance(r, TeacherScored)]
        self.sink.emit([(stream, ev) for ev in scored])
        if failures:
            reason = str(failures[0])
            failed = RolloutFailed(
                rollout_id=request.rollout_id, reason=reason, causation=causation
            )
            self.sink.emit([(stream, failed), (self.names.control, failed)])
            logger.error("rollout %s failed: %s", request.rollout_id, reason)
        await self.sink.flush()
        return len(scored)

    async def _score_one(
        self, done: SampleCompleted, top_k: int, causation: str | None
    ) -> TeacherScored:
        prompt = done.prompt_ids.tolist()
        response = done.response_ids.tolist()
        last: Exception | None = None
        async with self._sem:
            for attempt in range(1, self.config.max_tries + 1):
                try:
                    logprobs, top_ids, top_lps = await self.scorer.score(prompt, response, top_k)
                    return _scored(done, top_k, logprobs, top_ids, top_lps, causation)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    last = exc
                    logger.warning(
                        "teacher scoring of %s failed (try %d of %d): %s",
                        done.sample_id,
                        attempt,
                        self.config.max_tries,
                        exc,
                    )
                    if attempt < self.config.max_tries:
                        await asyncio.sleep(self.config.retry_pause_s * attempt)
        raise _TeacherFailed(
            f"teacher scoring of sample {done.sample_id} failed after {self.config.max_tries} "
            f"tries: {type(last).__name__}: {last}"
        )


def _scored(
    done: SampleCompleted,
    top_k: int,
    logprobs: Sequence[float],
    top_ids: Sequence[Sequence[int]],
    top_lps: Sequence[Sequence[float]],
    causation: str | None,
) -> TeacherScored:
    n = len(done.response_ids)
    if len(logprobs) != n:
        raise ValueError(f"teacher returned {len(logprobs)} logprobs for {n} response tokens")
    # K as returned (a small vocabulary can give fewer than asked); ragged rows are dropped.
    widths = {len(r) for r in top_ids} if len(top_ids) == n else set()
    k = widths.pop() if len(widths) == 1 and len(top_lps) == n else 0
    ids = np.asarray(top_ids, dtype=np.int32).reshape(-1) if k else np.zeros(0, np.int32)
    lps = np.asarray(top_lps, dtype=np.float32).reshape(-1) if k else np.zeros(0, np.float32)
    return TeacherScored(
        rollout_id=done.rollout_id,
        sample_id=done.sample_id,
        attempt=done.attempt,
        teacher_logprobs=LogProbs.from_values(np.asarray(logprobs, dtype=np.float32)),
        top_k=k,
        topk_ids=TokenIds.from_values(ids),
        topk_logprobs=LogProbs.from_values(lps),
        action_mask=action_mask_of(done),
        causation=causation,
    )
