"""First-run friction: settings refused by name, clear CLI errors, quiet worker logs, merged
``rollout tail``, progress without duplicate lines, and no leaked batch directories."""

from __future__ import annotations

import asyncio
import io
import logging
import os
from pathlib import Path

import pytest
from rich.console import Console

from engine.actors.batch_run import BatchPlan, BatchRun, EpisodeSettings
from engine.agents.base import BaseAgent, EpisodeContext, Reward
from engine.agents.binding import EvaluatorBinding
from engine.agents.result import AgentResult
from engine.domain import EvaluatorProfile, Task
from engine.events import EventLog
from engine.events.catalog import BatchAdmitted, RolloutRequested, SampleStarted, TaskFetched
from engine.events.names import StreamNames
from engine.ops import cli
from engine.ops.inspection import tail
from engine.ops.progress import Bar
from engine.outcomes import TerminationReason
from workers import cli as rollout
from workers._common import setup_logging

real_redis = pytest.mark.parametrize("log_backend", ["redis-server"])


def test_a_misspelt_variable_is_refused_with_its_close_matches(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROLLOUT_REDIS_ULR", "redis://elsewhere:6379/0")
    assert cli.main(["status", "x"]) == 2
    err = capsys.readouterr().err
    assert "'ROLLOUT_REDIS_ULR'" in err and "did you mean 'ROLLOUT_REDIS_URL'" in err


def test_rollout_env_lists_every_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    assert "ROLLOUT_REDIS_URL" in out and "ROLLOUT_METRICS_PORT" in out


def test_pool_at_garbage_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["pool", "--at", "garbage"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "rollout pool" in err and "'garbage' is not a stream id" in err


def test_worker_help_says_rollout_worker(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rollout.main(["worker", "--help"])  # the installed `rollout` command
    out = capsys.readouterr().out
    assert out.startswith("usage: rollout worker") and "python -m" not in out


def test_http_request_lines_are_below_info_in_workers() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        root.handlers.clear()
        setup_logging("info")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert logging.getLogger("workers").isEnabledFor(logging.INFO)
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        root.handlers.clear()
        setup_logging("DEBUG")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    finally:
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        logging.getLogger("httpcore").setLevel(logging.NOTSET)
        root.handlers[:], root.level = saved[0], saved[1]


@real_redis
async def test_tail_merges_streams_in_time_order_and_omits_empty_fields(log: EventLog) -> None:
    names = log.names
    streams = [names.control, names.rollout("r1"), names.rollout("r2")]
    for i in range(7):  # interleaved across three streams; pages of 2 force the merge
        stream = streams[i % 3]
        await log.append(stream, SampleStarted(rollout_id="r", sample_id=f"s{i}", worker="w"))
        # Ids order across streams by their millisecond only (each stream counts its own
        # sequence), so the appends go to different milliseconds.
        await asyncio.sleep(0.003)
    lines: list[str] = []
    n = await tail(log, sorted(streams), emit=lines.append, from_start=True, count=7,
                   block_ms=50, page=2)
    assert n == 7
    assert [line.split("sample=")[1].split()[0] for line in lines] == [f"s{i}" for i in range(7)]
    assert all("node=" not in line and "worker=w" in line for line in lines)


def test_progress_without_a_terminal_prints_each_state_once() -> None:
    out = io.StringIO()
    now = [0.0]
    bar = Bar("train", console=Console(file=io.StringIO(), force_terminal=False), file=out,
              clock=lambda: now[0])
    for done, t in [(0, 0.0), (0, 5.0), (0, 9.0), (1, 9.5), (2, 12.0), (3, 12.1), (4, 12.2)]:
        now[0] = t
        bar.update(done, 4, f"{done} completed")
    bar.update(4, 4, "4 completed")
    bar.close()
    lines = out.getvalue().splitlines()
    # (0, 5.0) and (0, 9.0) repeat the first line; (3, 12.1) comes 0.1 s after the last
    # line; the last update repeats the final line
    assert lines == ["train     0/4  0 completed", "train     1/4  1 completed",
                     "train     2/4  2 completed", "train     4/4  4 completed"]


def test_progress_on_a_terminal_is_a_rich_bar() -> None:
    screen = io.StringIO()
    with Bar("model", console=Console(file=screen, force_terminal=True, width=100)) as bar:
        bar.update(3, 10, "loss 1.5")
    assert "3/10" in screen.getvalue() and "loss 1.5" in screen.getvalue()


class _Sink:
    def emit(self, items: object) -> None:
        return None

    async def flush(self) -> None:
        return None


class _TmpAgent(BaseAgent):
    """Records whether its attempt's directory (or the batch's) exists; makes it when asked."""

    def __init__(self, make: bool) -> None:
        self.make = make
        self.seen: list[tuple[Path, bool]] = []

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        self.seen.append((context.tmp_dir, context.tmp_dir.parent.exists()))
        if self.make:
            context.tmp_dir.mkdir(parents=True)
            (context.tmp_dir / "scratch").write_text("x")
        return AgentResult(termination_reason=TerminationReason.FINISH)

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


@pytest.mark.parametrize("make", [False, True])
async def test_a_batch_makes_no_directory_its_episodes_do_not_ask_for(
    make: bool, tmp_path: Path
) -> None:
    agent = _TmpAgent(make)
    task = TaskFetched(rollout_id="r", sample_id="r:s0", index=0, group_index=0, prompt="p",
                       label="l", dataset="d", task_type="t", source_line=1)
    plan = BatchPlan(
        admitted=BatchAdmitted(rollout_id="r", batch_id="r:b0", evaluator_id="e",
                               sample_ids=["r:s0"]),
        request=RolloutRequested(rollout_id="r", iteration=0, n_prompts=1),
        tasks={"r:s0": task}, run_ids=("r:s0",), attempts={}, tokens=(),
    )
    run = BatchRun(EvaluatorBinding(profile=EvaluatorProfile(evaluator_id="e"), agent=agent),
                   plan, sink=_Sink(), names=StreamNames("rl"),  # type: ignore[arg-type]
                   settings=EpisodeSettings(worker_id="w", tmp_root=tmp_path))
    await run.run()
    [(attempt_dir, batch_dir_existed)] = agent.seen
    assert not batch_dir_existed  # nothing on disk until the agent makes it
    assert attempt_dir.is_relative_to(tmp_path) and attempt_dir.name == "r_s0-a1"
    assert list(tmp_path.iterdir()) == []  # and what it made is gone after the batch


def test_demo_uses_rollout_redis_url_and_refuses_a_misspelt_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.errors import ConfigError
    from engine.ops.demo import build_parser, redis_for

    for key in [k for k in os.environ if k.startswith("ROLLOUT_")]:
        monkeypatch.delenv(key)
    assert redis_for(build_parser().parse_args([])) is None  # starts its own
    monkeypatch.setenv("ROLLOUT_REDIS_URL", "redis://db.internal:6379/3")
    assert redis_for(build_parser().parse_args([])) == "redis://db.internal:6379/3"
    flag = build_parser().parse_args(["--redis-url", "redis://other:6379/0"])
    assert redis_for(flag) == "redis://other:6379/0"
    monkeypatch.delenv("ROLLOUT_REDIS_URL")
    monkeypatch.setenv("ROLLOUT_REDIS_ULR", "redis://db.internal:6379/3")
    with pytest.raises(ConfigError, match="did you mean 'ROLLOUT_REDIS_URL'"):
        redis_for(build_parser().parse_args([]))
