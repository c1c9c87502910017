"""Prometheus metrics of an engine process, and the /metrics server.

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
- ``rollout_redis_errors_total`` [operation]: failed reads, acks and pool watches (each is
  retried after a backoff).

Per-rollout streams (``rl:{rollout:ID}``) are labelled ``rl:{rollout}`` so label sets stay
bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, start_http_server

__all__ = [
    "ADMISSION_WAITS",
    "BATCHES_WAITING",
    "CONSUMER_LAG",
    "DEAD_LETTERS",
    "DELIVERIES",
    "POOL",
    "POOL_FIGURES",
    "REDIS_ERRORS",
    "SAMPLES_DONE",
    "SAMPLES_IN_FLIGHT",
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


def serve(port: int, host: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns the server (its
    ``server_address`` has the bound port, useful with port 0)."""
    server, _thread = start_http_server(port, addr=host)
    return server
