"""Prometheus metrics of an engine process, and the /metrics server.

The server is a one-route Starlette app on uvicorn (the stack the recording proxy and the
tiny model server run on, so the project has one HTTP server implementation), run by its
own event loop in a daemon thread: the workers start it before ``asyncio.run`` of their
actor (``workers._common.serve_metrics``), and a scrape never waits on the actor's loop nor
holds it up.

Every engine process (scheduler, evaluator workers, finalizer, capture) serves these on
``ROLLOUT_METRICS_HOST:ROLLOUT_METRICS_PORT`` when the port is set (``serve``); without it
nothing listens. They live in the process's default prometheus-client registry, as
prometheus-client expects, so the runtime and the actors record them with one line where the
thing happens (no registry is threaded through their constructors); a scrape of a process
only shows what that process does. A trainer that wants them calls ``serve`` itself.

What each metric counts (labels in brackets):

- ``rollout_samples_in_flight`` [evaluator]: samples of this worker's running batches that
  have not ended (running, or queued for the profile's concurrency);
- ``rollout_samples_done_total`` [evaluator, outcome]: episodes ended (completed / aborted);
- ``rollout_admission_waits_total`` [evaluator]: times the scheduler found no capacity
  for a batch and waited for the pool to change; ``rollout_batches_waiting`` [evaluator]:
  batches waiting for admission now;
- ``rollout_pool`` [resource, figure]: the placement pool as the scheduler folded it, read
  at scrape time (resource ``cpu`` / ``gpu`` / ``memory_gb`` / ``tokens`` / ``batches``,
  figure ``used`` / ``total``);
- ``rollout_consumer_lag_seconds`` [group, stream]: age of the last entry a consumer group
  was handed in this process (the time it waited in the stream); ``rollout_deliveries_total``
  [group, stream, redelivered]: entries handed to the actor;
- ``rollout_dead_letters_total`` [group]: entries this process moved to ``rl:dead``;
- ``rollout_redis_errors_total`` [operation]: failed reads, acks and stream follows (each
  is retried after a backoff).

Per-rollout streams (``rl:{rollout:ID}``) are labelled ``rl:{rollout}`` so label sets stay
bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import uvicorn
from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

__all__ = [
    "ADMISSION_WAITS",
    "BATCHES_WAITING",
    "CONSUMER_LAG",
    "DEAD_LETTERS",
    "DELIVERIES",
    "MetricsServer",
    "POOL",
    "POOL_FIGURES",
    "REDIS_ERRORS",
    "SAMPLES_DONE",
    "SAMPLES_IN_FLIGHT",
    "app",
    "delivered",
    "serve",
    "stream_label",
    "watch_pool",
]

SAMPLES_IN_FLIGHT = Gauge(
    "rollout_samples_in_flight", "Samples of running batches not ended yet.", ["evaluator"]
)
SAMPLES_DONE = Counter(
    "rollout_samples_done", "Episodes ended, by outcome.", ["evaluator", "outcome"]
)
ADMISSION_WAITS = Counter(
    "rollout_admission_waits",
    "Times a batch found no capacity in the pool and waited for it to change.",
    ["evaluator"],
)
BATCHES_WAITING = Gauge(
    "rollout_batches_waiting", "Batches waiting for admission now.", ["evaluator"]
)
POOL = Gauge(
    "rollout_pool",
    "The placement pool as this scheduler folded it (read at scrape time).",
    ["resource", "figure"],
)
CONSUMER_LAG = Gauge(
    "rollout_consumer_lag_seconds",
    "Age of the last entry handed to a consumer group in this process.",
    ["group", "stream"],
)
DELIVERIES = Counter(
    "rollout_deliveries", "Entries handed to an actor.", ["group", "stream", "redelivered"]
)
DEAD_LETTERS = Counter(
    "rollout_dead_letters", "Entries this process moved to the dead-letter stream.", ["group"]
)
REDIS_ERRORS = Counter(
    "rollout_redis_errors",
    "Redis operations that failed (retried after a backoff).",
    ["operation"],
)

POOL_FIGURES = (
    ("cpu", "used"),
    ("cpu", "total"),
    ("gpu", "used"),
    ("gpu", "total"),
    ("memory_gb", "used"),
    ("memory_gb", "total"),
    ("tokens", "used"),
    ("batches", "used"),
)
"""The ``(resource, figure)`` pairs of ``rollout_pool``."""


def stream_label(stream: str) -> str:
    """A stream's label: per-rollout streams collapse to ``<prefix>:{rollout}``; the
    control plane's hash tag is left out (``rl:{rl}:control`` -> ``rl:control``)."""
    head, brace, rest = stream.partition("{")
    if not brace:
        return stream
    if rest.startswith("rollout:"):
        return f"{head}{{rollout}}"
    _tag, closed, tail = rest.partition("}")
    return f"{head}{tail.removeprefix(':')}" if closed else stream


