"""Real scheduler processes (``rollout scheduler``, started by the engine's launcher) against a
real redis-server: racing on one pool, killed with SIGKILL mid-rollout and resumed, refusing
bad input."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from engine.actors.scheduler import SCHEDULER_GROUP
from engine.events import Envelope, EventLog
from engine.ops.processes import Processes
from tests.redis_server import RedisServer
from tests.rig import launcher
from tests.scheduler.helpers import (
    EVALUATORS,
    FIXTURES,
    RANDOM_EVALUATORS,
    FakeEvaluators,
    all_admitted,
    request,
    write_config,
)
from tests.scheduler.test_scheduler_contract import RANDOM_LAYOUT, assert_exactly_once
from workers.scheduler import main

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

TIMEOUT = 60


def start_scheduler(procs: Processes, scheduler_id: str, config: Path, evaluators: Path,
                    layout: object, *extra: str) -> None:
    argv = ["--rollout-config", str(config), "--evaluator-config", str(evaluators),
            "--scheduler-id", scheduler_id, *extra]
    if layout is not None:
        argv += ["--cluster-layout", json.dumps(layout)]
    procs.start(scheduler_id, "scheduler", *argv)


def stop(procs: Processes, name: str) -> None:
    """SIGTERM: a clean exit 0."""
    procs.signal(name, signal.SIGTERM)
    assert procs.wait(name, TIMEOUT) == 0, procs.output(name)


@pytest.fixture
def processes(redis_server: RedisServer, tmp_path: Path) -> Iterator[Processes]:
    with launcher(redis_server.url, tmp_path, claim_idle_ms=600, log_level="WARNING") as procs:
        yield procs


async def wait_serving(log: EventLog, scheduler_ids: list[str]) -> None:
    """Wait until every process reads the control stream as a group consumer, so that its
    SIGTERM handler is installed (it is set before the first read). A process still
    importing when the work is done would otherwise die of the signal's default action."""
    while True:
        try:
            consumers = await log._r.xinfo_consumers(log.names.control, SCHEDULER_GROUP)
        except ResponseError:  # the group does not exist yet
            consumers = []
        names = {c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                 for c in consumers}
        if set(scheduler_ids) <= names:
            return
        await asyncio.sleep(0.05)


async def drain_pending(log: EventLog) -> None:
    """Wait (on the pool stream, not a clock) until every request is acked."""
    while await log.pending_count(log.names.control, SCHEDULER_GROUP):
        await log.tail({log.names.pool: "$"}, block_ms=100)


async def test_three_scheduler_processes_race_on_one_pool(
    real_log: EventLog, processes: Processes, tmp_path: Path
) -> None:
    log = real_log
    config = write_config(tmp_path, {"da": ("alpha", 5), "db": ("beta", 4), "dc": ("gamma", 6)})
    rollout_ids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(rollout_ids):
        await log.append(log.names.control, request(rid, n_prompts=3 + i, seed=4))
    for i in range(3):
        start_scheduler(processes, f"p{i}", config, RANDOM_EVALUATORS, RANDOM_LAYOUT)
    await asyncio.wait_for(wait_serving(log, ["p0", "p1", "p2"]), TIMEOUT)
    evaluators = FakeEvaluators(log, ["alpha", "beta", "gamma"], hold=3, seed=1)
    await asyncio.wait_for(evaluators.run(all_admitted(log, rollout_ids)), TIMEOUT)
    await asyncio.wait_for(drain_pending(log), TIMEOUT)
    for i in range(3):
        stop(processes, f"p{i}")
    await assert_exactly_once(log, rollout_ids, ["alpha", "beta", "gamma"])


async def test_sigkill_mid_rollout_resumes_without_duplicates(
    real_log: EventLog, processes: Processes, tmp_path: Path
) -> None:
    log = real_log
    config = write_config(tmp_path, {"gsm": ("math", 12), "py": ("code", 4)})
    one_math_batch = {"n1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}}
    await log.append(log.names.control, request("r1", n_prompts=14, seed=2))
    start_scheduler(processes, "k1", config, EVALUATORS, one_math_batch, "--plan-chunk", "5")
    evaluators = FakeEvaluators(log, ["math", "code"], hold=0, released=False)

    async def first_batch(admitted: list[Envelope]) -> bool:
        return len(admitted) >= 1

    await asyncio.wait_for(evaluators.run(first_batch), TIMEOUT)
    # The scheduler now waits for capacity with the rollout half admitted.
    processes.kill("k1")
    assert await log.pending_count(log.names.control, SCHEDULER_GROUP) == 1
    # Another scheduler claims the dead one's request once it has been idle long enough.
    start_scheduler(processes, "k2", config, EVALUATORS, one_math_batch, "--plan-chunk", "5")
    evaluators.released = True
    await asyncio.wait_for(evaluators.run(all_admitted(log, ["r1"])), TIMEOUT)
    await asyncio.wait_for(drain_pending(log), TIMEOUT)
    stop(processes, "k2")
    await assert_exactly_once(log, ["r1"], ["math", "code"])


def test_a_bad_layout_stops_the_process_at_start_up(processes: Processes, tmp_path: Path) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 3)})
    start_scheduler(processes, "bad", config, EVALUATORS, {"n1": {"gpus": [0, 0], "cpu": 8,
                                                                  "memory_gb": 8}})
    assert processes.wait("bad", TIMEOUT) == 2
    err = processes.output("bad")
    assert "node 'n1'" in err and "GPU ids [0] more than once" in err


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    # Nothing here reaches Redis: every refusal happens before connecting.
    code = main(["--redis-url", "redis://127.0.0.1:1/0", *argv])
    return code, capsys.readouterr().err


