"""Prometheus metrics: a real scheduler process serves /metrics on its setting's port, and
what it shows follows the log (deliveries, consumer lag, pool use, admission waits)."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import metrics
from engine.client import RolloutClient
from engine.events import EventLog
from engine.tasks import EVALUATOR_CONFIG
from tests.redis_server import RedisServer
from tests.rig import launcher

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ROLLOUT_YAML = ROOT / "engine" / "tasks" / "rollout.yaml"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_serve_binds_loopback_by_default() -> None:
    server = metrics.serve(0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        metrics.REDIS_ERRORS.labels("read").inc(0)
        assert ("rollout_redis_errors_total", (("operation", "read"),)) in _scrape(port)
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_are_scraped_over_a_real_socket_from_the_asgi_server() -> None:
    """The /metrics server is the project's one HTTP stack (Starlette on uvicorn): a raw
    HTTP/1.1 exchange over TCP gets the text format, OpenMetrics when asked, 404 elsewhere."""
    server = metrics.serve(0)
    try:
        port = server.server_address[1]
        metrics.DEAD_LETTERS.labels("scrape-test").inc(3)

        def exchange(path: str, accept: str = "*/*") -> tuple[str, str]:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n"
                             "Connection: close\r\n\r\n".encode())
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            head, _, body = data.decode().partition("\r\n\r\n")
            return head, body

        head, body = exchange("/metrics")
        assert head.startswith("HTTP/1.1 200"), head
        assert "content-type: text/plain; version=0.0.4" in head.lower(), head
        assert "server: uvicorn" in head.lower(), head
        assert 'rollout_dead_letters_total{group="scrape-test"} 3.0' in body
        head, body = exchange("/metrics", "application/openmetrics-text; version=1.0.0")
        assert "content-type: application/openmetrics-text" in head.lower(), head
        assert body.rstrip().endswith("# EOF")
        head, _ = exchange("/nothing")
        assert head.startswith("HTTP/1.1 404"), head
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(OSError):  # shut down: nothing listens on the port any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_port_in_use_raises_in_the_caller() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            metrics.serve(taken.getsockname()[1])


def test_per_rollout_streams_share_one_label() -> None:
    assert metrics.stream_label("rl:{rollout:it3-ab}") == "rl:{rollout}"
    assert metrics.stream_label("rl:work:math") == "rl:work:math"


async def test_a_scheduler_process_serves_its_metrics(
    real_log: EventLog, redis_server: RedisServer, tmp_path: Path
) -> None:
    port = _free_port()
    # Room for two math batches of 8 samples (0.25 CPU, 0.5 GB each) and no evaluator worker
    # to release them: the third waits for admission (the scheduler admits in order).
    layout = {"n0": {"cpu": 4, "memory_gb": 8}}
    with launcher(redis_server.url, tmp_path, metrics_port=port, heartbeat_ms=10_000,
                  claim_idle_ms=60_000) as procs:
        procs.start("sched", "scheduler", "--rollout-config", str(ROLLOUT_YAML),
                    "--evaluator-config", str(EVALUATOR_CONFIG),
                    "--cluster-layout", json.dumps(layout))
        await RolloutClient(real_log).request(iteration=0, n_prompts=16, n_samples_per_prompt=2,
                                              datasets=["math_train"])
        seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for _ in range(600):  # until the scheduler admitted one batch and waits on the next
            procs.check_alive()
            try:
                seen = _scrape(port)
            except OSError:  # not listening yet
                seen = {}
            if seen.get(("rollout_batches_waiting", (("evaluator", "math"),)), 0) >= 1:
                break
            await asyncio.sleep(0.1)
        rollout_metrics = {k: v for k, v in seen.items() if k[0].startswith("rollout_")}
        assert seen.get(("rollout_batches_waiting", (("evaluator", "math"),))) == 1.0, (
            rollout_metrics, procs.output("sched"))
        assert seen[("rollout_admission_waits_total", (("evaluator", "math"),))] >= 1
        assert seen[("rollout_pool", (("figure", "used"), ("resource", "cpu")))] == 4.0
        assert seen[("rollout_pool", (("figure", "used"), ("resource", "tokens")))] == 16.0
        assert seen[("rollout_pool", (("figure", "total"), ("resource", "cpu")))] == 4.0
        assert seen[("rollout_pool", (("figure", "used"), ("resource", "batches")))] == 2.0
        control = (("group", "schedulers"), ("redelivered", "false"), ("stream", "rl:control"))
        assert seen[("rollout_deliveries_total", control)] == 1.0
        lag = seen[("rollout_consumer_lag_seconds",
                    (("group", "schedulers"), ("stream", "rl:control")))]
        assert lag >= 0.0
