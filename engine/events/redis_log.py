"""The event log on Redis Streams (redis-py asyncio): the implementation of the
:class:`engine.events.log.EventLog` port.

Storage: each stream entry has one field ``e`` holding the msgpack event (``codec.py``);
the Redis stream id is the event's position and identity. ``append_if_last`` is one Lua
script (read the last id, compare, XADD the events and the follow-ups), as are
``keep_alive`` and ``hand_back`` (check the owner, then XCLAIM). Snapshots are plain keys
named by ``StreamNames.snapshot``.

Every redis exception is translated to :class:`LogUnavailable` / :class:`LogError` here
and nowhere else: callers catch the engine's names.

Dead letters are written once per entry, by its stream's owner: a consumer-group read (the
group's actor owns the stream) or a read that says ``dead_letter=True`` (the actor that owns
a stream without a group: the scheduler for ``rl:pool`` and ``rl:data``, the finalizer for
a rollout stream). Every other read (the client, the operator tools, another actor's fold)
skips an entry that does not decode and writes nothing. The letter is appended by one
script that first adds ``stream@id`` to the ``dead_seen`` set, so an owner that reads the
entry again (after a restart, or a claim after a crash before the ack) adds no copy.

Redis Cluster: a ``redis+cluster://`` (or ``rediss+cluster://``) URL, or
``RedisSettings(cluster=True)``, connects through ``redis.asyncio.cluster.RedisCluster``
with the URL's host as the seed node. Every script touches keys of one slot only: the
control-plane keys share one hash tag (``engine.events.names``), and ``append_if_last``
refuses keys of different slots on any Redis (so a single-node test catches a step that a
cluster would refuse). A blocking read of streams on several slots (``rollout tail``)
reads each slot's streams concurrently and merges the replies.

redis-py pitfall: a blocking read longer than ``socket_timeout`` times out at
the socket and is retried by the client forever. :func:`connect` therefore derives the
socket timeout from the longest block time and disables blind retries, so a non-idempotent
XADD is never silently sent twice.

A pooled connection left over from before a Redis restart is dead. Without a check the next
command sent on it fails (once per connection), and a consumer would count that transport
error against the work it was doing. :func:`connect` therefore pings a connection that has
been idle for ``health_check_s`` before using it and, when the ping fails, reconnects once
and pings again: only the PING is retried, never the command, so nothing is sent twice.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from engine.errors import AppendConflict, ConfigError, DecodeError, LogError, LogUnavailable
from engine.events.base import Envelope, Event
from engine.events.catalog import DeadLetter
from engine.events.codec import decode, encode
from engine.events.ids import EMPTY_ID, exclusive, format_id, id_after, parse_id
from engine.events.log import ClaimResult, DeadEntry, RawEntry, RawStreamEntry
from engine.events.names import StreamNames

__all__ = ["FIELD", "RedisClient", "RedisEventLog", "RedisSettings", "connect", "open_log"]

RedisClient = aioredis.Redis | RedisCluster
"""What :func:`connect` builds: a client of one Redis, or of a Redis Cluster."""

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

FIELD = b"e"

logger = logging.getLogger(__name__)

# KEYS[1] guarded stream, KEYS[2..] streams of the follow-up appends; ARGV[1] expected last
# id, ARGV[2] n guarded events, ARGV[3..] encoded guarded events then follow-up events (one
# per extra key, in order).
_CAS_SCRIPT = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local cur = '0-0'
if #last > 0 then cur = last[1][1] end
if cur ~= ARGV[1] then return {0, cur} end
local n = tonumber(ARGV[2])
local out = {1}
for i = 1, n do
  out[#out + 1] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[2 + i])
end
for k = 2, #KEYS do
  out[#out + 1] = redis.call('XADD', KEYS[k], '*', 'e', ARGV[1 + n + k])
end
return out
"""


# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Refreshes (XCLAIM
# JUSTID, which does not count a delivery) only the entries the consumer still owns.
_KEEP_ALIVE_SCRIPT = """
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] idle ms, ARGV[4..] entry ids.
# For each entry the consumer still owns: mark it idle for ARGV[3] ms (claimable at once)
# and take back the delivery its hand-back would otherwise count (RETRYCOUNT n - 1).
_HAND_BACK_SCRIPT = """
local lost = {}
for i = 4, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    local times = tonumber(p[1][4])
    if times > 0 then times = times - 1 end
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i],
               'IDLE', ARGV[3], 'RETRYCOUNT', times, 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# KEYS[1] stream; ARGV[1..] encoded events. Appends them in order (one entry each) and
# returns their ids: one command for a run of events to one stream, instead of one XADD per
# event (a pipelined XADD costs the client ~8 us to pack and parse, this ~0.5 us an event).
_APPEND_SCRIPT = """
local out = {}
for i = 1, #ARGV do
  out[i] = redis.call('XADD', KEYS[1], '*', 'e', ARGV[i])
end
return out
"""

