"""The events reference (``docs/events.md``), generated from the catalog; a test fails when
the file differs, so it cannot drift.

Fields, types, defaults, versions and descriptions come from the event classes; where each
event goes and who writes and reads it is :data:`ROUTES`, which must name every event.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from engine.events import catalog
from engine.events.base import _UPCASTERS, Event, registered_types

__all__ = ["ROUTES", "Route", "render_markdown", "write_markdown"]


@dataclass(frozen=True, slots=True)
class Route:
    streams: str
    written_by: str
    read_by: str


ROUTES: dict[str, Route] = {
    "RolloutRequested": Route("`rl:control`, then copied to `rl:{rollout:ID}`",
                              "the trainer (`RolloutClient.request`); the scheduler's plan",
                              "the scheduler (group `schedulers`), the finalizer"),
    "TaskFetched": Route("`rl:{rollout:ID}`", "the scheduler (plan)",
                         "evaluator workers, the finalizer, replay"),
    "TaskJoined": Route("`rl:{rollout:ID}`", "the scheduler (plan; a group's samples after "
                        "its first)", "evaluator workers, the finalizer, replay (as the "
                        "`TaskFetched` it stands for)"),
    "BatchSealed": Route("`rl:{rollout:ID}`", "the scheduler (plan)",
                         "the scheduler (admission), `rollout status`"),
    "RolloutPlanned": Route("`rl:{rollout:ID}`", "the scheduler (plan, last)",
                            "the finalizer (how many samples to wait for)"),
    "DataCursorAdvanced": Route("`rl:data`", "the scheduler, before the plan's events",
                                "the scheduler (exact resume of the data source)"),
    "TailCarried": Route("`rl:data`", "the finalizer, with a `RolloutReady` whose tail is "
                         "carried", "the scheduler (the next request of the stream takes it over)"),
    "PoolDeclared": Route("`rl:pool`", "the scheduler at start (the cluster layout)",
                          "the scheduler's pool fold, `rollout pool`, `rollout top`"),
    "TokenAcquired": Route("`rl:pool`", "the scheduler (compare-and-append with the admission)",
                           "the pool fold; evaluator workers on recovery"),
    "BatchAdmitted": Route("`rl:work:{evaluator}`", "the scheduler, atomically with "
                           "`TokenAcquired`", "evaluator workers (group `evaluators`)"),
    "TokenReleased": Route("`rl:pool`", "evaluator workers", "the pool fold"),
    "BatchLeased": Route("`rl:pool`", "an evaluator worker taking over a redelivered batch",
                         "the pool fold (fences releases of older leases)"),
    "AdmissionClosed": Route("`rl:pool`", "the scheduler, after a rollout's last admission",
                             "the pool fold (forgets released batches), a resuming scheduler"),
    "SampleStarted": Route("`rl:{rollout:ID}`", "evaluator workers",
                           "folds (attempt, node, worker), `rollout top`"),
    "TurnCompleted": Route("`rl:{rollout:ID}`", "evaluator workers", "folds, summaries"),
    "SampleCompleted": Route("`rl:{rollout:ID}`", "evaluator workers",
                             "the finalizer, the trainer's `load`, replay"),
    "SampleAborted": Route("`rl:{rollout:ID}`", "evaluator workers (also for every open "
                           "sample of a dead-lettered batch)",
                           "the finalizer (masked dummies), summaries"),
    "CaptureRequested": Route("`rl:capture` and `rl:{rollout:ID}`", "the finalizer",
                              "capture workers (group `capture`)"),
    "PromptStored": Route("`rl:{rollout:ID}`", "evaluator workers",
                          "the rollout fold (fills in the SampleCompleted that refer to it)"),
    "TeacherScored": Route("`rl:{rollout:ID}`", "capture workers", "the finalizer, `load`"),
    "SampleVerified": Route("`rl:{rollout:ID}`", "evaluator workers (before the sample's "
                            "`SampleCompleted`)", "the finalizer (fails past the threshold, "
                            "folds the rest into `RolloutReady.metrics`)"),
    "RolloutReady": Route("`rl:{rollout:ID}`, then a copy on `rl:control`", "the finalizer",
                          "the trainer (`wait_ready`), `rollout status`"),
    "RolloutReused": Route("`rl:{rollout:ID}` (its first entry)", "the trainer (`reuse`)",
                           "replay and operators: where a reused rollout's data came from"),
    "RolloutFailed": Route("`rl:{rollout:ID}` and `rl:control`",
                           "the scheduler, the finalizer, a capture worker, or an evaluator "
                           "worker whose policy servers stayed down past the outage limit",
                           "the trainer (`wait_ready` raises with the reason)"),
    "RolloutStalled": Route("`rl:{rollout:ID}`", "the finalizer following the rollout (no "
                            "new entry for `--stall-window-s`)", "`rollout status`, "
                            "`rollout tail`, operators (no fold decides from it)"),
    "DeadLetter": Route("`rl:dead`", "the log adapter (an entry past `max_deliveries`, or "
                        "one that does not decode)", "operators (`rollout tail`)"),
    "PolicyVersionPublished": Route("`rl:control`", "the trainer (`publish_version`)",
                                    "the weight syncer (group `sync`), `wait_version_active`"),
    "QuiesceRequested": Route("`rl:control`", "the weight syncer",
                              "schedulers (admission pauses), evaluator workers (gate closes)"),
    "WorkerParked": Route("`rl:control`", "evaluator workers (no generate call in flight)",
                          "the weight syncer"),
    "QuiesceCompleted": Route("`rl:control`", "the weight syncer", "operators"),
    "PolicyVersionActivated": Route("`rl:control`", "the weight syncer",
                                    "schedulers and workers (resume), `wait_version_active`"),
    "ServerRegistered": Route("`rl:control`", "`rollout serve`, each time a server answers",
                              "workers and the syncer with `ROLLOUT_SERVERS_FROM_LOG`"),
    "ServerRetired": Route("`rl:control`", "`rollout serve`, stopping its servers",
                           "workers and the syncer with `ROLLOUT_SERVERS_FROM_LOG`"),
    "WeightSyncFailed": Route("`rl:control`", "the weight syncer",
                              "workers keep generation stopped; `wait_ready` and "
                              "`wait_version_active` raise the error"),
    "ServerDown": Route("`rl:control`", "evaluator workers (a call failed or stalled, or a "
                        "probe did)", "schedulers (admission pauses while every policy server "
                        "is down), workers at start, `rollout top`"),
    "ServerUp": Route("`rl:control`", "evaluator workers (a probe found the server healthy "
                      "at the active version)", "schedulers, workers at start, `rollout top`"),
    "ServerStale": Route("`rl:control`", "evaluator workers (the server reports another "
                         "weight version than the active one)", "the weight syncer (re-pushes "
                         "the active weights), schedulers, `rollout top`"),
}

_COMMON = ("type", "producer", "causation")


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: Any) -> str:
    if info.default is not PydanticUndefined:
        value = info.default
        if isinstance(value, enum.Enum):
            value = value.value
        return f"`{value!r}`"
    if info.default_factory is not None:
        made = info.default_factory()
        return f"`{made!r}`" if not isinstance(made, BaseModel) else "empty"
    return "required"


def _doc(cls: type) -> str:
    own = cls.__dict__.get("__doc__")
    return " ".join(own.split()) if own else ""


def _fields_table(cls: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    lines = ["| field | type | default |", "|---|---|---|"]
    for name, info in cls.model_fields.items():
        if name in skip:
            continue
        kind = _type_name(info.annotation).replace("|", "\\|")
        default = _default(info).replace("|", "\\|")
        lines.append(f"| `{name}` | {kind} | {default} |")
    return lines


def render_markdown() -> str:
    """The whole reference, deterministic for a given catalog."""
    events = _engine_events()
    missing = sorted(set(events) - set(ROUTES))
    if missing:
        raise ValueError(f"engine/ops/events_doc.py ROUTES names no route for {missing}")
    out = [
        "# Events reference",
        "",
        "<!-- Generated by `rollout events --markdown --out docs/events.md` from "
        "engine/events/catalog/; do not edit by hand (tests/ops/test_events_doc.py fails "
        "when this file is stale). -->",
        "",
        "Every fact the engine knows is one of these events on a Redis stream "
        "(docs/architecture.md, \"Events and the log\"). Every event also carries "
        "`producer` (who appended it, e.g. `scheduler:ID`) and `causation` (the "
        "`stream@id` of the event that caused it, or none). Stream names are shown with the "
        "default prefix `rl`. Token arrays (`TokenIds`, `LogProbs`, `Mask`) are packed "
        "int32 / float32 / uint8 bytes; enums travel as their string values.",
        "",
        "| event | schema | stream | written by | read by |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(events, key=lambda n: list(ROUTES).index(n)):
        cls = events[name]
        r = ROUTES[name]
        out.append(f"| [{name}](#{name.lower()}) | v{cls.schema_version} | {r.streams} | "
                   f"{r.written_by} | {r.read_by} |")
    nested: dict[str, type[BaseModel]] = {}
    for name in sorted(events, key=lambda n: list(ROUTES).index(n)):
        cls = events[name]
        out += ["", f"## {name}", ""]
        doc = _doc(cls)
        if doc:
            out += [doc, ""]
        versions = sorted(v for (n, v) in _UPCASTERS if n == name)
        version = f"Schema version {cls.schema_version}."
        if versions:
            version += " Older versions read through upcasters: " + ", ".join(
                f"v{v}" for v in versions) + "."
        out += [version, ""]
        out += _fields_table(cls, skip=_COMMON)
        for info in cls.model_fields.values():
            for arg in (info.annotation, *_walk(info.annotation)):
                if isinstance(arg, type) and issubclass(arg, catalog.Record):
                    nested[arg.__name__] = arg
    if nested:
        out += ["", "## Nested records"]
        for rec_name, rec in sorted(nested.items()):
            out += ["", f"### {rec_name}", ""]
            doc = _doc(rec)
            if doc:
                out += [doc, ""]
            out += _fields_table(rec)
    return "\n".join(out) + "\n"


def _engine_events() -> dict[str, type[Event]]:
    """The engine's own events, not those a test registers."""
    return {
        name: cls for name, cls in registered_types().items()
        if cls.__module__.startswith("engine.")
    }


def _walk(annotation: Any) -> list[Any]:
    found: list[Any] = []
    for arg in typing.get_args(annotation):
        found.append(arg)
        found.extend(_walk(arg))
    return found


def write_markdown(path: Path) -> bool:
    """Write the reference to ``path``; returns whether the file changed."""
    text = render_markdown()
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True

