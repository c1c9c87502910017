"""Typed events, their codec and the stream log."""

from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.events.base import Envelope, Event, event_class, registered_types, upcaster
from engine.events.catalog import *  # noqa: F403 - the catalog is the public surface
from engine.events.catalog import __all__ as _catalog_all
from engine.events.codec import decode, encode
from engine.events.log import ClaimResult, DeadEntry, EventLog, RedisSettings, connect
from engine.events.names import StreamNames

__all__ = [
    "ClaimResult",
    "DeadEntry",
    "Envelope",
    "Event",
    "EventLog",
    "LogProbs",
    "Mask",
    "PackedArray",
    "RedisSettings",
    "StreamNames",
    "TokenIds",
    "connect",
    "decode",
    "encode",
    "event_class",
    "registered_types",
    "upcaster",
    *_catalog_all,
]
