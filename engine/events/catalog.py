"""The event catalog: one frozen class per event type.

Which stream each event goes to is in docs/events.md (generated from this module). Field
conventions:
``rollout_id`` / ``sample_id`` / ``attempt`` identify work; a sample attempt is
``(sample_id, attempt)`` and folds ignore duplicates and stale attempts. Token-level arrays
are packed (``TokenIds``, ``LogProbs``, ``Mask``). Free-form JSON values (prompts, labels,
metrics) are plain msgpack-able Python values. Outcomes are the enums of
:mod:`engine.outcomes`; on the wire they are their string values, and a value outside the
family does not decode (the entry goes to the dead letters).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.domain import SamplingParams, StoppingCriteria
from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.events.base import Event, upcaster
from engine.outcomes import AbortClass, SampleStatus, TerminationReason

JSON = Any

__all__ = [
    "AbortClass",
    "AdmissionClosed",
    "BatchAdmitted",
    "BatchLeased",
    "BatchSealed",
    "CaptureRequested",
    "DataCursorAdvanced",
    "DeadLetter",
    "FilterSpec",
    "GpuShare",
    "NodeDecl",
    "PolicyVersionActivated",
    "PolicyVersionPublished",
    "PoolDeclared",
    "PromptStored",
    "QuiesceCompleted",
    "QuiesceRequested",
    "Record",
    "RolloutFailed",
    "RolloutKind",
    "RolloutPlanned",
    "RolloutReady",
    "RolloutRequested",
    "SampleAborted",
    "SampleCompleted",
    "SampleStarted",
    "TailCarried",
    "SampleVerified",
    "TaskFetched",
    "TaskJoined",
    "TeacherScored",
    "TokenAcquired",
    "TokenGrant",
    "TokenReleased",
    "TurnCompleted",
    "WeightSyncFailed",
    "WorkerParked",
    "planned_prompts",
]


class Record(BaseModel):
    """Frozen value object nested inside events."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class RolloutKind(StrEnum):
    TRAIN = "train"
    EVAL = "eval"


# ---------------------------------------------------------------- control stream


class FilterSpec(Record):
    """Survivorship filters the finalizer applies (rejection first, finish-only second)."""

    reject_equal_rewards: bool = False
    finish_only: bool = False


