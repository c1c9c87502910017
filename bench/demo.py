"""The demo's training rollout through the engine, beside the same agents in one asyncio loop.

What runs (one machine, one run):

* one embedded Redis (``engine.ops.embedded.start_redis``), the tinylm model built once into
  ``<workdir>/tinylm`` (reused later) and ONE tinylm server that both arms talk to;
* engine arm: the demo's processes, started once by the engine's launcher on the demo's
  engine user -- ``rollout scheduler`` (bundled ``rollout.yaml``, ungated like the demo),
  ``--workers`` ``rollout worker`` processes (``--max-batches`` each, default the worker's
  own; local sandbox) and ``rollout finalizer``;
  the rounds begin once every process has joined its consumer group. Each round the bench
  (the trainer) requests a training rollout of ``--prompts`` x ``--samples-per-prompt`` with a
  fresh seed and times request -> ``RolloutReady`` (wall clock). The request also sets
  ``sampling_params.sampling_seed`` to that seed (the demo sends none): the tool agent then
  seeds every turn from it, the sample's seed and the sample id, so sampling is reproducible;
* direct arm: this process, one asyncio loop, the same agents (``load_evaluators`` of the
  bundled evaluator config with the same model dir and server URL), a local sandbox provider.
  It runs exactly the tasks of the engine round before it: the ``TaskFetched`` events of that
  rollout (prompt, label, dataset, and the stopping and sampling params the planner
  resolved), each routed to the evaluator its ``BatchSealed`` names,
  with the per-sample seed the evaluator derives (``engine.actors.batch_run.sample_seed``), so
  both arms ask the server for the same generations (the bench counts the samples whose
  tokens came out identical). Per sample: ``init -> run -> eval ->
  cleanup`` inside the episode window and ``Sample.from_agent_result`` (the seeds' loop),
  under one ``asyncio.Semaphore`` whose size is the engine's effective concurrency:
  workers x max batches per worker x samples a batch runs at once, the last being
  ``min(spec concurrency, placement tokens a batch gets, batch_size)`` -- what the evaluator
  actually runs (its semaphore, and one placement token per running sample).

Rounds alternate engine, direct, engine, direct, ... after one unmeasured warm-up pair
(``--warmup``); the data cursor advances each request (FIFO over the datasets, wrapping
epochs), which is why the direct arm replays each engine round's own tasks. Reported: the
medians of samples/s of each arm, the ratio per round (engine round i / direct round i, the
same tasks) and its median ``engine_vs_direct_ratio`` (target >= 0.9), mean reward, aborts
and generated (loss-mask) tokens per arm, how many samples generated exactly the same tokens
in both arms, and where time goes: per engine round a timeline from the entry ids (Redis's
clock, milliseconds after the request) of the plan, the admissions on ``rl:pool``, the
batches' first ``SampleStarted`` after their ``BatchAdmitted`` (pickup + init), the first and
last sample started, the last terminal event and ``RolloutReady``; the direct arm's
equivalents; and the CPU seconds each process spent in the round (``/proc``: scheduler,
workers and their sandbox supervisors, finalizer, tinylm, Redis; or this process).

Every process started (Redis, tinylm, scheduler, workers, finalizer) is stopped at the end,
also on an error, Ctrl-C or SIGTERM. The last line printed is one JSON object.

    python bench/demo.py [--rounds 3] [--prompts 24] [--samples-per-prompt 2] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from engine.actors.aborts import classify_abort
from engine.actors.batch_run import sample_seed
from engine.agents.base import EpisodeContext
from engine.agents.binding import EvaluatorBinding
from engine.backends.pool import BackendPool
from engine.client import RolloutClient
from engine.config.evaluators import load_evaluators
from engine.errors import EngineError
from engine.events import EventLog, StreamNames
from engine.events.catalog import (
    BatchAdmitted,
    BatchSealed,
    RolloutKind,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TaskJoined,
    TokenAcquired,
)
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.ops.demo import EVALUATORS, ROLLOUT_YAML, Stack, ensure_model
from engine.ops.embedded import redact
from engine.projections.placement import budget_tokens
from engine.projections.samples import scalar_reward, task_of
from engine.sample import Sample
from engine.settings import Settings
from workers.cli import ROLLOUT

TARGET_RATIO = 0.9
_TICK = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """Direct child processes of ``pid`` (e.g. a worker's sandbox supervisor)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out.extend(int(c) for c in task.read_text().split())
        except (OSError, ValueError):
            continue
    return out


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of a process so far (``/proc/<pid>/stat``; 0 if unreadable)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuMeter:
    """CPU seconds of named processes between ``start`` and ``stop``."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = dict(pids)
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = {name: cpu_seconds(pid) for name, pid in self._pids.items()}

    def stop(self) -> dict[str, float]:
        return {
            name: round(cpu_seconds(pid) - self._start[name], 3)
            for name, pid in self._pids.items()
        }


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Outcome:
    """One sample's end, as either arm saw it."""

    completed: bool
    reward: float
    generated: int  # loss-mask tokens: what the policy generated
    response: tuple[int, ...]
    reason: str  # termination reason, or abort class


@dataclass(slots=True)
class RoundResult:
    arm: str
    elapsed_s: float
    outcomes: dict[str, Outcome]
    timeline_ms: dict[str, float] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.outcomes)

    @property
    def samples_per_s(self) -> float:
        return self.n / self.elapsed_s

    @property
    def mean_reward(self) -> float:
        return statistics.fmean(o.reward for o in self.outcomes.values())

    @property
    def generated(self) -> int:
        return sum(o.generated for o in self.outcomes.values())

    @property
    def aborted(self) -> int:
        return sum(1 for o in self.outcomes.values() if not o.completed)


