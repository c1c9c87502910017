"""The fault-injection harness: a multi-rollout workload on real processes and a real
redis-server (AOF on) while faults are injected, then checks of what was observed.

One :func:`run_scenario` call, seeded, does what a demanding user did before trusting a
training run to the engine:

* starts a redis-server with AOF (``appendfsync always``) that it can restart in place, one
  scheduler, three evaluator workers and one finalizer, each started by the engine's launcher
  (``engine.ops.processes``), on a 2-node layout of 6 placement tokens per node;
* requests several rollouts and, as they progress, injects every kind of fault in a seeded
  order: SIGKILL of a busy worker, of the scheduler and of the finalizer (each restarted,
  under its name or a new one), SIGTERM of a busy worker (restarted), two redis-server
  restarts (down 1-2 s; with ``long_outage_s`` the second stays down that long, past every
  claim window), and garbage entries appended to the control, work, rollout and pool
  streams;
* checks, from what the agent itself recorded (``tests/faults/agent.py``) and from the log:
  every rollout ready; exactly the requested samples, with the content the agent produced;
  no sample run to the end twice except where a SIGKILL cut the earlier run, and no attempt
  number used twice; never more samples running on a node than its tokens; the pool back to
  full (and never over-allocated); each garbage entry dead-lettered exactly once; a replay
  of each rollout byte-identical to the finalizer's artifacts; every process alive at the
  end and clean (exit 0) on SIGTERM.

:class:`Report` carries the figures ``bench/faults.py`` prints and the list of violations
(empty when every check holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.client import RolloutClient
from engine.events import DeadLetter
from engine.events.codec import decode
from engine.events.ids import parse_id
from engine.events.redis_log import RedisSettings, connect, open_log
from engine.ops.embedded import free_port
from engine.ops.processes import Processes
from engine.ops.replay import decode_entries, raw_entries, replay_state, replay_to_dir
from engine.projections.placement import PoolProjection
from tests.faults.agent import RECORD_ENV, SLEEP_ENV, prompt_ids, response_ids
from tests.faults.evaluators import TOKENS_PER_NODE
from workers.cli import ROLLOUT

ROOT = Path(__file__).resolve().parents[2]
EVALUATORS = Path(__file__).with_name("evaluators.py")
NODES = ("node-a", "node-b")


@dataclass(frozen=True)
class Workload:
    rollouts: int = 2
    prompts: int = 12
    samples_per_prompt: int = 2
    sleep_s: float = 0.4  # the agent's base episode time
    timeout_s: float = 150.0
    long_outage_s: float = 0.0  # > 0: the second Redis restart keeps it down this long


@dataclass
class Report:
    seed: int
    rollouts_requested: int = 0
    rollouts_completed: int = 0
    samples: int = 0
    runs: int = 0
    redundant_attempts: int = 0  # runs beyond the first of each sample (SIGKILL cuts too)
    peak_overcommit: int = 0  # most samples running on a node beyond its tokens (<= 0: none)
    garbage: int = 0
    dead_letter_copies: int = 0  # letters for injected garbage beyond one per entry
    faults: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "violations"} | {
            "violations": len(self.violations)
        }


class RestartableRedis:
    """A redis-server with AOF on a fixed port and directory, stopped (SIGTERM: it writes
    the AOF out) and started again in place."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.dir = root / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.dir),
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if _pong(self.port):
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")  # not "-LOADING": the AOF is loaded
    except OSError:
        return False


SETTINGS = {"heartbeat_ms": 200, "claim_idle_ms": 1500, "block_ms": 300}


def _launcher(root: Path, url: str, record: Path, sleep_s: float) -> Processes:
    """The engine's processes of the scenario, logged to ``root/<name>.log``."""
    return Processes(root, rollout=ROLLOUT, settings={"redis_url": url, **SETTINGS},
                     env={"PYTHONPATH": str(ROOT), RECORD_ENV: str(record),
                          SLEEP_ENV: str(sleep_s)})


def _start_scheduler(procs: Processes, name: str, config: Path, layout: str) -> None:
    procs.start(name, "scheduler", settings={
        "worker_id": name, "config": config, "evaluator_config": EVALUATORS,
        "cluster_layout": layout})


def _start_worker(procs: Processes, name: str) -> None:
    procs.start(name, "worker", settings={
        "worker_id": name, "evaluator_config": EVALUATORS, "sandbox": "none",
        "max_batches": 2, "grace_s": 30, "quiet": True})