class RolloutRequested(Event):
    """A trainer asks for one iteration's trajectories.

    v2 (issue 12) adds the policy-version and partial-rollout options, all defaulted so a
    v1 request means what it always meant:

    * ``max_staleness``: how many versions behind the trainer's current one (the highest
      ``PolicyVersionPublished.version`` on ``rl:control``, or ``policy_version`` when
      higher) a sampled token may be; None: no bound. A sample with an older token -- or a
      sampled token of unknown version -- is excluded from the ``RolloutReady``.
    * ``overprovision``: plan ``ceil(n_prompts * overprovision)`` prompts and become ready
      once ``n_prompts`` whole groups are terminal.
    * ``tail``: what happens to the other groups then: ``abort`` (their requests are
      aborted on the model server, the samples end as ``tail_aborted``) or ``carry`` (they
      keep running and the next request of the same ``request_stream`` takes them over:
      they count toward its prompts and open its stream as ``TaskFetched`` with
      ``carried_from``; see ``TailCarried``).
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
    overprovision: float = Field(default=1.0, ge=1.0, le=16.0)
    tail: Literal["abort", "carry"] = "abort"
    request_stream: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _carry_needs_a_stream(self) -> RolloutRequested:
        if self.tail == "carry" and self.request_stream is None:
            raise ValueError(
                f"rollout {self.rollout_id!r}: tail='carry' needs a request_stream (the next "
                f"request of that stream takes the carried groups over)"
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
    # v1 had none of the v2 options; their defaults (no bound, no over-provisioning, no
    # carry) are exactly what a v1 request meant.
    return payload


class RolloutReady(Event):
    """Every sample of the rollout is terminal and shaped; the trainer may load it.

    v2 added ``gbs_scale`` (a v1 event upcasts to 1.0: no scaling, what it meant then) and
    the staleness and tail fields (their defaults: no bound, no tail).
    """

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
    # unknown version. Empty for a rollout without kept tokens (and events before it).
    version_tokens: dict[str, int] = Field(default_factory=dict)
    # The CE-only lane's dynamic global-batch-size scaling (engine.projections.lanes): SFT
    # sub-samples per kept trajectory, so a trainer multiplying its batch size by it keeps
    # tasks per optimizer step constant. 1.0 for every other lane (and events before it).
    gbs_scale: float = 1.0
    # Staleness bound (issue 12, request.max_staleness): the trainer's current version the
    # bound was checked against (None: the request set no bound), the samples it excluded
    # (in index order; not in ``sample_ids`` / ``dropped_sample_ids``) and their sampled
    # tokens.
    trainer_version: int | None = None
    stale_sample_ids: list[str] = Field(default_factory=list)
    stale_tokens: int = 0
    # Partial rollouts (request.overprovision): samples of the groups beyond the first
    # ``n_prompts`` whole groups, in index order; aborted or carried per ``request.tail``.
    tail_sample_ids: list[str] = Field(default_factory=list)
    tail_carried: bool = False  # True: the tail keeps running for the next request


@upcaster("RolloutReady", 1)
def _rollout_ready_v1(payload: dict[str, Any]) -> dict[str, Any]:
    payload.pop("gbs_scale", None)  # v1 had no CE lane: the default 1.0 is what it meant
    return payload


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
    so with ``WorkerParked``. ``version`` is the policy version the quiesce is for.

    v1 had no ``version`` (nothing wrote the event then); the upcaster leaves it None."""

    schema_version: ClassVar[int] = 2

    type: Literal["QuiesceRequested"] = "QuiesceRequested"
    reason: str = ""
    version: int | None = None


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
    out and ``unparked`` names the live workers that did not say so in time.

    v1 had only ``reason``; the upcaster adds the empty fields."""

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


# ---------------------------------------------------------------- pool stream


class NodeDecl(Record):
    node: str
    gpus: list[int] = Field(default_factory=list)
    cpu: float = 0.0
    memory_gb: float = 0.0


class GpuShare(Record):
    gpu: int
    fraction: float


class TokenGrant(Record):
    """One placement token: what one running sample may hold on one node."""

    token_id: str
    node: str
    gpus: list[GpuShare] = Field(default_factory=list)
    cpu: float = 0.0
    memory_gb: float = 0.0


class PoolDeclared(Event):
    """The cluster layout; a later declaration replaces the earlier one."""

    type: Literal["PoolDeclared"] = "PoolDeclared"
    nodes: list[NodeDecl]


class TokenAcquired(Event):
    """All-or-nothing placement of a whole batch (appended by compare-and-append)."""

    type: Literal["TokenAcquired"] = "TokenAcquired"
    rollout_id: str
    batch_id: str
    evaluator_id: str
    tokens: list[TokenGrant]


class TokenReleased(Event):
    """Tokens given back; ``token_ids`` None releases every token the batch still holds.

    ``lease`` is the releasing holder's claim on the batch: the delivery count of the work
    entry it ran the batch under (0: written before leases existed). The pool ignores a
    release whose lease is older than the batch's last ``BatchLeased`` (a late write of a
    holder the batch has moved on from)."""

    type: Literal["TokenReleased"] = "TokenReleased"
    rollout_id: str
    batch_id: str
    token_ids: list[str] | None = None
    reason: str = ""
    lease: int = 0


class BatchLeased(Event):
    """A worker took over a batch someone may already have run (a redelivery), under the
    work entry's delivery count ``lease``; appended to ``rl:pool`` before it decides what to
    re-run. From then on releases with an older lease are fenced off."""

    type: Literal["BatchLeased"] = "BatchLeased"
    rollout_id: str
    batch_id: str
    lease: int
    worker: str = ""


class AdmissionClosed(Event):
    """The scheduler admitted every batch of the rollout; appended to ``rl:pool`` after its
    last admission. A scheduler resuming the request admits nothing more, and the pool fold
    forgets the rollout's batches once they are released (its record of admitted batches
    no longer grows with every batch)."""

    type: Literal["AdmissionClosed"] = "AdmissionClosed"
    rollout_id: str


# ---------------------------------------------------------------- work / capture


class BatchAdmitted(Event):
    """A batch has its tokens and may run; sent to ``rl:work:{evaluator_id}``."""

    type: Literal["BatchAdmitted"] = "BatchAdmitted"
    rollout_id: str
    batch_id: str
    evaluator_id: str
    sample_ids: list[str]
    token_ids: list[str] = Field(default_factory=list)
    nodes: dict[str, str] = Field(default_factory=dict)
    # token id -> the GPU ids its grant holds a share of (for the per-turn placement log)
    gpus: dict[str, list[int]] = Field(default_factory=dict)


class CaptureRequested(Event):
    type: Literal["CaptureRequested"] = "CaptureRequested"
    rollout_id: str
    sample_ids: list[str]
    top_k: int = 20


# ---------------------------------------------------------------- rollout stream


class TaskFetched(Event):
    """One sample's task: prompt, label, dataset, task type, group, and the generation
    settings the planner resolved for it.

    ``stopping`` / ``sampling_params`` are final: the planner applied the cascade (request ->
    evaluator profile -> dataset) and nothing downstream applies it again. ``source_line`` is
    the prompt's 1-based line in the dataset file (``None`` only in events upcast from a v1
    that did not record it). The request's knobs are not copied here: they travel once per
    rollout, in the ``RolloutRequested`` copy that opens the rollout stream.

    v1 carried the dataset's whole config (``dataset_cfg``), the request's ``knobs``, the
    settings as untyped dicts and the line as ``metadata["_source_line"]``; the upcaster
    below drops the first two and moves the line into its field (a sample's metadata still
    shows it as ``_source_line``, see ``projections.samples``).
    """

    schema_version: ClassVar[int] = 2

    type: Literal["TaskFetched"] = "TaskFetched"
    rollout_id: str
    sample_id: str
    index: int
    group_index: int
    prompt: JSON
    label: JSON = None
    dataset: str
    task_type: str
    source_line: int | None = None
    metadata: dict[str, JSON] = Field(default_factory=dict)
    stopping: StoppingCriteria = StoppingCriteria()
    sampling_params: SamplingParams = SamplingParams()
    # A sample carried over from an earlier rollout's tail (issue 12, ``tail="carry"``): the
    # rollout it runs in, whose stream holds its lifecycle events; its ``sample_id`` is that
    # rollout's. None: a sample of this rollout.
    carried_from: str | None = None


@upcaster("TaskFetched", 1)
def _task_fetched_v1(payload: dict[str, Any]) -> dict[str, Any]:
    payload.pop("dataset_cfg", None)
    payload.pop("knobs", None)
    metadata = payload.get("metadata")
    if isinstance(metadata, dict):
        line = metadata.get("_source_line")
        # Only a line number moves; anything else stays in the metadata it was written to.
        if isinstance(line, int) and not isinstance(line, bool) and line >= 1:
            payload["metadata"] = {k: v for k, v in metadata.items() if k != "_source_line"}
            payload["source_line"] = line
    return payload


# The fields a group's samples share: a TaskJoined takes them from its group's TaskFetched.
GROUP_FIELDS = (
    "rollout_id", "prompt", "label", "dataset", "task_type", "source_line", "metadata",
    "stopping", "sampling_params", "carried_from",
)


_new = object.__new__
_set = object.__setattr__
_JOINED_SET = frozenset({"sample_id", "index", "group_index", "producer", "causation"})


class TaskJoined(Event):
    """A sample whose task is its group's (issue 16: the prompt stored once per group).

    The n samples of a group share their prompt, label, dataset, task type, source line,
    metadata and resolved settings; the planner writes them once, in the group's first
    ``TaskFetched`` (``same_as``, its sample id, earlier in the same stream), and every other
    sample of the group as this event, which carries only what is the sample's own. Readers
    never see it as a task: the rollout fold and the workers' task readers turn it into the
    ``TaskFetched`` it stands for (:meth:`task`), so every consumer sees a whole task per
    sample, exactly what a plan written before it held. A ``TaskJoined`` whose ``same_as`` the
    stream does not hold is a writer's error, named where it is folded."""

    type: Literal["TaskJoined"] = "TaskJoined"
    rollout_id: str
    sample_id: str
    index: int
    group_index: int
    same_as: str

    def task(self, first: TaskFetched) -> TaskFetched:
        """The ``TaskFetched`` this sample stands for: ``first``'s task with this sample's
        ids (and this event's producer and causation).

        Built the way ``model_copy(update=...)`` builds it (every value is already validated,
        in ``first`` or here), without its generic copy: a fold turns every joined sample of
        a rollout into its task, so this is on the finalizer's and the workers' hot path."""
        values = dict(first.__dict__)
        values["sample_id"] = self.sample_id
        values["index"] = self.index
        values["group_index"] = self.group_index
        values["producer"] = self.producer
        values["causation"] = self.causation
        task = _new(TaskFetched)
        _set(task, "__dict__", values)
        _set(task, "__pydantic_fields_set__", first.__pydantic_fields_set__ | _JOINED_SET)
        _set(task, "__pydantic_extra__", None)
        _set(task, "__pydantic_private__", None)
        return task

    @classmethod
    def of(cls, ev: TaskFetched, first: TaskFetched) -> TaskJoined | None:
        """``ev`` as a ``TaskJoined`` on ``first`` when that loses nothing (it shares every
        group field with ``first``), else None (``ev`` is then written whole)."""
        if ev.group_index != first.group_index or ev.sample_id == first.sample_id:
            return None
        mine, theirs = ev.__dict__, first.__dict__
        for name in GROUP_FIELDS:
            if mine[name] is not theirs[name] and mine[name] != theirs[name]:
                return None
        # The validating constructor, not model_construct: pydantic-core checks these few
        # fields in less time than model_construct takes to fill them in (1.2 vs 3.3 us).
        return cls(
            rollout_id=ev.rollout_id,
            sample_id=ev.sample_id,
            index=ev.index,
            group_index=ev.group_index,
            same_as=first.sample_id,
            producer=ev.producer,
            causation=ev.causation,
        )