def delivered(group: str, stream: str, entry_ms: int, *, redelivered: bool) -> None:
    """Record one entry handed to an actor: the count and how long it waited."""
    label = stream_label(stream)
    DELIVERIES.labels(group, label, str(redelivered).lower()).inc()
    CONSUMER_LAG.labels(group, label).set(max(0.0, time.time() - entry_ms / 1000))


def watch_pool(read: Callable[[], Mapping[tuple[str, str], float]]) -> None:
    """Make ``rollout_pool`` read ``read()`` (figures by ``(resource, figure)``) at scrape
    time; the latest caller wins (one scheduler per process)."""
    def figure(key: tuple[str, str]) -> Callable[[], float]:
        return lambda: float(read().get(key, 0.0))

    for key in POOL_FIGURES:
        POOL.labels(*key).set_function(figure(key))


async def _metrics(request: Request) -> Response:
    # The text format, or OpenMetrics when the scraper asks for it (as prometheus-client's
    # own server negotiates); generating it is synchronous and short, so it runs inline.
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(REGISTRY), media_type=content_type)


def app() -> Starlette:
    """The ASGI app: ``GET /metrics`` shows this process's default registry."""
    return Starlette(routes=[Route("/metrics", _metrics, methods=["GET"])])


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's owner handles SIGINT / SIGTERM

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


class MetricsServer:
    """A running ``/metrics`` server: ``server_address`` is the bound ``(host, port, ...)``
    (the port is the real one when 0 was asked for); ``shutdown`` stops it and waits for
    its thread; ``server_close`` releases the socket (both are idempotent)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.server_address: tuple[Any, ...] = sock.getsockname()
        # log_config=None leaves the process's logging alone; log_level="warning" keeps
        # uvicorn's start/stop lines out of an actor's log, as the recording proxy does.
        config = uvicorn.Config(
            app(), log_config=None, log_level="warning", access_log=False, lifespan="off",
            http="h11", timeout_graceful_shutdown=1,
        )  # fmt: skip
        self._server = _Server(config)
        self._failure: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"metrics-{self.server_address[1]}", daemon=True
        )
        self._thread.start()
        self._server.ready.wait(30)
        if self._failure is not None or not self._server.started:
            self.server_close()
            raise OSError(f"the /metrics server did not start: {self._failure!r}")

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by __init__ when it stops the start
            self._failure = exc
        finally:
            self._server.ready.set()

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def server_close(self) -> None:
        self._sock.close()


def serve(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the server (its
    ``server_address`` has the bound port, useful with port 0). The socket is bound here,
    so a port that cannot be bound raises ``OSError`` in the caller."""
    family, kind, _proto, _name, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when the
    # socket's protocol says TCP, and uvicorn writes a reply's head and body apart (with
    # Nagle on, the body would wait ~40 ms for the scraper's delayed ACK).
    sock = socket.socket(family, kind, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return MetricsServer(sock)