def _start_finalizer(procs: Processes, name: str, out: Path) -> None:
    procs.start(name, "finalizer", settings={"worker_id": name, "out_dir": out})


def _write_inputs(root: Path, workload: Workload) -> tuple[Path, str]:
    data = root / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n"
                for i in range(workload.prompts)),
        encoding="utf-8",
    )
    config = root / "rollout.yaml"
    config.write_text(
        "rollout:\n  defaults: {task_type: fault}\n  datasets:\n"
        f"    prompts: {{path: {data}, n_samples_per_prompt: {workload.samples_per_prompt}}}\n",
        encoding="utf-8",
    )
    layout = json.dumps({n: {"cpu": TOKENS_PER_NODE, "memory_gb": 64} for n in NODES})
    return config, layout


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


GARBAGE_STREAMS = ("control", "work", "rollout", "pool")


async def run_scenario(seed: int, workload: Workload | None = None,
                       root: Path | None = None) -> Report:
    """Run the seeded scenario of the module docstring; returns its report."""
    workload = workload or Workload()
    own_root = root is None
    root = Path(tempfile.mkdtemp(prefix=f"faults-{seed}-")) if root is None else root
    rng = random.Random(seed)
    report = Report(seed=seed, rollouts_requested=workload.rollouts)
    redis = RestartableRedis(root)
    redis.start()
    record = root / "record.jsonl"
    out = root / "out"
    config, layout = _write_inputs(root, workload)
    procs = _launcher(root, redis.url, record, workload.sleep_s)
    killed: dict[int, float] = {}  # SIGKILLed pid -> wall time of the kill
    started = time.monotonic()
    client = RolloutClient.connect(redis.url, block_ms=300, producer="trainer")
    raw = connect(RedisSettings(url=redis.url))
    garbage: list[tuple[str, str]] = []
    try:
        _start_scheduler(procs, "s1", config, layout)
        for w in ("w1", "w2", "w3"):
            _start_worker(procs, w)
        _start_finalizer(procs, "f1", out)
        rids = [
            await client.request(iteration=i, n_prompts=workload.prompts,
                                 n_samples_per_prompt=workload.samples_per_prompt,
                                 seed=seed * 100 + i, rollout_id=f"f{seed}-r{i}")
            for i in range(workload.rollouts)
        ]
        total = workload.rollouts * workload.prompts * workload.samples_per_prompt
        report.samples = total
        waits = asyncio.gather(*(client.wait_ready(r, timeout=workload.timeout_s)
                                 for r in rids), return_exceptions=True)
        try:
            await _inject_faults(procs, killed, redis, raw, client, rids, rng, workload,
                                 report, garbage, record, total)
        except TimeoutError as exc:  # progress stalled: what is left is checked below
            report.violations.append(f"progress stalled: {exc}")
        results = await waits
        for rid, result in zip(rids, results, strict=True):
            if isinstance(result, BaseException):
                report.violations.append(f"rollout {rid} not ready: {result!r}")
            else:
                report.rollouts_completed += 1
        await _check_samples(client, rids, workload, report)
        _check_records(_records(record), killed, report)
        await _check_processes(procs, report)
        await _check_log(redis.url, rids, out, root, garbage, report)
    finally:
        procs.stop()
        with contextlib.suppress(Exception):
            await client.aclose()
        with contextlib.suppress(Exception):
            await raw.aclose()
        redis.stop()
        report.wall_s = round(time.monotonic() - started, 1)
        if own_root and not report.violations:
            shutil.rmtree(root, ignore_errors=True)
    return report