class BatchSealed(Event):
    """The batching strategy's output: which samples run together, in what order."""

    type: Literal["BatchSealed"] = "BatchSealed"
    rollout_id: str
    batch_id: str
    seq: int
    evaluator_id: str
    sample_ids: list[str]


class RolloutPlanned(Event):
    """Written after every ``TaskFetched`` and ``BatchSealed`` of the rollout: the plan is
    complete, and the rollout is finished when ``n_samples`` samples are terminal."""

    type: Literal["RolloutPlanned"] = "RolloutPlanned"
    rollout_id: str
    n_samples: int
    n_batches: int
    batch_ids: list[str] = Field(default_factory=list)


class SampleStarted(Event):
    type: Literal["SampleStarted"] = "SampleStarted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    batch_id: str = ""
    worker: str = ""
    node: str = ""


class TurnCompleted(Event):
    type: Literal["TurnCompleted"] = "TurnCompleted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    turn: int
    node: str = ""
    gpu: int | None = None
    prompt_tokens: int = 0
    response_tokens: int = 0
    tool_calls: list[str] = Field(default_factory=list)
    elapsed_s: float = 0.0
    # The policy version the model server reported for this turn (None: it reported none).
    weight_version: int | None = None


class SampleCompleted(Event):
    """A finished episode with its token-level trajectory and reward.

    v2 added the DAgger rollin's ``teacher_mask`` and ``student_cut_points``; a v1 event
    upcasts to "none recorded" (an empty mask, no cut points).

    v3 (issue 16) changes only the wire: the token ids and the masks travel in the compact,
    lossless form of ``engine.events.arrays`` (a 0/1 mask as bits, ids below 65,536 as
    uint16 and below 2**24 as 3 bytes; arrays under 256 bytes raw), which takes a
    1,024-token response from 9 to about 7.1 bytes per token. The fields and their values
    are unchanged; a v2 event's raw arrays upcast to the compact form's raw tag.
    """

    schema_version: ClassVar[int] = 3
    compact_arrays: ClassVar[frozenset[str]] = frozenset(
        {"prompt_ids", "response_ids", "loss_mask", "teacher_mask"}
    )

    type: Literal["SampleCompleted"] = "SampleCompleted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: LogProbs
    loss_mask: Mask
    reward: float = 0.0
    reward_detail: dict[str, JSON] = Field(default_factory=dict)
    status: SampleStatus = SampleStatus.COMPLETED
    termination_reason: TerminationReason | None = None
    response_text: str = ""
    n_turns: int = 0
    elapsed_s: float = 0.0
    policy_version: int = 0
    metrics: dict[str, JSON] = Field(default_factory=dict)
    # Per response token, the server-reported weight version of the turn that sampled it; -1
    # for observation tokens and unknown versions. Empty: not recorded (events before it).
    token_versions: TokenIds = Field(default_factory=TokenIds.empty)
    # DAgger rollin (engine.agents.dagger): 1 on response tokens the teacher produced; empty
    # when the agent recorded none (every token is then the student's or an observation).
    teacher_mask: Mask = Field(default_factory=Mask.empty)
    # The response offsets where each student-executed turn begins (the CE lane's cuts).
    student_cut_points: list[int] = Field(default_factory=list)

    # Prompt stored once (issue 16): non-empty when ``prompt_ids`` is left empty and the
    # prompt tokens are those of the rollout stream's ``PromptStored`` with this key (the n
    # samples of a group share one). Empty: ``prompt_ids`` holds them (events before it).
    prompt_key: str = ""