@dataclass(frozen=True, slots=True)
class RoundTasks:
    """What the direct arm needs to rerun one engine rollout."""

    request: RolloutRequested
    tasks: tuple[tuple[TaskFetched, str], ...]  # (task, evaluator id), in index order


# ---------------------------------------------------------------- concurrency


@dataclass(frozen=True, slots=True)
class Concurrency:
    total: int
    per_batch: dict[str, int]
    workers: int
    max_batches: int

    def describe(self) -> str:
        per = ", ".join(f"{e} {n}" for e, n in self.per_batch.items())
        return (
            f"{self.total} = {self.workers} workers x {self.max_batches} batches per worker x "
            f"{max(self.per_batch.values())} samples per batch ({per})"
        )


def batch_concurrency(binding: EvaluatorBinding) -> int:
    """Samples one batch of ``binding`` runs at once in the evaluator: its semaphore
    (``resource.concurrency``), the placement tokens admission grants (what the budget pays
    for, at most the batch's samples; one token per running sample) and the batch size."""
    spec = binding.profile
    limits = [spec.resource.concurrency, budget_tokens(spec.resource, spec.sample_resource)]
    if spec.batch_size is not None:
        limits.append(spec.batch_size)
    return min(limits)


def effective_concurrency(
    specs: Mapping[str, EvaluatorBinding], workers: int, max_batches: int
) -> Concurrency:
    per_batch = {eid: batch_concurrency(spec) for eid, spec in specs.items()}
    # A worker runs up to max_batches batches of any evaluator at once; when the specs
    # differ this is the upper bound (every running batch of the widest kind).
    total = workers * max_batches * max(per_batch.values())
    return Concurrency(total, per_batch, workers, max_batches)


def worker_max_batches() -> int:
    """The evaluator worker's own ``--max-batches`` default (what the demo runs with)."""
    from workers.evaluator import build_parser

    default = build_parser(Settings()).get_default("max_batches")
    return int(default)


# ---------------------------------------------------------------- engine arm


def start_engine(stack: Stack, args: argparse.Namespace, model_dir: Path) -> None:
    """The demo's processes (``engine.ops.demo.start_processes``), with ``--max-batches``
    explicit and no weight syncer."""
    procs, policy = stack.processes, policy_url(stack)
    procs.start("scheduler", "scheduler", settings={
        "config": ROLLOUT_YAML, "evaluator_config": EVALUATORS, "worker_id": "bench-scheduler"})
    for i in range(args.workers):
        procs.start(f"worker-{i}", "worker", settings={
            "evaluator_config": EVALUATORS, "model_dir": model_dir, "sglang_url": policy,
            "max_batches": args.max_batches, "worker_id": f"bench-worker-{i}"})
    procs.start("finalizer", "finalizer", settings={
        "out_dir": stack.workdir / "out", "worker_id": "bench-finalizer"})


def policy_url(stack: Stack) -> str:
    return stack.processes["tinylm"].url