# KEYS[1] the dead-letter stream, KEYS[2] the set of entries already dead-lettered; ARGV in
# pairs: "stream@id", the encoded DeadLetter. Appends only letters for entries not yet in
# the set; returns how many it appended.
_DEAD_LETTER_SCRIPT = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'e', ARGV[i + 1])
    n = n + 1
  end
end
return n
"""

# KEYS[1] stream, KEYS[2] marker; ARGV[1] marker ttl (s), ARGV[2] the encoded event.
_ONCE_SCRIPT = """
if redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return redis.call('XADD', KEYS[1], '*', 'e', ARGV[2])
end
return false
"""

# How idle a handed-back entry is made: past any claim window.
HAND_BACK_IDLE_MS = 10**10


@dataclass(frozen=True, slots=True)
class RedisSettings:
    """Connection settings; ``socket_timeout`` always exceeds the longest blocking read.

    Credentials: ``username``/``password`` when set, else those of the URL
    (``redis://user:password@host:port/db``). TLS: a ``rediss://`` URL; ``tls_ca_file`` is the
    CA that signed the server's certificate (unset: the system's), ``tls_cert_file`` +
    ``tls_key_file`` a client certificate for servers that ask for one. The server's
    certificate is always verified; the TLS knobs on a ``redis://`` URL are refused.

    Cluster: ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS) or
    ``cluster=True`` with a plain URL; the host is any node of the cluster (the others are
    discovered). A cluster has no numbered databases: a URL naming one other than 0 is
    refused.
    """

    url: str = "redis://127.0.0.1:6379/0"
    block_ms: int = 2000
    connect_timeout_s: float = 5.0
    socket_margin_s: float = 5.0
    max_connections: int = 64
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    cluster: bool = False

    def __post_init__(self) -> None:
        tls_knobs = [
            name
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
            if getattr(self, name) is not None
        ]
        if tls_knobs and not self.tls:
            raise ConfigError(
                f"RedisSettings: {', '.join(tls_knobs)} set but the URL is not rediss:// "
                f"(got {_redact(self.url)!r})"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("RedisSettings: tls_cert_file and tls_key_file go together")
        if self.is_cluster:
            scheme = self.url.partition("://")[0]
            if scheme not in ("redis", "rediss", *_CLUSTER_SCHEMES):
                raise ConfigError(
                    f"RedisSettings: a cluster URL must be redis+cluster://host:port or "
                    f"rediss+cluster://host:port (got {_redact(self.url)!r})"
                )
            db = self.url.partition("://")[2].partition("/")[2].partition("?")[0]
            if db not in ("", "0"):
                raise ConfigError(
                    f"RedisSettings: a Redis Cluster has only database 0, the URL names "
                    f"database {db!r} ({_redact(self.url)!r})"
                )
    health_check_s: float = 0.5

    @property
    def socket_timeout_s(self) -> float:
        return self.block_ms / 1000.0 + self.socket_margin_s

    @property
    def is_cluster(self) -> bool:
        """Whether the URL or ``cluster`` asks for a Redis Cluster."""
        return self.cluster or self.url.partition("://")[0] in _CLUSTER_SCHEMES

    @property
    def tls(self) -> bool:
        return self.url.partition("://")[0] in ("rediss", "rediss+cluster")

    @property
    def client_url(self) -> str:
        """The URL as redis-py takes it (the ``+cluster`` of the scheme left out)."""
        scheme, sep, rest = self.url.partition("://")
        return f"{_CLUSTER_SCHEMES.get(scheme, scheme)}{sep}{rest}"


def _redact(url: str) -> str:
    """The URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}://{user}:***@{host}"


def connect(settings: RedisSettings) -> RedisClient:
    """A client whose socket timeout outlives every BLOCK, that never retries a command
    blindly, and that replaces a dead pooled connection before using it (module doc).

    On a cluster, redirections (MOVED, ASK) are followed, which is safe (the node that
    answers with one did not run the command); a connection error is not retried: it
    surfaces as ``LogUnavailable`` and the caller's backoff rides it out, as on one Redis.
    The reconnect-on-failed-ping of a single Redis's pool is not installed on a cluster's
    node pools: there a dead pooled connection costs one ``LogUnavailable`` (retried).
    """
    auth: dict[str, Any] = {}
    if settings.username is not None:
        auth["username"] = settings.username
    if settings.password is not None:
        auth["password"] = settings.password
    if settings.tls:
        auth.update(ssl_cert_reqs="required", ssl_check_hostname=False)
        if settings.tls_ca_file is not None:
            auth["ssl_ca_certs"] = settings.tls_ca_file
        if settings.tls_cert_file is not None:
            auth.update(ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file)
    if settings.is_cluster:
        return RedisCluster.from_url(
            settings.client_url,
            socket_timeout=settings.socket_timeout_s,
            socket_connect_timeout=settings.connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
            max_connections=settings.max_connections,
            health_check_interval=settings.health_check_s,
            **auth,
        )
    client = aioredis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        decode_responses=False,
        max_connections=settings.max_connections,
        health_check_interval=settings.health_check_s,
        **auth,
    )
    pool = client.connection_pool
    pool.connection_class = _reconnecting(pool.connection_class)
    return client