@upcaster("SampleCompleted", 1)
def _sample_completed_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 recorded no rollin: the defaults (no teacher tokens, no cut points) say exactly that.
    payload.pop("teacher_mask", None)
    payload.pop("student_cut_points", None)
    return payload


@upcaster("SampleCompleted", 2)
def _sample_completed_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v2 held every array raw: the compact form's raw tag (0) says exactly that. Values that
    # are not wire bytes (a hand-written payload's lists) are left to validation.
    for name in SampleCompleted.compact_arrays:
        value = payload.get(name)
        if type(value) is bytes:
            payload[name] = b"\x00" + value
    return payload


class PromptStored(Event):
    """Prompt tokens that several ``SampleCompleted`` of the rollout refer to by
    ``prompt_key`` instead of repeating them (written before the first that refers to it;
    a repeat with the same key is ignored)."""

    type: Literal["PromptStored"] = "PromptStored"
    rollout_id: str
    prompt_key: str
    prompt_ids: TokenIds


class SampleAborted(Event):
    """A classified failure; the sample becomes a masked dummy."""

    type: Literal["SampleAborted"] = "SampleAborted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    abort_class: AbortClass
    error: str = ""
    agent_reason: TerminationReason | None = None  # the agent's own, when it returned one
    phase: str = ""
    elapsed_s: float = 0.0
    window_s: float | None = None
    node: str = ""
    turns: int = 0