def test_each_bad_input_is_refused_at_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in [k for k in os.environ if k.startswith("ROLLOUT_")]:
        monkeypatch.delenv(key)
    config = write_config(tmp_path, {"gsm": ("math", 3)})
    ok = ["--rollout-config", str(config), "--evaluator-config", str(EVALUATORS)]

    code, err = run_main(capsys, "--evaluator-config", str(EVALUATORS))
    assert code == 2 and "--rollout-config (or ROLLOUT_CONFIG) is required" in err

    broken_yaml = tmp_path / "broken.yaml"
    broken_yaml.write_text("rollout:\n  datasets:\n    gsm: {path: gsm.jsonl\n", encoding="utf-8")
    code, err = run_main(capsys, "--rollout-config", str(broken_yaml),
                         "--evaluator-config", str(EVALUATORS))
    assert code == 2 and f"{broken_yaml}:" in err and "invalid YAML" in err

    code, err = run_main(capsys, "--rollout-config", str(config),
                         "--evaluator-config", str(FIXTURES / "evaluators_broken.py"))
    assert code == 2 and "item 0 must be an EvaluatorProfile, got str" in err

    code, err = run_main(capsys, *ok, "--cluster-layout", '{"n1": [0, 1]}')
    assert code == 2 and "node 'n1'" in err
    assert "'cpu' is missing" in err and "--env-num-cpus" in err

    code, err = run_main(capsys, "--rollout-config", str(config),
                         "--evaluator-config", str(FIXTURES / "evaluators_deadlock.py"),
                         "--cluster-layout", '{"n1": [0, 1, 2, 3]}',
                         "--env-num-cpus", "64", "--env-memory-gb", "64")
    assert code == 2
    assert "evaluator 'greedy' needs 8 placement tokens" in err
    assert "can only provide 4" in err

    monkeypatch.setenv("ROLLOUT_BLOCKMS", "5")
    code, err = run_main(capsys, *ok)
    assert code == 2 and "ROLLOUT_BLOCKMS" in err and "ROLLOUT_BLOCK_MS" in err
    monkeypatch.delenv("ROLLOUT_BLOCKMS")

    # A task type no evaluator serves is refused, naming the dataset and the ids there are.
    (tmp_path / "unserved").mkdir()
    (tmp_path / "rows").mkdir()
    unserved = write_config(tmp_path / "unserved", {"gsm": ("math", 3), "poem": ("verse", 2)})
    code, err = run_main(capsys, "--rollout-config", str(unserved),
                         "--evaluator-config", str(EVALUATORS))
    assert code == 2 and "dataset 'poem'" in err and "task_type 'verse'" in err
    assert "['code', 'math']" in err

    # Every dataset line is checked at start-up, not when a rollout first reads it.
    broken_rows = write_config(tmp_path / "rows", {"gsm": ("math", 3), "more": ("code", 400)})
    lines = (tmp_path / "rows" / "more.jsonl").read_text(encoding="utf-8").splitlines()
    lines[366] = '{"prompt": "unterminated'
    (tmp_path / "rows" / "more.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    code, err = run_main(capsys, "--rollout-config", str(broken_rows),
                         "--evaluator-config", str(EVALUATORS))
    assert code == 2 and "more.jsonl:367" in err and "invalid JSON" in err


def test_a_url_that_is_not_redis_gets_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import http.server
    import threading

    for key in [k for k in os.environ if k.startswith("ROLLOUT_")]:
        monkeypatch.delenv(key)
    http_server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler
    )
    thread = threading.Thread(target=http_server.serve_forever, daemon=True)
    thread.start()
    try:
        config = write_config(tmp_path, {"gsm": ("math", 3)})
        code = main(["--redis-url", f"redis://127.0.0.1:{http_server.server_port}/0",
                     "--rollout-config", str(config), "--evaluator-config", str(EVALUATORS),
                     "--outage-limit-s", "5"])
        err = capsys.readouterr().err
    finally:
        http_server.shutdown()
        http_server.server_close()
    assert code == 1
    assert "does not speak the Redis protocol" in err and "--redis-url" in err
    assert "Traceback" not in err


async def test_sigkill_while_writing_a_long_plan_completes_it_once(
    real_log: EventLog, processes: Processes, tmp_path: Path
) -> None:
    log = real_log
    config = write_config(tmp_path, {"gsm": ("math", 400)})
    await log.append(log.names.control, request("big", n_prompts=400, n_samples_per_prompt=3))
    start_scheduler(processes, "w1", config, EVALUATORS, None, "--plan-chunk", "4")
    # Kill as soon as the plan's first step (the cursor) is on the log; the 1,602 events
    # of the plan go in chained chunks of 4 and are then still missing, in part or all
    # (or, on a fast machine, complete: the assertions hold either way).
    while not await log.read_all(log.names.data):
        await log.tail({log.names.data: "0-0"}, block_ms=100)
    processes.kill("w1")
    written = await log.stream_length(log.names.rollout("big"))
    start_scheduler(processes, "w2", config, EVALUATORS, None, "--plan-chunk", "64")
    evaluators = FakeEvaluators(log, ["math"], hold=0)
    await asyncio.wait_for(evaluators.run(all_admitted(log, ["big"])), TIMEOUT)
    await asyncio.wait_for(drain_pending(log), TIMEOUT)
    stop(processes, "w2")
    await assert_exactly_once(log, ["big"], ["math"])
    assert await log.stream_length(log.names.rollout("big")) == 1 + 1200 + 400 + 1
    assert written % 4 == 0 or written == 1602  # whole chunks only: each is one step