async def _inject_faults(
    procs: Processes, killed: dict[int, float], redis: RestartableRedis, raw: Any,
    client: RolloutClient, rids: list[str], rng: random.Random, workload: Workload,
    report: Report, garbage: list[tuple[str, str]], record: Path, total: int,
) -> None:
    """Inject every fault kind once (two Redis restarts) at seeded points of progress."""

    def ended() -> int:
        return sum(1 for r in _records(record) if r["ev"] == "end")

    def samples_ended() -> int:
        return len({r["sid"] for r in _records(record) if r["ev"] == "end"})

    def busy_workers() -> list[str]:
        running: dict[int, int] = defaultdict(int)
        for r in _records(record):
            running[r["pid"]] += 1 if r["ev"] == "start" else -1
        return [n for n in procs
                if n.startswith("w") and procs.alive(n) and running.get(procs[n].pid, 0) > 0]

    faults: list[str] = ["kill-worker", "kill-scheduler", "kill-finalizer",
                         "term-worker", "redis-restart", "redis-restart", "garbage"]
    rng.shuffle(faults)
    marks = sorted(rng.uniform(0.08, 0.7) for _ in faults)
    names = Counter[str]()
    for fault, mark in zip(faults, marks, strict=True):
        await _until(lambda m=mark: ended() >= m * total, workload.timeout_s, f"{fault}")
        if fault in ("kill-worker", "term-worker"):
            # Under load the last samples can all end before this point: then no worker is
            # busy again and there is nothing left for the fault to cut (the checks below
            # still hold the run to every rollout being ready).
            await _until(lambda: bool(busy_workers()) or samples_ended() >= total,
                         workload.timeout_s, "a busy worker")
            if not busy_workers():
                report.faults.append(f"{fault} skipped: every sample had ended")
                continue
            victim = rng.choice(sorted(busy_workers()))
            if fault == "kill-worker":
                killed[procs[victim].pid] = time.time()
                procs.kill(victim)
            else:
                code = await asyncio.to_thread(procs.terminate, victim, 60)
                if code != 0:
                    report.violations.append(f"SIGTERM of busy worker {victim}: exit {code}")
            names[victim] += 1
            again = victim if rng.random() < 0.5 else f"{victim}x{names[victim]}"
            report.faults.append(f"{fault} {victim} -> {again}")
            await asyncio.sleep(rng.uniform(0.1, 0.6))
            procs.restart(victim, as_name=again, settings={"worker_id": again})
        elif fault in ("kill-scheduler", "kill-finalizer"):
            victim = "s1" if fault == "kill-scheduler" else "f1"
            killed[procs[victim].pid] = time.time()
            procs.kill(victim)
            report.faults.append(fault)
            await asyncio.sleep(rng.uniform(0.1, 0.6))
            procs.restart(victim)
        elif fault == "redis-restart":
            down = rng.uniform(1.0, 2.0)
            restarts = sum(f.startswith("redis-restart") for f in report.faults)
            if workload.long_outage_s > 0 and restarts == 1:
                down = workload.long_outage_s
            report.faults.append(f"redis-restart down {down:.1f} s")
            await asyncio.to_thread(redis.stop)
            await asyncio.sleep(down)
            await asyncio.to_thread(redis.start)
        else:
            garbage += await _inject_garbage(raw, rng, rids, client)
            report.faults.append(f"garbage x{len(garbage)}")


async def _inject_garbage(
    raw: Any, rng: random.Random, rids: list[str], client: RolloutClient
) -> list[tuple[str, str]]:
    """Append an undecodable entry to each kind of stream; returns (stream, id) of each.
    The rollout stream chosen is one not decided yet (its finalizer still follows it)."""
    names = client.names
    open_rids = []
    for rid in rids:
        state = await client.log.read_all(names.rollout(rid))
        if not any(e.event.type in ("RolloutReady", "RolloutFailed") for e in state):
            open_rids.append(rid)
    streams = [names.control, names.work("fault"), names.pool]
    if open_rids:
        streams.append(names.rollout(rng.choice(open_rids)))
    injected = []
    for stream in streams:
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 24))) + b"\xc1"
        entry_id = await raw.xadd(stream, {b"e": junk})
        injected.append((stream, entry_id.decode()))
    if open_rids:  # the rollout may have been decided since: then nothing reads the entry
        rollout_stream, garbage_id = injected[-1]
        decided = [e.id for e in await client.log.read_all(rollout_stream)
                   if e.event.type in ("RolloutReady", "RolloutFailed")]
        if decided and parse_id(decided[0]) < parse_id(garbage_id):
            injected.pop()
    return injected


async def _check_samples(client: RolloutClient, rids: list[str], workload: Workload,
                         report: Report) -> None:
    per_rollout = workload.prompts * workload.samples_per_prompt
    for rid in rids:
        try:
            samples = await client.load(rid)
        except Exception as exc:
            report.violations.append(f"{rid}: cannot load: {exc!r}")
            continue
        if len(samples) != per_rollout:
            report.violations.append(f"{rid}: {len(samples)} samples loaded, "
                                     f"expected {per_rollout}")
        if sorted(s.index for s in samples) != list(range(per_rollout)):
            report.violations.append(f"{rid}: sample indices are not 0..{per_rollout - 1}")
        for s in samples:
            expected = (*prompt_ids(s.index), *response_ids(s.index))
            if tuple(s.tokens) != expected or s.remove_sample:
                report.violations.append(f"{rid}: sample {s.index} has wrong content")
                break