_RECONNECTING: dict[type[Any], type[Any]] = {}


def _reconnecting(base: type[Any]) -> type[Any]:
    """``base`` (plain or TLS, whichever the URL chose) whose health check reconnects once
    when its PING fails: a PING is idempotent, the command after it is sent only once."""
    cls = _RECONNECTING.get(base)
    if cls is None:

        async def check_health(self: Any) -> None:
            if not self.health_check_interval:
                return
            if asyncio.get_running_loop().time() <= self.next_health_check:
                return
            try:
                await self._send_ping()
            except (rexc.ConnectionError, rexc.TimeoutError, OSError):
                await self.disconnect()
                await self.connect()
                await self._send_ping()

        cls = _RECONNECTING[base] = type(
            f"Reconnecting{base.__name__}", (base,), {"check_health": check_health}
        )
    return cls


@contextmanager
def _translate(what: str) -> Iterator[None]:
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
        raise LogUnavailable(f"redis unavailable during {what}: {exc}") from exc
    except (rexc.ClusterError, rexc.SlotNotCoveredError) as exc:  # a node or slot is down
        raise LogUnavailable(f"redis cluster unavailable during {what}: {exc}") from exc
    except rexc.RedisClusterException as exc:  # e.g. keys of several slots in one command
        raise LogError(f"redis cluster refused {what}: {exc}") from exc
    except rexc.ResponseError as exc:
        raise LogError(f"redis refused {what}: {exc}") from exc
    except rexc.InvalidResponse as exc:  # e.g. the URL points at an HTTP server
        raise LogError(
            f"{what}: the server does not speak the Redis protocol ({exc}); does the Redis "
            f"URL (--redis-url / ROLLOUT_REDIS_URL) point at a Redis server?"
        ) from exc
    _reraise_swallowed_cancel()


def _missing(exc: LogError) -> bool:
    """A refusal because the stream or the group does not exist (yet)."""
    text = str(exc).lower()
    return "nogroup" in text or "no such key" in text


