"""Typed events, their codec, stream ids and the log (the port and its Redis adapter)."""

from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.events.base import Envelope, Event, event_class, registered_types, upcaster
from engine.events.catalog import *  # noqa: F403 - the catalog is the public surface
from engine.events.catalog import __all__ as _catalog_all
from engine.events.codec import decode, encode
from engine.events.log import ClaimResult, DeadEntry, EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import RedisEventLog, RedisSettings, connect, open_log

__all__ = [
    "ClaimResult",
    "DeadEntry",
    "Envelope",
    "Event",
    "EventLog",
    "LogProbs",
    "Mask",
    "PackedArray",
    "RedisEventLog",
    "RedisSettings",
    "StreamNames",
    "TokenIds",
    "connect",
    "decode",
    "encode",
    "open_log",
    "event_class",
    "registered_types",
    "upcaster",
    *_catalog_all,
]