async def _check_log(url: str, rids: list[str], out: Path, root: Path,
                     garbage: list[tuple[str, str]], report: Report) -> None:
    log = open_log(RedisSettings(url=url))
    try:
        # The pool: back to full, and no prefix over-allocated.
        projection = PoolProjection()
        state = projection.initial()
        for env in await log.read_all(log.names.pool):
            state = projection.evolve(state, env)
            if state.over_allocation():
                report.violations.append(f"pool over-allocated at {env.id}: "
                                         f"{state.over_allocation()}")
                break
        if not state.is_full_capacity():
            report.violations.append(f"pool not back to full: {state.tokens_held} tokens held")
        # Dead letters: one per injected entry.
        letters = Counter[tuple[str, str]]()
        for _id, raw_bytes in await raw_entries(log, log.names.dead):
            ev = decode(raw_bytes)
            if isinstance(ev, DeadLetter):
                letters[(ev.source_stream, ev.source_id)] += 1
        report.garbage = len(garbage)
        for entry in garbage:
            if letters[entry] != 1:
                report.violations.append(f"garbage {entry} dead-lettered {letters[entry]} times")
        report.dead_letter_copies = sum(max(letters[e] - 1, 0) for e in garbage)
        # Replay: byte-identical to the finalizer's artifacts.
        for rid in rids:
            envs, _bad = decode_entries(log.names.rollout(rid),
                                        await raw_entries(log, log.names.rollout(rid)))
            state_r = replay_state(envs)
            if state_r.state.ready is None:
                continue  # reported as not ready already
            again = root / "replay" / rid
            replay_to_dir(state_r, again)
            live = out / rid
            for path in sorted(p for p in again.rglob("*") if p.is_file()):
                twin = live / path.relative_to(again)
                if not twin.exists() or twin.read_bytes() != path.read_bytes():
                    report.violations.append(f"{rid}: replay differs at {twin}")
                    break
    finally:
        await log.aclose()


def _check_records(
    records: list[dict[str, Any]], killed: dict[int, float], report: Report
) -> None:
    """Repeated runs and over-commit, as the agent observed them."""
    report.runs = sum(1 for r in records if r["ev"] == "start")
    starts: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    ends: dict[tuple[str, int, int], float] = {}
    for r in records:
        if r["ev"] == "start":
            starts[(r["sid"], r["attempt"])].append(r)
        else:
            ends[(r["sid"], r["attempt"], r["pid"])] = r["t"]
    by_sample: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (sid, attempt), runs in starts.items():
        if len(runs) > 1:
            report.violations.append(f"attempt {attempt} of {sid} ran {len(runs)} times")
        by_sample[sid].extend(runs)
    report.redundant_attempts = sum(len(runs) - 1 for runs in by_sample.values())
    for sid, runs in by_sample.items():
        uncut = [r for r in runs if r["pid"] not in killed]
        if len(uncut) > 1:
            report.violations.append(
                f"{sid} ran {len(uncut)} times outside SIGKILL cuts "
                f"(attempts {sorted(r['attempt'] for r in uncut)})"
            )
    # Over-commit: the most runs at once on one node, against its tokens.
    last = max((r["t"] for r in records), default=0.0)
    edges: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for (sid, attempt), runs in starts.items():
        for r in runs:
            end = ends.get((sid, attempt, r["pid"]))
            if end is None:
                end = killed.get(r["pid"], last)
            edges[r["node"]] += [(r["t"], 1), (end, -1)]
    peak = 0
    for node, marks in edges.items():
        running = 0
        for _t, step in sorted(marks, key=lambda m: (m[0], m[1])):
            running += step
            peak = max(peak, running)
        if node == "":
            report.violations.append("samples ran without a placement token (no node)")
    report.peak_overcommit = peak - TOKENS_PER_NODE


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has its SIGTERM handler in place (``SigCgt`` of /proc)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(line for line in fh if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


async def _check_processes(procs: Processes, report: Report) -> None:
    for name in procs:
        pid = procs[name].pid
        try:  # one restarted just now may still be starting: SIGTERM would end it uncleanly
            await _until(lambda pid=pid, name=name: not procs.alive(name) or _catches_sigterm(pid),
                         60, f"{name} to handle SIGTERM")
        except TimeoutError as exc:
            report.violations.append(f"process {name}: {exc}")
        if not procs.alive(name):
            report.violations.append(f"process {name} died (exit {procs.wait(name)})")
            continue
        code = await asyncio.to_thread(procs.terminate, name, 60)
        if code != 0:
            report.violations.append(f"process {name} exited {code} on SIGTERM")
