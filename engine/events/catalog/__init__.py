"""The event catalog: one frozen class per event type, a module per stream.

Which stream each event goes to is in docs/events.md (generated from this package). Field
conventions:
``rollout_id`` / ``sample_id`` / ``attempt`` identify work; a sample attempt is
``(sample_id, attempt)`` and folds ignore duplicates and stale attempts. Token-level arrays
are packed (``TokenIds``, ``LogProbs``, ``Mask``). Free-form JSON values (prompts, labels,
metrics) are plain msgpack-able Python values. Outcomes are the enums of
:mod:`engine.outcomes`; on the wire they are their string values, and a value outside the
family does not decode (the entry goes to the dead letters).
"""

from engine.events.catalog.control import (
    FilterSpec,
    PolicyVersionActivated,
    PolicyVersionPublished,
    QuiesceCompleted,
    QuiesceRequested,
    RolloutFailed,
    RolloutReady,
    RolloutRequested,
    RolloutReused,
    WeightSyncFailed,
    WorkerParked,
    planned_prompts,
)
from engine.events.catalog.data import DataCursorAdvanced, DeadLetter, TailCarried
from engine.events.catalog.diagnostics import RolloutStalled
from engine.events.catalog.plan import GROUP_FIELDS as GROUP_FIELDS
from engine.events.catalog.plan import (
    BatchSealed,
    RolloutPlanned,
    TaskFetched,
    TaskJoined,
)
from engine.events.catalog.pool import (
    AdmissionClosed,
    BatchLeased,
    GpuShare,
    NodeDecl,
    PoolDeclared,
    TokenAcquired,
    TokenGrant,
    TokenReleased,
)
from engine.events.catalog.records import JSON as JSON
from engine.events.catalog.records import Record, RolloutKind
from engine.events.catalog.samples import (
    PromptStored,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    SampleVerified,
    TeacherScored,
    TurnCompleted,
)
from engine.events.catalog.servers import (
    ServerDown,
    ServerRegistered,
    ServerRetired,
    ServerRole,
    ServerStale,
    ServerUp,
)
from engine.events.catalog.work import BatchAdmitted, CaptureRequested
from engine.outcomes import AbortClass

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
    "RolloutReused",
    "RolloutStalled",
    "SampleAborted",
    "SampleCompleted",
    "SampleStarted",
    "SampleVerified",
    "ServerDown",
    "ServerRegistered",
    "ServerRetired",
    "ServerRole",
    "ServerStale",
    "ServerUp",
    "TailCarried",
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