def engine_pids(stack: Stack) -> dict[str, int | None]:
    """The engine's processes (and their sandbox supervisors), the server and Redis."""
    pids: dict[str, int | None] = {}
    for name in stack.processes:
        if name == "tinylm":
            continue
        pids[name] = pid = stack.processes[name].pid
        for i, child in enumerate(children(pid)):
            pids[f"{name}/child{i}"] = child
    return {**pids, **shared_pids(stack)}


def shared_pids(stack: Stack) -> dict[str, int | None]:
    proc = getattr(stack.redis, "_proc", None)
    return {"tinylm": stack.processes["tinylm"].pid,
            "redis": proc.pid if proc is not None else None}


async def wait_engine_up(
    redis: Any, stack: Stack, names: StreamNames, specs: Mapping[str, EvaluatorBinding],
    workers: int, timeout: float,
) -> float:
    """Wait until every engine process has joined its consumer group (it is reading), so
    no round pays for process start-up; returns the seconds waited."""
    from engine.actors.evaluator_worker import GROUP as WORKERS
    from engine.actors.finalizer import GROUP as FINALIZERS
    from engine.actors.scheduler import SCHEDULER_GROUP

    wanted = [(names.control, SCHEDULER_GROUP, "bench-scheduler"),
              (names.control, FINALIZERS, "bench-finalizer")]
    wanted += [(names.work(e), WORKERS, f"bench-worker-{i}")
               for e in specs for i in range(workers)]
    t0 = time.perf_counter()
    while True:
        missing = 0
        for stream, group, consumer in wanted:
            try:
                rows = await redis.xinfo_consumers(stream, group)
            except Exception:  # no stream or group yet
                missing += 1
                continue
            seen = {r["name"].decode() if isinstance(r["name"], bytes) else r["name"]
                    for r in rows}
            missing += consumer not in seen
        if not missing:
            return time.perf_counter() - t0
        stack.check_alive()
        if time.perf_counter() - t0 > timeout:
            raise EngineError(f"the engine processes did not start within {timeout:.0f}s")
        await asyncio.sleep(0.05)


async def wait_ready_alive(
    client: RolloutClient, stack: Stack, rid: str, timeout: float
) -> RolloutReady:
    """``wait_ready``, failing early when an engine process died."""
    waiter = asyncio.create_task(client.wait_ready(rid, timeout=timeout))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=1.0)
            if done:
                return waiter.result()
            stack.check_alive()
    finally:
        if not waiter.done():
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)