class TeacherScored(Event):
    """Teacher force-decode of a kept trajectory (per response token)."""

    type: Literal["TeacherScored"] = "TeacherScored"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    teacher_logprobs: LogProbs
    top_k: int = 0
    topk_ids: TokenIds = Field(default_factory=TokenIds.empty)
    topk_logprobs: LogProbs = Field(default_factory=LogProbs.empty)
    action_mask: Mask = Field(default_factory=Mask.empty)


class SampleVerified(Event):
    """The verification boundary (``engine.actors.verify``): a completed sample's sampled
    tokens re-scored on the server that generated them, at its current weight version.

    Written by the evaluator worker just before the sample's ``SampleCompleted``, for the
    fraction of samples the request selects. ``n_tokens`` sampled tokens were compared and
    ``n_other_version`` were not (a weight update since they were sampled); ``skipped`` says
    why nothing was compared (empty when something was). ``max_abs_delta`` is the largest
    ``|recorded - re-scored|`` logprob, at response index ``position``; ``exceeded`` is
    ``max_abs_delta > threshold``, and fails the rollout."""

    type: Literal["SampleVerified"] = "SampleVerified"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    n_tokens: int = 0
    n_other_version: int = 0
    max_abs_delta: float = 0.0
    position: int | None = None
    weight_version: int | None = None
    threshold: float
    exceeded: bool = False
    skipped: str = ""


# ---------------------------------------------------------------- data / dead


class DataCursorAdvanced(Event):
    """The data source's position after a rollout's fetch, for exact resume. ``carried``:
    the rollouts whose carried tails (``TailCarried``) this rollout took over."""

    type: Literal["DataCursorAdvanced"] = "DataCursorAdvanced"
    rollout_id: str
    kind: RolloutKind = RolloutKind.TRAIN
    cursor: dict[str, JSON]
    previous: dict[str, JSON] = Field(default_factory=dict)
    carried: list[str] = Field(default_factory=list)


class TailCarried(Event):
    """An over-provisioned rollout became ready with ``tail="carry"``: its tail groups keep
    running, and the next request of ``request_stream`` takes them over (appended to
    ``rl:data`` with the ``RolloutReady``). ``tasks``: the tail's ``TaskFetched``, in index
    order."""

    type: Literal["TailCarried"] = "TailCarried"
    rollout_id: str
    request_stream: str
    tasks: list[TaskFetched]


class DeadLetter(Event):
    """An entry no reader could use, kept with its raw bytes and the reason."""

    type: Literal["DeadLetter"] = "DeadLetter"
    source_stream: str
    source_id: str
    raw: bytes = b""
    error: str
    group: str | None = None
    deliveries: int = 0
