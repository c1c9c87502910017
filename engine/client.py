"""The trainer's client: request a rollout, wait for it, load and collate its samples.

Contract
--------
* ``request(...)`` appends one ``RolloutRequested`` to ``rl:control`` and returns the rollout
  id (given, or ``it<iteration>-<random hex>``). Per-iteration knobs (DAgger beta, t_max)
  travel in ``knobs``; nothing is read from the environment.
* ``wait_ready(rollout_id)`` returns the rollout's ``RolloutReady`` (or raises
  ``engine.errors.RolloutFailed`` with the reason); it reads ``rl:control`` from the request's
  position with blocking reads, so a rollout that became ready before the call is found too.
  A Redis outage does not end the wait: reads are retried with the runtime's capped backoff
  until Redis answers again (or the ``timeout`` passes).
* Reading never writes: an entry that does not decode is skipped by the client (its
  stream's owner dead-letters it).
  ``subscribe_ready()`` yields every ``RolloutReady`` appended after it starts.
* ``load(rollout_id)`` rebuilds the samples from the rollout stream
  (:func:`engine.projections.samples.trainer_samples`): the ids ``RolloutReady`` keeps, in
  its order; aborted samples as masked dummies; one masked dummy when filters emptied it.
* ``iter_load(rollout_id, chunk_size)`` yields the same samples in the same order, in lists
  of ``chunk_size``: each sample's folded events are let go of once its ``Sample`` is
  built, so a trainer that consumes chunk by chunk holds the folded events and one chunk of
  samples, never every ``Sample`` of a large rollout at once.
* ``collate(samples)`` right-pads into tensors: ``tokens``, ``attention_mask``, ``loss_mask``
  (over the full sequence, prompt positions 0), ``rollout_log_probs`` (same layout, 0 on the
  prompt), ``teacher_log_probs`` (only when every sample has them), ``rewards`` (the scalar
  reward), ``response_lengths``, ``prompt_lengths``, ``remove_sample`` and ``token_versions``
  (int64, same layout: the server-reported weight version of each sampled token, -1 on the
  prompt, on padding, on observation tokens and where no version is known).
* ``SyncRolloutClient`` offers the same calls for synchronous trainer loops; it runs the
  async client on a private event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch

from engine.agents.result import UNKNOWN_VERSION
from engine.errors import LogUnavailable, RolloutFailed
from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.events.catalog import (
    FilterSpec,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
)
from engine.events.catalog import (
    RolloutFailed as RolloutFailedEvent,
)
from engine.events.ids import EMPTY_ID, id_before
from engine.events.log import EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import RedisSettings, open_log
from engine.projections.rollout import RolloutProjection
from engine.projections.samples import scalar_reward, trainer_sample_chunks, trainer_samples
from engine.runtime.consumer import Backoff
from engine.runtime.rebuild import rebuild
from engine.sample import Sample

__all__ = ["TEACHER_ALGORITHMS", "RolloutClient", "SyncRolloutClient", "collate"]

logger = logging.getLogger(__name__)

TEACHER_ALGORITHMS = frozenset({"opd", "k3", "distill", "mixed_ce_k3", "dagger_k3"})
"""Algorithms whose loss needs teacher logprobs (the per-token lanes of rollout-engine §5)."""


class RolloutClient:
    """Async client; see the module docstring."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.names = log.names
        self._requested_at: dict[str, str] = {}

    @classmethod
    def connect(
        cls, url: str, *, prefix: str = "rl", block_ms: int = 2000, producer: str = "trainer"
    ) -> RolloutClient:
        settings = RedisSettings(url=url, block_ms=block_ms)
        return cls(open_log(settings, names=StreamNames(prefix), producer=producer))

    async def aclose(self) -> None:
        await self.log.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def request(
        self,
        *,
        iteration: int,
        n_prompts: int,
        n_samples_per_prompt: int | None = None,
        policy_version: int = 0,
        knobs: Mapping[str, Any] | None = None,
        kind: RolloutKind | str = RolloutKind.TRAIN,
        filters: FilterSpec | None = None,
        seed: int = 0,
        datasets: Sequence[str] | None = None,
        algorithm: str = "grpo",
        teacher_capture: bool | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        stopping: Mapping[str, Any] | None = None,
        rollout_id: str | None = None,
    ) -> str:
        """Ask for a rollout; returns its id. ``teacher_capture=None`` follows the algorithm."""
        rid = rollout_id or f"it{iteration}-{secrets.token_hex(4)}"
        event = RolloutRequested(
            rollout_id=rid,
            iteration=iteration,
            kind=RolloutKind(kind),
            n_prompts=n_prompts,
            n_samples_per_prompt=n_samples_per_prompt,
            policy_version=policy_version,
            seed=seed,
            datasets=list(datasets) if datasets is not None else None,
            algorithm=algorithm,
            knobs=dict(knobs or {}),
            sampling_params=dict(sampling_params or {}),
            stopping=dict(stopping or {}),
            filters=filters or FilterSpec(),
            teacher_capture=(
                algorithm in TEACHER_ALGORITHMS if teacher_capture is None else teacher_capture
            ),
        )
        self.names.rollout(rid)  # refuses an id that cannot be a stream key
        entry = await self.log.append(self.names.control, event)
        self._requested_at[rid] = entry
        return rid

    async def wait_ready(self, rollout_id: str, timeout: float | None = None) -> RolloutReady:
        """The rollout's ``RolloutReady``; ``RolloutFailed`` raises; ``TimeoutError`` after
        ``timeout`` seconds."""
        start = self._requested_at.get(rollout_id)
        position = id_before(start) if start is not None else EMPTY_ID
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff(first_s=0.5, max_s=5.0)
        while True:
            block = self.log.block_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rollout {rollout_id} not ready after {timeout} s")
                block = max(1, min(block, int(left * 1000)))
            try:
                envs, position = await self.log.read_after(
                    self.names.control, position, block_ms=block
                )
            except LogUnavailable as exc:  # an outage: wait through it
                pause = backoff.next_pause(exc)
                if deadline is not None:
                    pause = max(0.0, min(pause, deadline - time.monotonic()))
                logger.warning(
                    "waiting for rollout %s: Redis unavailable, retrying in %.1f s: %s",
                    rollout_id, pause, exc,
                )
                await asyncio.sleep(pause)
                continue
            backoff.reset()
            for env in envs:
                ev = env.event
                if isinstance(ev, RolloutReady) and ev.rollout_id == rollout_id:
                    return ev
                if isinstance(ev, RolloutFailedEvent) and ev.rollout_id == rollout_id:
                    raise RolloutFailed(rollout_id, ev.reason)

    async def subscribe_ready(self, *, after: str = "$") -> AsyncIterator[RolloutReady]:
        """Every ``RolloutReady`` appended after ``after`` (default: from now on), forever;
        a ``RolloutFailed`` raises."""
        async for env in self.log.subscribe(self.names.control, after=after):
            ev = env.event
            if isinstance(ev, RolloutReady):
                yield ev
            elif isinstance(ev, RolloutFailedEvent):
                raise RolloutFailed(ev.rollout_id, ev.reason)

    async def load(self, rollout_id: str) -> list[Sample]:
        """The rollout's samples, rebuilt from its stream (see the module docstring)."""
        folded = await rebuild(self.log, self.names.rollout(rollout_id), RolloutProjection())
        return trainer_samples(folded.state)

    async def iter_load(
        self, rollout_id: str, chunk_size: int = 1024
    ) -> AsyncGenerator[list[Sample], None]:
        """``load``'s samples, ``chunk_size`` at a time (see the module docstring)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        folded = await rebuild(self.log, self.names.rollout(rollout_id), RolloutProjection())
        for chunk in trainer_sample_chunks(folded.state, chunk_size):
            yield chunk


def collate(samples: Sequence[Sample], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch of tensors (see the module docstring).

    Each field is built as one numpy array and handed to torch once: the samples' packed
    arrays are joined (bytes, no per-token Python objects) and scattered into the padded
    batch with one boolean-mask assignment in row-major order, which is exactly "row i,
    positions 0..n_i" for the tokens and "row i, its response positions" for the rest.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    batch = len(samples)
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=batch)
    responses = np.fromiter((s.response_length for s in samples), dtype=np.int64, count=batch)
    width = int(lengths.max())
    position = np.arange(width, dtype=np.int64)
    valid = position < lengths[:, None]
    response = valid & (position >= (lengths - responses)[:, None])

    tokens = np.full((batch, width), pad_token_id, dtype=np.int64)
    tokens[valid] = _joined(TokenIds, [s.tokens for s in samples])
    loss_mask = np.zeros((batch, width), dtype=np.float32)
    loss_mask[response] = _joined(Mask, [s.loss_mask for s in samples])
    logprobs = np.zeros((batch, width), dtype=np.float32)
    logprobs[response] = _joined(
        LogProbs, [_or_zeros(s.rollout_log_probs, s.response_length) for s in samples]
    )
    out = {
        "tokens": torch.from_numpy(tokens),
        "attention_mask": torch.from_numpy(valid.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask),
        "rollout_log_probs": torch.from_numpy(logprobs),
        "rewards": torch.from_numpy(
            np.array([scalar_reward(s.reward) for s in samples], dtype=np.float32)
        ),
        "response_lengths": torch.from_numpy(responses),
        "prompt_lengths": torch.from_numpy(lengths - responses),
        "remove_sample": torch.from_numpy(
            np.fromiter((s.remove_sample for s in samples), dtype=np.bool_, count=batch)
        ),
    }
    versions = np.full((batch, width), UNKNOWN_VERSION, dtype=np.int64)
    versions[response] = _joined(
        TokenIds, [_or_unknown(s.token_versions, s.response_length) for s in samples]
    )
    out["token_versions"] = torch.from_numpy(versions)
    teachers = [s.teacher_log_probs for s in samples]
    if all(t is not None for t in teachers):
        teacher = np.zeros((batch, width), dtype=np.float32)
        teacher[response] = _joined(LogProbs, [t for t in teachers if t is not None])
        out["teacher_log_probs"] = torch.from_numpy(teacher)
    return out


def _joined(kind: type[PackedArray], arrays: Sequence[PackedArray]) -> np.ndarray[Any, Any]:
    """The arrays' values end to end, as one read-only numpy array of ``kind``'s dtype."""
    return np.frombuffer(b"".join(a.data for a in arrays), dtype=kind.dtype)


def _or_zeros(array: LogProbs | None, n: int) -> PackedArray:
    return array if array is not None else LogProbs(bytes(LogProbs.dtype.itemsize * n))


_UNKNOWN_INT32 = np.array([UNKNOWN_VERSION], dtype=TokenIds.dtype).tobytes()


def _or_unknown(array: TokenIds | None, n: int) -> PackedArray:
    return array if array is not None else TokenIds(_UNKNOWN_INT32 * n)


class SyncRolloutClient:
    """The same calls for synchronous code, on a private event loop (not thread-safe)."""

    def __init__(
        self, url: str, *, prefix: str = "rl", block_ms: int = 2000, producer: str = "trainer"
    ) -> None:
        self._runner = asyncio.Runner()
        self._client = self._runner.run(
            _make(url, prefix=prefix, block_ms=block_ms, producer=producer)
        )

    def request(self, **kwargs: Any) -> str:
        """See :meth:`RolloutClient.request`."""
        return self._runner.run(self._client.request(**kwargs))

    def wait_ready(self, rollout_id: str, timeout: float | None = None) -> RolloutReady:
        return self._runner.run(self._client.wait_ready(rollout_id, timeout))

    def load(self, rollout_id: str) -> list[Sample]:
        return self._runner.run(self._client.load(rollout_id))

    def iter_load(self, rollout_id: str, chunk_size: int = 1024) -> Iterator[list[Sample]]:
        """See :meth:`RolloutClient.iter_load`."""
        chunks = self._client.iter_load(rollout_id, chunk_size)
        try:
            while True:
                try:
                    yield self._runner.run(anext(chunks))
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(chunks.aclose())

    def close(self) -> None:
        self._runner.run(self._client.aclose())
        self._runner.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _make(url: str, *, prefix: str, block_ms: int, producer: str) -> RolloutClient:
    return RolloutClient.connect(url, prefix=prefix, block_ms=block_ms, producer=producer)