def _reraise_swallowed_cancel() -> None:
    """Raise ``CancelledError`` if this task was cancelled but a redis call swallowed it.

    redis-py sends every command under ``asyncio.wait_for`` (the socket timeout), and on
    Python 3.11 ``wait_for`` returns normally when the cancellation lands just as the
    send completes (fixed in 3.12). The task then runs on with the cancellation request
    still counted (``Task.cancelling()``): a finalizer following a rollout went on
    reading forever after its stop, and a trainer's ``wait_for(wait_ready(...))`` would
    outlive its timeout. Every log call ends here, so a swallowed cancellation takes
    effect as soon as the call it hit returns.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while events are read and decoded.

    Reading allocates a dozen acyclic objects per event (freed by reference counting) and
    the reader usually keeps them, so the collections those allocations trigger only
    re-traverse the growing result. Decoding 10,000 SampleCompleted events: 16.8 us/event
    with the collector, 9.2 without. Nested pauses are no-ops; the collector runs again
    when the outermost one ends.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _one_slot(what: str, keys: Sequence[str]) -> None:
    """Refuse a script over keys of several cluster slots (on any Redis, see module doc)."""
    slots = {key: key_slot(key.encode()) for key in keys}
    if len(set(slots.values())) > 1:
        listed = ", ".join(f"{key} (slot {slot})" for key, slot in slots.items())
        raise LogError(
            f"{what}: one atomic step may only touch keys of one cluster slot, got {listed}; "
            f"give the keys one hash tag (engine.events.names) or split the step"
        )


def _rows_of(reply: Any) -> list[tuple[Any, Any]]:
    """``(stream, rows)`` pairs of an XREAD reply, RESP2 or RESP3 shaped."""
    if isinstance(reply, dict):  # RESP3 shape
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in reply.items()]
    return list(reply or [])


class RedisEventLog:
    """The :class:`~engine.events.log.EventLog` port on Redis Streams.

    ``redis`` is the client it talks through and closes in :meth:`aclose`; it is public
    only so tests of this adapter can look at what Redis holds (pending owners, groups).
    """

    def __init__(
        self,
        redis: RedisClient,
        *,
        names: StreamNames | None = None,
        producer: str = "",
        max_deliveries: int = 5,
        block_ms: int = 2000,
    ) -> None:
        self.redis = redis
        # redis-py's stubs for stream replies are inexact (unions of bytes/str/None per
        # field); replies are checked where they are decoded, so calls go through Any.
        self._r: Any = redis
        self.names = names or StreamNames()
        self.producer = producer
        self.max_deliveries = max_deliveries
        self.block_ms = block_ms
        self.dead_lettered = 0
        self.cluster = isinstance(redis, RedisCluster)
        self._cas = self._r.register_script(_CAS_SCRIPT)
        self._keep_alive = self._r.register_script(_KEEP_ALIVE_SCRIPT)
        self._hand_back = self._r.register_script(_HAND_BACK_SCRIPT)
        self._dead_script = self._r.register_script(_DEAD_LETTER_SCRIPT)
        self._once = self._r.register_script(_ONCE_SCRIPT)
        self._skipped: set[tuple[str, str]] = set()  # undecodable entries already logged

    # ------------------------------------------------------------------ writing

    def _encode(self, event: Event, causation: Envelope | str | None) -> bytes:
        producer = self.producer if self.producer and not event.producer else None
        ref = causation.ref if isinstance(causation, Envelope) else causation
        return encode(event, producer=producer, causation=ref)

    async def append(
        self, stream: str, event: Event, *, causation: Envelope | str | None = None
    ) -> str:
        data = self._encode(event, causation)
        with _translate(f"XADD {stream}"):
            entry_id = await self._r.xadd(stream, {FIELD: data})
        return _s(entry_id)

    async def append_many(
        self,
        items: Sequence[tuple[str, Event]],
        *,
        causation: Envelope | str | None = None,
    ) -> list[str]:
        """Append many events (to one or several streams) in one round trip, in order."""
        if not items:
            return []
        ref = causation.ref if isinstance(causation, Envelope) else causation
        producer = self.producer or None
        # Consecutive events to one stream form a run; a run goes as one script call (one
        # key: atomic per stream, cluster-safe), a single event as a plain XADD. The runs
        # travel in one pipeline, in order. An event that fails to encode raises here,
        # before anything is sent.
        runs: list[tuple[str, list[bytes]]] = []
        for stream, ev in items:
            data = encode(ev, producer=None if ev.producer else producer, causation=ref)
            if runs and runs[-1][0] == stream:
                runs[-1][1].append(data)
            else:
                runs.append((stream, [data]))
        with _translate(f"pipelined XADD of {len(items)} events"):
            async with self._r.pipeline(transaction=False) as pipe:
                for stream, datas in runs:
                    if len(datas) == 1:
                        # straight through execute_command: redis-py's xadd() helper
                        # rebuilds its argument list per call
                        pipe.execute_command("XADD", stream, "*", FIELD, datas[0])
                    else:  # EVAL, not EVALSHA: nothing to load first or after a restart
                        pipe.execute_command("EVAL", _APPEND_SCRIPT, 1, stream, *datas)
                replies = await pipe.execute()
        out: list[str] = []
        for (_stream, datas), reply in zip(runs, replies, strict=True):
            if len(datas) == 1:
                out.append(_s(reply))
            else:
                out.extend(_s(i) for i in reply)
        return out

    async def append_if_last(
        self,
        stream: str,
        events: Event | Sequence[Event],
        expected_last: str,
        *,
        also: Sequence[tuple[str, Event]] = (),
        causation: Envelope | str | None = None,
    ) -> list[str]:
        """Append atomically iff the stream's last id is ``expected_last`` (``0-0``: empty).

        ``also`` lists follow-up appends to other streams made in the same atomic step
        (e.g. ``TokenAcquired`` on the pool and ``BatchAdmitted`` on a work stream), so a
        crash can never leave one without the other. Returns the ids of the guarded events
        followed by those of ``also``. All keys must hash to one cluster slot (share a
        hash tag), on any Redis: ``LogError`` names them otherwise.
        """
        batch = [events] if isinstance(events, Event) else list(events)
        if not batch:
            raise ValueError("append_if_last needs at least one event")
        args: list[bytes | str | int] = [expected_last, len(batch)]
        args.extend(self._encode(ev, causation) for ev in batch)
        args.extend(self._encode(ev, causation) for _, ev in also)
        keys = [stream, *(s for s, _ in also)]
        _one_slot(f"compare-and-append on {stream}", keys)
        with _translate(f"compare-and-append on {stream}"):
            result = await self._cas(keys=keys, args=args)
        if int(result[0]) != 1:
            raise AppendConflict(stream, expected_last, _s(result[1]))
        return [_s(i) for i in result[1:]]

    async def append_once(
        self,
        stream: str,
        event: Event,
        marker: str,
        *,
        ttl_s: int = 86_400,
        causation: Envelope | str | None = None,
    ) -> str | None:
        """Append ``event`` unless ``marker`` is set; set it (one script, one slot)."""
        _one_slot(f"append-once on {stream}", [stream, marker])
        data = self._encode(event, causation)
        with _translate(f"append-once on {stream}"):
            entry_id = await self._once(keys=[stream, marker], args=[ttl_s, data])
        return None if entry_id is None else _s(entry_id)

    async def last_id(self, stream: str) -> str:
        with _translate(f"XREVRANGE {stream}"):
            rows = await self._r.xrevrange(stream, "+", "-", count=1)
        return _s(rows[0][0]) if rows else EMPTY_ID

    async def first_id(self, stream: str) -> str:
        with _translate(f"XRANGE {stream}"):
            rows = await self._r.xrange(stream, "-", "+", count=1)
        return _s(rows[0][0]) if rows else EMPTY_ID

    # ------------------------------------------------------------------ reading

    async def _decode_rows(
        self,
        stream: str,
        rows: Sequence[tuple[Any, Any]],
        group: str | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        bad: list[tuple[str, bytes, str]] = []
        gone: list[str] = []
        with _gc_paused():
            for raw_id, fields in rows:
                entry_id = _s(raw_id)
                if fields is None:  # deleted while pending
                    gone.append(entry_id)
                    continue
                raw = fields.get(FIELD)
                if raw is None:
                    bad.append((entry_id, b"", f"entry has no {FIELD.decode()!r} field"))
                    continue
                try:
                    out.append(Envelope(stream, entry_id, decode(raw)))
                except DecodeError as exc:
                    bad.append((entry_id, raw, str(exc)))
        if bad and (group is not None or dead_letter):
            await self._dead_letter(stream, bad, group=group)
        elif bad:  # not this reader's to dead-letter: its owner does, once
            for entry_id, _raw, error in bad:
                if (stream, entry_id) not in self._skipped:
                    self._skipped.add((stream, entry_id))
                    logger.warning("skipping undecodable entry %s of %s: %s",
                                   entry_id, stream, error)
        if gone and group is not None:
            await self.ack(stream, group, *gone)
        return out

    async def _dead_letter(
        self,
        stream: str,
        bad: Sequence[tuple[str, bytes, str]],
        *,
        group: str | None,
        deliveries: Mapping[str, int] | None = None,
        ack: bool = True,
    ) -> None:
        args: list[bytes | str] = []
        for entry_id, raw, error in bad:
            letter = DeadLetter(
                source_stream=stream,
                source_id=entry_id,
                raw=raw,
                error=error,
                group=group,
                deliveries=(deliveries or {}).get(entry_id, 0),
            )
            args.extend((f"{stream}@{entry_id}", self._encode(letter, None)))
        with _translate(f"dead-letter of {len(bad)} entries of {stream}"):
            written = await self._dead_script(
                keys=[self.names.dead, self.names.dead_seen], args=args
            )
        if group is not None and ack:
            await self.ack(stream, group, *(entry_id for entry_id, _, _ in bad))
        self.dead_lettered += int(written)

    async def read(
        self,
        stream: str,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Entries with ``start <= id <= end`` (use ``(id`` for an exclusive start)."""
        with _translate(f"XRANGE {stream}"):
            rows = await self._r.xrange(stream, start, end, count=count)
        return await self._decode_rows(stream, rows, dead_letter=dead_letter)

    async def read_all(
        self,
        stream: str,
        *,
        after: str | None = None,
        page: int = 2000,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Every entry after ``after`` (exclusive; None = from the start), paging through.

        The cyclic GC is paused for the whole read (see ``_gc_paused``): a rebuild keeps
        every event it reads, so collections during it only re-traverse the result."""
        out: list[Envelope] = []
        cursor = after
        with _gc_paused():
            while True:
                start = "-" if cursor is None else exclusive(cursor)
                with _translate(f"XRANGE {stream}"):
                    rows = await self._r.xrange(stream, start, "+", count=page)
                if not rows:
                    return out
                out.extend(await self._decode_rows(stream, rows, dead_letter=dead_letter))
                cursor = _s(rows[-1][0])
                if len(rows) < page:
                    return out

    async def tail(
        self,
        positions: Mapping[str, str],
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Blocking read of entries after each stream's position (``$``: only new ones)."""
        block = self.block_ms if block_ms is None else block_ms
        out: list[Envelope] = []
        for raw_stream, rows in await self._xread(positions, count=count, block=block):
            out.extend(
                await self._decode_rows(_s(raw_stream), rows, dead_letter=dead_letter)
            )
        return out

    async def _xread(
        self, positions: Mapping[str, str], *, count: int, block: int
    ) -> list[tuple[Any, Any]]:
        """XREAD of several streams: one command, or on a cluster one per slot (each
        blocking, concurrently), the replies merged."""
        groups: dict[int, dict[str, str]] = {}
        if self.cluster:
            for stream, position in positions.items():
                groups.setdefault(key_slot(stream.encode()), {})[stream] = position
        else:
            groups[0] = dict(positions)

        async def one(part: dict[str, str]) -> list[tuple[Any, Any]]:
            with _translate("XREAD"):
                return _rows_of(await self._r.xread(part, count=count, block=block))

        if len(groups) == 1:
            return await one(next(iter(groups.values())))
        replies = await asyncio.gather(*(one(part) for part in groups.values()))
        return [item for reply in replies for item in reply]

    async def read_after(
        self,
        stream: str,
        after: str,
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> tuple[list[Envelope], str]:
        """Blocking read of one stream past ``after``: the decoded envelopes and the raw id
        to continue from, which moves past dead-lettered entries too (so a bad last entry
        is not read again). ``block_ms=0`` does not block."""
        block = self.block_ms if block_ms is None else block_ms
        with _translate(f"XREAD {stream}"):
            if block > 0:
                result = await self._r.xread({stream: after}, count=count, block=block)
            else:
                result = await self._r.xread({stream: after}, count=count)
        position = after
        out: list[Envelope] = []
        for _raw_stream, rows in result or []:
            if rows:
                position = _s(rows[-1][0])
                out.extend(await self._decode_rows(stream, rows, dead_letter=dead_letter))
        return out, position

    async def subscribe(
        self,
        stream: str,
        *,
        after: str = "$",
        block_ms: int | None = None,
        dead_letter: bool = False,
    ) -> AsyncIterator[Envelope]:
        """Yield every event appended after ``after``, forever (cancel to stop).

        Positions advance over raw ids, so a dead-lettered entry is not read twice.
        """
        position = after
        if position == "$":
            position = await self.last_id(stream)
        block = self.block_ms if block_ms is None else block_ms
        while True:
            with _translate(f"XREAD {stream}"):
                result = await self._r.xread({stream: position}, count=500, block=block)
            for _raw_stream, rows in result or []:
                if rows:
                    position = _s(rows[-1][0])
                for env in await self._decode_rows(stream, rows, dead_letter=dead_letter):
                    yield env

    # ------------------------------------------------------------------ groups

    async def ensure_group(self, stream: str, group: str, *, start: str = "0") -> None:
        """Create the group (and the stream) if missing; an existing group is kept."""
        try:
            with _translate(f"XGROUP CREATE {stream} {group}"):
                await self._r.xgroup_create(stream, group, id=start, mkstream=True)
        except LogError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int = 100,
        block_ms: int | None = None,
        pending: bool = False,
    ) -> list[Envelope]:
        """New entries for this consumer, or (``pending=True``) its own unacked ones."""
        block = None if pending else (self.block_ms if block_ms is None else block_ms)
        ids = {s: ("0" if pending else ">") for s in streams}
        with _translate(f"XREADGROUP {group}"):
            result = await self._r.xreadgroup(group, consumer, ids, count=count, block=block)
        out: list[Envelope] = []
        if isinstance(result, dict):  # RESP3 shape
            items: list[tuple[Any, Any]] = [(k, v[0] if v else []) for k, v in result.items()]
        else:
            items = [(k, v) for k, v in (result or [])]
        for raw_stream, rows in items:
            out.extend(await self._decode_rows(_s(raw_stream), rows, group=group))
        return out

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        if not ids:
            return 0
        with _translate(f"XACK {stream} {group}"):
            n = await self._r.xack(stream, group, *ids)
        return int(n)

    async def keep_alive(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Reset the idle time of entries this consumer still owns; returns the ids it no
        longer owns (acked, or claimed by another consumer after a stall).

        The ownership check and the refresh are one atomic script: a plain XCLAIM would take
        back an entry that another consumer had rightly claimed from a stalled one, and
        both would then run the same work.
        """
        if not ids:
            return []
        with _translate(f"keep-alive on {stream} {group}"):
            lost = await self._keep_alive(keys=[stream], args=[group, consumer, *ids])
        return [_s(i) for i in lost]

    async def hand_back(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Give back entries this consumer is stopping work on, unfinished: they become
        claimable at once (idle past any window) and the hand-back does not count as a
        delivery, so a batch handed back by a graceful stop is neither delayed by the
        idle window nor brought closer to the dead letters. Returns the ids the consumer
        no longer owned (one atomic script, like :meth:`keep_alive`)."""
        if not ids:
            return []
        with _translate(f"hand-back on {stream} {group}"):
            lost = await self._hand_back(
                keys=[stream], args=[group, consumer, HAND_BACK_IDLE_MS, *ids]
            )
        return [_s(i) for i in lost]

    async def claim_idle(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = 100,
        ack_dead: bool = True,
    ) -> ClaimResult:
        """Take over entries idle past ``min_idle_ms`` (a dead consumer's work)."""
        start = EMPTY_ID
        rows: list[tuple[Any, Any]] = []
        while len(rows) < count:
            with _translate(f"XAUTOCLAIM {stream} {group}"):
                reply = await self._r.xautoclaim(
                    stream, group, consumer, min_idle_ms, start_id=start, count=count - len(rows)
                )
            next_start, claimed = _s(reply[0]), reply[1]
            rows.extend(claimed)
            if len(reply) > 2 and reply[2]:
                # Entries deleted from the stream while pending: nothing to run.
                await self.ack(stream, group, *(_s(i) for i in reply[2]))
            if next_start == EMPTY_ID:
                break
            start = next_start
        return await self._check_deliveries(stream, group, rows, ack_dead=ack_dead)

    async def read_own_pending(
        self,
        group: str,
        consumer: str,
        stream: str,
        *,
        count: int = 10_000,
        limit: bool = True,
        ack_dead: bool = True,
    ) -> ClaimResult:
        """This consumer's own unacked entries (a restart resumes them).

        With ``limit`` they get the same delivery-count check as :meth:`claim_idle`:
        re-reading pending entries counts as a delivery, so a consumer that crashes on an
        entry every time it restarts ends up dead-lettering it instead of crash-looping.
        Without it every pending entry is returned (for entries held as long-lived leases,
        where a restart is not a failed attempt)."""
        with _translate(f"XREADGROUP {group} (pending)"):
            result = await self._r.xreadgroup(group, consumer, {stream: "0"}, count=count)
        if isinstance(result, dict):  # RESP3 shape
            rows: list[tuple[Any, Any]] = [r for v in result.values() for r in (v[0] if v else [])]
        else:
            rows = [r for _k, v in (result or []) for r in v]
        if not limit:
            return ClaimResult(entries=await self._decode_rows(stream, rows, group=group))
        return await self._check_deliveries(stream, group, rows, ack_dead=ack_dead)

    async def _check_deliveries(
        self, stream: str, group: str, rows: list[tuple[Any, Any]], *, ack_dead: bool
    ) -> ClaimResult:
        result = ClaimResult()
        if not rows:
            return result
        with _translate(f"XPENDING {stream} {group}"):
            async with self._r.pipeline(transaction=False) as pipe:
                for raw_id, _fields in rows:
                    pipe.xpending_range(stream, group, min=raw_id, max=raw_id, count=1)
                pend = await pipe.execute()
        over: list[tuple[Any, Any]] = []
        keep: list[tuple[Any, Any]] = []
        for (raw_id, fields), info in zip(rows, pend, strict=True):
            times = int(info[0]["times_delivered"]) if info else 1
            result.deliveries[_s(raw_id)] = times
            (over if times > self.max_deliveries else keep).append((raw_id, fields))
        if over:
            bad: list[tuple[str, bytes, str]] = []
            for raw_id, fields in over:
                entry_id = _s(raw_id)
                raw = (fields or {}).get(FIELD, b"")
                times = result.deliveries[entry_id]
                error = f"delivered {times} times (limit {self.max_deliveries}) without an ack"
                try:
                    event: Event | None = decode(raw)
                except DecodeError:
                    event = None
                bad.append((entry_id, raw, error))
                result.dead.append(DeadEntry(stream, entry_id, error, times, event))
            await self._dead_letter(
                stream, bad, group=group, deliveries=result.deliveries, ack=ack_dead
            )
        result.entries = await self._decode_rows(stream, keep, group=group)
        return result

    async def unread_own_pending(
        self, group: str, consumer: str, stream: str, *, skip: Collection[str] = ()
    ) -> ClaimResult:
        """This consumer's pending entries other than ``skip``, without counting a
        delivery (XPENDING, then XRANGE of each: neither touches the delivery count)."""
        skipped = set(skip)
        with _translate(f"XPENDING {stream} {group} {consumer}"):
            pend = await self._r.xpending_range(
                stream, group, min="-", max="+", count=10_000, consumername=consumer
            )
        wanted = [(_s(p["message_id"]), int(p["times_delivered"])) for p in pend]
        wanted = [(i, n) for i, n in wanted if i not in skipped]
        result = ClaimResult()
        if not wanted:
            return result
        with _translate(f"XRANGE {stream} (own pending)"):
            async with self._r.pipeline(transaction=False) as pipe:
                for entry_id, _n in wanted:
                    pipe.xrange(stream, entry_id, entry_id, count=1)
                replies = await pipe.execute()
        rows: list[tuple[Any, Any]] = []
        for (entry_id, times), reply in zip(wanted, replies, strict=True):
            result.deliveries[entry_id] = times
            rows.append((entry_id, reply[0][1] if reply else None))
        result.entries = await self._decode_rows(stream, rows, group=group)
        return result

    async def pending_count(self, stream: str, group: str) -> int:
        with _translate(f"XPENDING {stream} {group}"):
            info = await self._r.xpending(stream, group)
        return int(info["pending"])

    async def group_consumers(self, stream: str, group: str) -> dict[str, int]:
        try:
            with _translate(f"XINFO CONSUMERS {stream} {group}"):
                rows = await self._r.xinfo_consumers(stream, group)
        except LogError as exc:
            if isinstance(exc, LogUnavailable) or not _missing(exc):
                raise
            return {}
        return {_s(row["name"]): int(row["idle"]) for row in rows}

    async def trim_acked(
        self, stream: str, *, before: str | None = None, require: Collection[str] = ()
    ) -> int:
        """Trim entries every group has acked (never below a pending or undelivered entry);
        with ``before``, never at or past that id either (a retention window). While a group
        named in ``require`` does not exist yet, nothing is trimmed (it will read from 0)."""
        with _translate(f"XINFO GROUPS {stream}"):
            groups = await self._r.xinfo_groups(stream)
        if not groups or set(require) - {_s(g["name"]) for g in groups}:
            return 0
        floor: tuple[int, int] | None = None
        for g in groups:
            name = _s(g["name"])
            candidates = [parse_id(id_after(_s(g["last-delivered-id"])))]
            with _translate(f"XPENDING {stream} {name}"):
                summary = await self._r.xpending(stream, name)
            if summary["pending"]:
                candidates.append(parse_id(_s(summary["min"])))
            low = min(candidates)
            floor = low if floor is None else min(floor, low)
        assert floor is not None
        if before is not None:
            floor = min(floor, parse_id(before))
        with _translate(f"XTRIM {stream}"):
            n = await self._r.xtrim(stream, minid=format_id(*floor), approximate=False)
        return int(n)

    async def trim_before(self, stream: str, keep_from: str) -> int:
        """Delete the entries with ids below ``keep_from`` (exact XTRIM MINID)."""
        with _translate(f"XTRIM {stream}"):
            n = await self._r.xtrim(stream, minid=keep_from, approximate=False)
        return int(n)

    async def stream_length(self, stream: str) -> int:
        with _translate(f"XLEN {stream}"):
            return int(await self._r.xlen(stream))

    async def delete_stream(self, stream: str) -> bool:
        """Delete a stream with its groups; whether it existed."""
        with _translate(f"DEL {stream}"):
            return bool(await self._r.delete(stream))

    async def memory_usage(self, key: str) -> int:
        """Bytes Redis holds for ``key`` (all of it sampled; 0 when absent)."""
        with _translate(f"MEMORY USAGE {key}"):
            n = await self._r.memory_usage(key, samples=0)
        return int(n or 0)


    # ------------------------------------------------------------------ raw access

    async def read_raw(
        self, stream: str, *, after: str | None = None, page: int = 2000, limit: int | None = None
    ) -> list[RawEntry]:
        """Every entry after ``after`` (None: from the start) as ``(id, raw bytes)``,
        undecoded: an entry without the event field reads as empty bytes. With ``limit``,
        the first ``limit`` of them only."""
        if limit is not None and limit < 1:
            raise ValueError(f"read_raw: limit must be at least 1, got {limit}")
        out: list[RawEntry] = []
        cursor = after
        while True:
            start = "-" if cursor is None else exclusive(cursor)
            count = page if limit is None else min(page, limit - len(out))
            with _translate(f"XRANGE {stream}"):
                rows = await self._r.xrange(stream, start, "+", count=count)
            for raw_id, fields in rows:
                out.append((_s(raw_id), bytes(fields.get(FIELD, b""))))
            if len(rows) < count or (limit is not None and len(out) >= limit):
                return out
            cursor = out[-1][0]

    async def read_raw_ranges(
        self, stream: str, ranges: Sequence[tuple[str, str, int | None]]
    ) -> list[list[RawEntry]]:
        """For each ``(start, end, count)``: the entries with ``start <= id <= end``
        (``(id``: exclusive), at most ``count`` (None: all), undecoded (an entry without the
        event field reads as empty bytes); every range in one pipelined round trip (the
        client's streaming ``iter_load`` reads each chunk's entries so)."""
        if not ranges:
            return []
        with _translate(f"XRANGE {stream} ({len(ranges)} ranges)"):
            async with self._r.pipeline(transaction=False) as pipe:
                for start, end, count in ranges:
                    pipe.xrange(stream, start, end, count=count)
                replies = await pipe.execute()
        return [
            [(_s(raw_id), bytes((fields or {}).get(FIELD, b""))) for raw_id, fields in rows]
            for rows in replies
        ]

    async def tail_raw(
        self, positions: Mapping[str, str], *, block_ms: int | None = None, count: int = 500
    ) -> list[RawStreamEntry]:
        """Blocking read past each stream's position, undecoded and without dead-lettering
        (for viewers, which only read)."""
        block = self.block_ms if block_ms is None else block_ms
        items = await self._xread(positions, count=count, block=block)
        return [
            (_s(raw_stream), _s(raw_id), bytes((fields or {}).get(FIELD, b"")))
            for raw_stream, rows in items
            for raw_id, fields in rows
        ]

    async def list_streams(self, pattern: str) -> list[str]:
        """Names of the streams matching the glob ``pattern``, sorted."""
        found: list[str] = []
        with _translate(f"SCAN {pattern}"):
            async for key in self._r.scan_iter(match=pattern, _type="stream"):
                found.append(_s(key))
        return sorted(found)

    async def write_snapshot(self, name: str, data: bytes) -> None:
        with _translate(f"SET snapshot {name}"):
            await self._r.set(self.names.snapshot(name), data)

    async def read_snapshot(self, name: str) -> bytes | None:
        with _translate(f"GET snapshot {name}"):
            raw = await self._r.get(self.names.snapshot(name))
        return None if raw is None else bytes(raw)

    async def aclose(self) -> None:
        """Close the client (its connections); the log is unusable afterwards."""
        with _translate("close"):
            await self._r.aclose()


def open_log(
    settings: RedisSettings,
    *,
    names: StreamNames | None = None,
    producer: str = "",
    max_deliveries: int = 5,
) -> RedisEventLog:
    """A log on a new client built by :func:`connect` (blocking reads of
    ``settings.block_ms``); :meth:`RedisEventLog.aclose` closes it."""
    return RedisEventLog(
        connect(settings),
        names=names,
        producer=producer,
        max_deliveries=max_deliveries,
        block_ms=settings.block_ms,
    )