async def engine_round(
    log: EventLog,
    client: RolloutClient,
    stack: Stack,
    args: argparse.Namespace,
    iteration: int,
    seed: int,
) -> tuple[RoundResult, RoundTasks]:
    meter = CpuMeter(engine_pids(stack))
    meter.start()
    t_wall = time.time()
    t0 = time.perf_counter()
    rid = await client.request(iteration=iteration, n_prompts=args.prompts,
                               n_samples_per_prompt=args.samples_per_prompt, seed=seed,
                               sampling_params={"sampling_seed": seed})
    await wait_ready_alive(client, stack, rid, args.timeout)
    elapsed = time.perf_counter() - t0
    cpu = meter.stop()

    envs = await log.read_all(log.names.rollout(rid))
    request: RolloutRequested | None = None
    tasks: dict[str, TaskFetched] = {}
    evaluator_of: dict[str, str] = {}
    outcomes: dict[str, Outcome] = {}
    marks: dict[str, list[float]] = {"started": [], "terminal": []}
    batch_started: dict[str, float] = {}
    timeline: dict[str, float] = {}

    def at(entry_id: str) -> float:  # ms after the request (Redis ids carry its clock)
        return int(entry_id.partition("-")[0]) - t_wall * 1000.0

    for env in envs:
        ev = env.event
        if isinstance(ev, RolloutRequested):
            request = ev
        elif isinstance(ev, TaskFetched):
            tasks[ev.sample_id] = ev
        elif isinstance(ev, TaskJoined):  # a group's sample: its group's task
            tasks[ev.sample_id] = ev.task(tasks[ev.same_as])
        elif isinstance(ev, BatchSealed):
            evaluator_of.update((sid, ev.evaluator_id) for sid in ev.sample_ids)
        elif isinstance(ev, RolloutPlanned):
            timeline["planned"] = at(env.id)
        elif isinstance(ev, SampleStarted):
            marks["started"].append(at(env.id))
            first = batch_started.get(ev.batch_id)
            batch_started[ev.batch_id] = at(env.id) if first is None else min(first, at(env.id))
        elif isinstance(ev, SampleCompleted):
            marks["terminal"].append(at(env.id))
            mask = ev.loss_mask.numpy()
            outcomes[ev.sample_id] = Outcome(
                completed=True, reward=ev.reward, generated=int(mask.sum()),
                response=tuple(ev.response_ids.tolist()), reason=ev.termination_reason,
            )
        elif isinstance(ev, SampleAborted):
            marks["terminal"].append(at(env.id))
            outcomes[ev.sample_id] = Outcome(
                completed=False, reward=0.0, generated=0, response=(),
                reason=ev.abort_class.value,
            )
        elif isinstance(ev, RolloutReady):
            timeline["ready"] = at(env.id)
    if request is None or len(outcomes) != len(tasks):
        raise EngineError(f"rollout {rid}: the stream lacks its request or terminal events")
    admitted = [at(env.id) for env in await log.read_all(log.names.pool)
                if isinstance(env.event, TokenAcquired) and env.event.rollout_id == rid]
    if admitted:
        timeline["first_admitted"] = min(admitted)
        timeline["last_admitted"] = max(admitted)
    lags = [
        batch_started[env.event.batch_id] - at(env.id)
        for e in set(evaluator_of.values())
        for env in await log.read_all(log.names.work(e))
        if isinstance(env.event, BatchAdmitted) and env.event.rollout_id == rid
        and env.event.batch_id in batch_started
    ]
    if lags:  # BatchAdmitted -> the batch's first SampleStarted (pickup + init)
        timeline["batch_start_lag_median"] = statistics.median(lags)
        timeline["batch_start_lag_max"] = max(lags)
    if marks["started"]:
        timeline["first_started"] = min(marks["started"])
        timeline["last_started"] = max(marks["started"])
    if marks["terminal"]:
        timeline["last_terminal"] = max(marks["terminal"])
    timeline["client_ready"] = elapsed * 1000.0
    ordered = tuple(
        (ev, evaluator_of[ev.sample_id]) for ev in sorted(tasks.values(), key=lambda t: t.index)
    )
    return RoundResult("engine", elapsed, outcomes, timeline, cpu), RoundTasks(request, ordered)


# ---------------------------------------------------------------- direct arm


async def direct_round(
    specs: Mapping[str, EvaluatorBinding],
    work: RoundTasks,
    *,
    concurrency: int,
    sglang_url: str,
    provider: Any,
    tmp_root: Path,
    shared: Mapping[str, int | None],
) -> RoundResult:
    """The seeds' loop: every sample of ``work`` in one asyncio loop, no events."""
    sem = asyncio.Semaphore(concurrency)
    backends = BackendPool(sglang_url)  # one pooled client, as an engine worker holds
    request = work.request
    train = request.kind is RolloutKind.TRAIN
    tmp = Path(tempfile.mkdtemp(prefix="direct-", dir=tmp_root))
    started: list[float] = []
    finished: list[float] = []
    meter = CpuMeter({"bench": os.getpid(), "bench/sandbox": provider.supervisor_pid, **shared})
    meter.start()
    t0 = time.perf_counter()

    async def one(ev: TaskFetched, evaluator_id: str) -> tuple[str, Outcome]:
        spec = specs[evaluator_id]
        task = task_of(ev)
        episode = spec.agent.episode(task)
        stopping, sampling = ev.stopping, ev.sampling_params
        async with sem:
            ctx = EpisodeContext(
                rollout_id=ev.rollout_id, sample_id=ev.sample_id, attempt=1,
                stopping=stopping, sampling_params=sampling, tmp_dir=tmp / f"{ev.index}",
                backends=backends, sandboxes=provider,
                policy_version=request.policy_version,
                seed=sample_seed(request.seed, ev.index),
            )
            try:
                async with asyncio.timeout(stopping.timeout_s):
                    await episode.init(ctx)
                    started.append(time.perf_counter() - t0)  # where SampleStarted would be
                    result = await episode.run(ctx)
                    if result.termination_reason.is_abort:
                        outcome = Outcome(False, 0.0, 0, (), result.termination_reason.value)
                    else:
                        reward = await episode.eval(ctx, result)
                        Sample.from_agent_result(
                            task, result, reward, policy_version=request.policy_version,
                            require_tokens=train,
                        )
                        outcome = Outcome(
                            completed=True, reward=scalar_reward(reward),
                            generated=sum(result.loss_mask),
                            response=tuple(result.response_token_ids),
                            reason=result.termination_reason.value,
                        )
            except Exception as exc:
                outcome = Outcome(False, 0.0, 0, (), classify_abort(exc).value)
            try:
                await episode.cleanup(ctx)
            except Exception as exc:
                if outcome.completed:
                    outcome = Outcome(False, 0.0, 0, (), classify_abort(exc).value)
            finally:
                shutil.rmtree(ctx.tmp_dir, ignore_errors=True)
        finished.append(time.perf_counter() - t0)
        return ev.sample_id, outcome

    try:
        pairs = await asyncio.gather(*(one(ev, eid) for ev, eid in work.tasks))
        elapsed = time.perf_counter() - t0
        cpu = meter.stop()
    finally:
        await backends.aclose()
        shutil.rmtree(tmp, ignore_errors=True)
    timeline: dict[str, float] = {}
    if started:
        timeline["first_started"] = min(started) * 1000.0
        timeline["last_started"] = max(started) * 1000.0
    if finished:
        timeline["last_terminal"] = max(finished) * 1000.0
    return RoundResult("direct", elapsed, dict(pairs), timeline, cpu)


