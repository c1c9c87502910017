"""Events of ``rl:control``: rollout requests and outcomes, policy versions, weight syncs."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from engine.events.base import Event, upcaster
from engine.events.catalog.records import JSON, Record, RolloutKind


class FilterSpec(Record):
    """Survivorship filters the finalizer applies (rejection first, finish-only second)."""

    reject_equal_rewards: bool = False
    finish_only: bool = False


StalenessPolicy = Literal["drop", "keep", "pace"]
STALENESS_POLICIES: tuple[StalenessPolicy, ...] = ("drop", "keep", "pace")


class RolloutRequested(Event):
    """A trainer asks for one iteration's trajectories.

    * ``max_staleness``: how many versions behind the trainer's current one (the highest
      ``PolicyVersionPublished.version`` on ``rl:control``, or ``policy_version`` when
      higher) a sampled token may be; None: no bound. A sample with an older token -- or a
      sampled token of unknown version -- is stale.
    * ``staleness_policy``: what a bounded rollout does with stale samples. ``drop``: a
      worker ends an attempt once it can no longer meet the bound, and the ``RolloutReady``
      excludes stale samples. ``keep``: stale samples run to the end and the ready rollout
      keeps them, in its group statistics (their rewards count in the group's advantages),
      listed in ``stale_sample_ids`` as well, so the trainer gives them no gradient
      (``engine.collate``). ``pace``: admission is paced so that a sample is admitted only
      where it can meet the bound (``engine.actors.planning.pace_wait``); a sample that goes
      stale all the same (a tail carried on, a trainer publishing more than once per
      rollout) is dropped.
    * ``overprovision``: plan ``ceil(n_prompts * overprovision)`` prompts and become ready
      once ``n_prompts`` whole groups are terminal.
    * ``tail``: what happens to the other groups then: ``abort`` (their requests are
      aborted on the model server, the samples end as ``tail_aborted``) or ``carry`` (they
      keep running and the next request of the same ``request_stream`` takes them over:
      they count toward its prompts and open its stream as ``TaskFetched`` with
      ``carried_from``; see ``TailCarried``).
    * ``pinned_version``: an eval's episodes run only on servers serving that weight version
      (a dedicated eval server, or a policy server still at it) and finish on it; training
      goes on meanwhile, and a request no server serves waits (the outage limit, then it
      fails). Only an eval request may pin a version, and it takes no staleness bound (its
      tokens are all of the pinned version by construction).
    * ``max_version_span``: the most weight versions one trajectory's tokens may come from
      (1: every token of a trajectory from one version); a trajectory that would span more
      (at the start of a turn, or continuing a turn a weight sync interrupted) ends there
      as ``version_span``. None: no cap.
    """

    schema_version: ClassVar[int] = 2

    type: Literal["RolloutRequested"] = "RolloutRequested"
    rollout_id: str
    iteration: int = 0
    kind: RolloutKind = RolloutKind.TRAIN
    n_prompts: int = Field(ge=1)
    n_samples_per_prompt: int | None = Field(default=None, ge=1)
    policy_version: int = 0
    seed: int = 0
    datasets: list[str] | None = None
    algorithm: str = "grpo"
    knobs: dict[str, JSON] = Field(default_factory=dict)
    sampling_params: dict[str, JSON] = Field(default_factory=dict)
    stopping: dict[str, JSON] = Field(default_factory=dict)
    filters: FilterSpec = FilterSpec()
    teacher_capture: bool = False
    max_staleness: int | None = Field(default=None, ge=0)
    staleness_policy: StalenessPolicy = "drop"
    overprovision: float = Field(default=1.0, ge=1.0, le=16.0)
    tail: Literal["abort", "carry"] = "abort"
    request_stream: str | None = Field(default=None, min_length=1)
    pinned_version: int | None = Field(default=None, ge=0)
    max_version_span: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _carry_needs_a_stream(self) -> RolloutRequested:
        if self.tail == "carry" and self.request_stream is None:
            raise ValueError(
                f"rollout {self.rollout_id!r}: tail='carry' needs a request_stream (the next "
                f"request of that stream takes the carried groups over)"
            )
        if self.pinned_version is not None:
            if self.kind is not RolloutKind.EVAL:
                raise ValueError(
                    f"rollout {self.rollout_id!r}: pinned_version={self.pinned_version} is for "
                    f"eval requests only (kind={self.kind.value!r}); a training rollout runs "
                    f"on the active policy version"
                )
            if self.max_staleness is not None:
                raise ValueError(
                    f"rollout {self.rollout_id!r}: pinned_version and max_staleness together: "
                    f"a pinned eval's tokens are all of version {self.pinned_version}, drop "
                    f"max_staleness"
                )
        return self

    @property
    def n_planned_prompts(self) -> int:
        """Prompts (groups) the plan holds: ``ceil(n_prompts * overprovision)``."""
        return planned_prompts(self.n_prompts, self.overprovision)


def planned_prompts(n_prompts: int, overprovision: float) -> int:
    """``ceil(n_prompts * overprovision)``, robust to float noise (1.1 * 10 is 11, not 12)."""
    return max(n_prompts, math.ceil(round(n_prompts * overprovision, 9)))


@upcaster("RolloutRequested", 1)
def _rollout_requested_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 has no staleness bound, over-provisioning or tail: the defaults say exactly that.
    return payload


class RolloutReady(Event):
    """Every sample of the rollout is terminal and shaped; the trainer may load it."""

    schema_version: ClassVar[int] = 2

    type: Literal["RolloutReady"] = "RolloutReady"
    rollout_id: str
    iteration: int = 0
    kind: RolloutKind = RolloutKind.TRAIN
    policy_version: int = 0
    sample_ids: list[str]
    dropped_sample_ids: list[str] = Field(default_factory=list)
    dummy: bool = False
    n_completed: int = 0
    n_aborted: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    # Sampled (loss-masked) tokens of the kept samples per server-reported weight version,
    # keyed by the version as a string (msgpack map keys are strings); "-1" counts tokens of
    # unknown version. Empty for a rollout without kept tokens.
    version_tokens: dict[str, int] = Field(default_factory=dict)
    # The CE-only lane's dynamic global-batch-size scaling (engine.projections.lanes): SFT
    # sub-samples per kept trajectory, so a trainer multiplying its batch size by it keeps
    # tasks per optimizer step constant. 1.0 for every other lane.
    gbs_scale: float = 1.0
    # Staleness bound (``request.max_staleness``): the trainer's current version the
    # bound was checked against (None: the request set no bound), the stale samples (in
    # index order) and their sampled tokens. Under the ``keep`` policy the completed stale
    # samples are in ``sample_ids`` too (loaded, no gradient); otherwise they are in
    # neither ``sample_ids`` nor ``dropped_sample_ids``.
    trainer_version: int | None = None
    stale_sample_ids: list[str] = Field(default_factory=list)
    stale_tokens: int = 0
    # Partial rollouts (request.overprovision): samples of the groups beyond the first
    # ``n_prompts`` whole groups, in index order; aborted or carried per ``request.tail``.
    tail_sample_ids: list[str] = Field(default_factory=list)
    tail_carried: bool = False  # True: the tail keeps running for the next request


@upcaster("RolloutReady", 1)
def _rollout_ready_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 has no CE lane, staleness bound or tail: the defaults (no scaling, no bound, no
    # tail) say exactly that.
    payload.pop("gbs_scale", None)
    return payload


class RolloutReused(Event):
    """Rollout ``rollout_id`` (iteration ``iteration``) is a stored rollout reused instead of
    generated (``engine.runtime.reuse``): the first entry of its stream, followed by the
    source's events. ``source`` is the rollout id or archive path as given, ``source_kind``
    ``rollout`` or ``archive``, ``source_sha256`` the SHA-256 of the source's raw entries (each
    prefixed by its length, 8 bytes little-endian); ``n_skipped`` entries of the source did not
    decode and were left out."""

    type: Literal["RolloutReused"] = "RolloutReused"
    rollout_id: str
    iteration: int = 0
    source: str
    source_kind: Literal["rollout", "archive"]
    source_rollout_id: str
    source_sha256: str
    n_events: int
    n_skipped: int = 0


class RolloutFailed(Event):
    type: Literal["RolloutFailed"] = "RolloutFailed"
    rollout_id: str
    reason: str


class PolicyVersionPublished(Event):
    """A trainer has new weights at ``weights_uri`` (a directory every model server can
    read, in Hugging Face format) for policy version ``version``."""

    type: Literal["PolicyVersionPublished"] = "PolicyVersionPublished"
    version: int
    weights_uri: str = ""


class QuiesceRequested(Event):
    """The weight syncer stops generation before it changes weights: schedulers stop
    admitting batches, workers let running generate calls finish, start no new one and say
    so with ``WorkerParked``. ``version`` is the policy version the quiesce is for (None
    in a v1 event, which has none). ``interrupt``: workers abort their resumable generate
    calls instead of letting them finish, and continue those turns from their partial
    tokens on the new weights (``engine/backends/gate.py``)."""

    schema_version: ClassVar[int] = 2

    type: Literal["QuiesceRequested"] = "QuiesceRequested"
    reason: str = ""
    version: int | None = None
    interrupt: bool = False


@upcaster("QuiesceRequested", 1)
def _quiesce_requested_v1(payload: dict[str, Any]) -> dict[str, Any]:
    payload.setdefault("version", None)
    return payload


class WorkerParked(Event):
    """An evaluator worker has no generate call in flight and starts none until the
    quiesce for ``version`` ends: its trajectories wait at a turn boundary."""

    type: Literal["WorkerParked"] = "WorkerParked"
    version: int | None = None
    worker: str


class QuiesceCompleted(Event):
    """Every live worker said it is parked (``parked``), or the syncer's bounded wait ran
    out and ``unparked`` names the live workers that did not say so in time (a v1 event
    has only ``reason``: no version, nobody named)."""

    schema_version: ClassVar[int] = 2

    type: Literal["QuiesceCompleted"] = "QuiesceCompleted"
    reason: str = ""
    version: int | None = None
    parked: list[str] = Field(default_factory=list)
    unparked: list[str] = Field(default_factory=list)


@upcaster("QuiesceCompleted", 1)
def _quiesce_completed_v1(payload: dict[str, Any]) -> dict[str, Any]:
    payload.setdefault("version", None)
    payload.setdefault("parked", [])
    payload.setdefault("unparked", [])
    return payload


class PolicyVersionActivated(Event):
    """Every model server in ``servers`` loaded ``version`` and reports it; generation
    resumes on it."""

    type: Literal["PolicyVersionActivated"] = "PolicyVersionActivated"
    version: int
    servers: list[str]
    weights_uri: str = ""


class WeightSyncFailed(Event):
    """A sync of ``version`` failed on ``servers_failed`` (``error`` says how, per server).
    The engine is poisoned: nothing generates until a later sync succeeds."""

    type: Literal["WeightSyncFailed"] = "WeightSyncFailed"
    version: int
    error: str
    servers_ok: list[str] = Field(default_factory=list)
    servers_failed: list[str] = Field(default_factory=list)
