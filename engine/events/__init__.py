"""Typed events, their codec, stream ids and the log port.

The log's implementations live in their own modules and are imported from there:
``engine.events.memory_log`` (plain Python) and ``engine.events.redis_log`` (Redis Streams,
the only module tree that loads the redis client). Importing this package loads neither
Redis nor a client, so the pure layers (projections, domain) can import events freely.
Importing it registers every event class, so any reader decodes them."""

from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.events.base import Envelope, Event, event_class, registered_types, upcaster
from engine.events.catalog import *  # noqa: F403 - the catalog is the public surface
from engine.events.catalog import __all__ as _catalog_all
from engine.events.codec import decode, encode
from engine.events.log import ClaimResult, DeadEntry, EventLog
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
    "StreamNames",
    "TokenIds",
    "decode",
    "encode",
    "event_class",
    "registered_types",
    "upcaster",
    *_catalog_all,
]