# ---------------------------------------------------------------- the run


def say(msg: str) -> None:
    print(msg, flush=True)


def describe(r: RoundResult) -> str:
    line = (f"{r.arm:<6} {r.n} samples in {r.elapsed_s:6.2f}s = {r.samples_per_s:6.2f} samples/s"
            f" | mean reward {r.mean_reward:.3f}, {r.aborted} aborted, {r.generated} tokens")
    if r.timeline_ms:
        line += "\n         ms after start: " + ", ".join(
            f"{k} {v:.0f}" for k, v in r.timeline_ms.items()
        )
    if r.cpu_s:
        line += "\n         CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in r.cpu_s.items())
    return line


def identical(a: RoundResult, b: RoundResult) -> int:
    return sum(
        1 for sid, o in a.outcomes.items()
        if sid in b.outcomes and o.completed and b.outcomes[sid].response == o.response
    )


async def measure(
    args: argparse.Namespace, stack: Stack, specs: Mapping[str, EvaluatorBinding], conc: Concurrency
) -> dict[str, Any]:
    from engine.sandbox import LocalSandboxProvider

    assert stack.redis is not None
    redis = connect(RedisSettings(url=stack.redis.url, block_ms=1000))
    log = RedisEventLog(redis, names=StreamNames(), producer="bench-demo", block_ms=1000)
    client = RolloutClient(log)
    provider = LocalSandboxProvider()
    tmp_root = stack.workdir / "direct"
    tmp_root.mkdir(parents=True, exist_ok=True)
    engine_rounds: list[RoundResult] = []
    direct_rounds: list[RoundResult] = []
    same: list[int] = []
    try:
        waited = await wait_engine_up(redis, stack, log.names, specs, args.workers, args.timeout)
        say(f"engine    every process reading its stream ({waited:.1f}s after start)")
        for r in range(args.warmup + args.rounds):
            label = f"warm-up {r + 1}" if r < args.warmup else f"round {r - args.warmup + 1}"
            seed = args.seed + r
            eng, work = await engine_round(log, client, stack, args, iteration=r, seed=seed)
            say(f"{label} (seed {seed}, rollout {work.request.rollout_id})")
            say("  " + describe(eng))
            direct = await direct_round(
                specs, work, concurrency=conc.total, sglang_url=policy_url(stack),
                provider=provider, tmp_root=tmp_root, shared=shared_pids(stack),
            )
            say("  " + describe(direct))
            n_same = identical(eng, direct)
            say(f"  ratio {eng.samples_per_s / direct.samples_per_s:.3f}; "
                f"{n_same}/{eng.n} samples generated identical tokens in both arms")
            if r >= args.warmup:
                engine_rounds.append(eng)
                direct_rounds.append(direct)
                same.append(n_same)
    finally:
        provider.close()
        await redis.aclose()
        shutil.rmtree(tmp_root, ignore_errors=True)

    pairs = zip(engine_rounds, direct_rounds, strict=True)
    ratios = [e.samples_per_s / d.samples_per_s for e, d in pairs]

    def arm(rounds: list[RoundResult], name: str) -> dict[str, Any]:
        n = sum(r.n for r in rounds)
        return {
            f"{name}_samples_per_s": round(statistics.median(r.samples_per_s for r in rounds), 3),
            f"{name}_samples_per_s_rounds": [round(r.samples_per_s, 3) for r in rounds],
            f"{name}_seconds_rounds": [round(r.elapsed_s, 3) for r in rounds],
            f"{name}_mean_reward": round(
                sum(r.mean_reward * r.n for r in rounds) / n, 4),
            f"{name}_aborted": sum(r.aborted for r in rounds),
            f"{name}_generated_tokens": sum(r.generated for r in rounds),
            f"{name}_cpu_s": {
                k: round(statistics.median(r.cpu_s.get(k, 0.0) for r in rounds), 3)
                for k in rounds[0].cpu_s
            },
        }

    return {
        "bench": "demo",
        "engine_vs_direct_ratio": round(statistics.median(ratios), 4),
        "ratio_rounds": [round(x, 4) for x in ratios],
        **arm(engine_rounds, "engine"),
        **arm(direct_rounds, "direct"),
        "identical_trajectories": sum(same),
        "samples_per_round": engine_rounds[0].n if engine_rounds else 0,
        "concurrency": conc.total,
        "concurrency_per_batch": conc.per_batch,
        "workers": conc.workers,
        "max_batches": conc.max_batches,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "prompts": args.prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "redis": stack.redis.kind,
        "target": TARGET_RATIO,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/demo.py",
        description="The demo's training rollout through the engine vs the same agents in "
        "one asyncio loop, same server, same concurrency; prints engine_vs_direct_ratio.",
    )
    p.add_argument("--workdir", type=Path, default=Path("runs/bench-demo"),
                   help="model (built once, reused), logs and outputs (default runs/bench-demo)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per arm")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds per arm first")
    p.add_argument("--prompts", type=int, default=24, help="prompts per rollout (as the demo)")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="group size (as the demo)")
    p.add_argument("--workers", type=int, default=2, help="evaluator worker processes")
    p.add_argument("--max-batches", type=int, default=None,
                   help="batches per worker at once (default: the worker's own default)")
    p.add_argument("--seed", type=int, default=1000, help="seed of the first round (+1 each)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="tinylm training steps when the model is first built")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait per rollout")
    return p


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops everything


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.workers < 1:
        raise SystemExit("--rounds and --workers must be >= 1, --warmup >= 0")
    if args.max_batches is None:
        args.max_batches = worker_max_batches()
    signal.signal(signal.SIGTERM, _terminate)
    workdir: Path = args.workdir.resolve()
    for sub in ("logs", "out"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "tinylm"
    ensure_model(model_dir, args.train_steps)
    stack = Stack.open(workdir, rollout=ROLLOUT, redis_url=None)
    try:
        assert stack.redis is not None
        say(f"redis     {stack.redis.kind} at {redact(stack.redis_url)}")
        policy = stack.processes.serve_tinylm("tinylm", model_dir).url
        say(f"policy    tinylm server at {policy} (shared by both arms)")
        start_engine(stack, args, model_dir)
        specs = load_evaluators(
            EVALUATORS, argparse.Namespace(model_dir=model_dir, sglang_url=policy)
        )
        conc = effective_concurrency(specs, args.workers, args.max_batches)
        n = args.prompts * args.samples_per_prompt
        say(f"engine    scheduler, {args.workers} evaluator workers (--max-batches "
            f"{args.max_batches}), finalizer; logs in {workdir / 'logs'}")
        say(f"concurrency {conc.describe()}; both arms run at most that many samples at once "
            f"({'all ' + str(n) if conc.total >= n else str(conc.total)} of each round's {n})")
        result = asyncio.run(measure(args, stack, specs, conc))
    except KeyboardInterrupt:
        say("interrupted; stopping every process")
        return 130
    except SystemExit:
        say("terminated; stopping every process")
        raise
    finally:
        stack.stop()
    say(f"median ratio engine/direct {result['engine_vs_direct_ratio']:.3f} "
        f"(target >= {TARGET_RATIO}); every process stopped")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
