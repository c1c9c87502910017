"""Model-server faults on real processes: two tinylm servers behind evaluator workers, faults
injected while rollouts run, then checks of what was observed.

:class:`ServerRig` is the setup (``bench/server_faults.py`` uses it too): a redis-server, two
tinylm server processes (``server_a``, ``server_b``) at weight version 1 with
``PolicyVersionActivated(1)`` on ``rl:control`` (what a weight sync leaves), the scheduler,
evaluator workers bound to both servers (``--sglang-url`` twice), the finalizer and, where
asked, a weight syncer on both servers -- each process started by the engine's launcher
(``engine.ops.processes``). The agent (``tests/faults/policy.py``, also the evaluator config)
makes streamed policy generations through the worker's pool and records which server served
each turn at which weight version.

One :func:`run_scenario` call, seeded, requests a few rollouts and, as their turns progress,
injects in a seeded order, on a seeded server:

* ``kill-one``: SIGKILL of a server while a generation of the rollouts runs on it, restarted
  on its port (at the active version);
* ``stop-one``: SIGSTOP of a server while a generation runs on it, held past ``stall_s`` (until
  a worker names it down), then SIGCONT;
* ``kill-both``: SIGKILL of both servers, restarted on their ports;
* ``older-weights``: a newer version published and activated by the syncer, then a server
  restarted from the older version's weights (it reports the older version: stale until the
  syncer loads the active weights on it).

Checks (each failure a violation string of the :class:`Report`): every rollout ready; no
sample aborted (each outage ends within the outage limit); no infra dummy in the loaded
samples; the stopped server named down within ``stall_s`` plus the health check that confirms
the stall and a heartbeat; no turn served at a weight version that was not active while it ran;
no turn run twice and no attempt re-run (a server fault cuts generations, which the pool
retries inside the turn); every engine process alive at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.backends import SGLangConfig
from engine.client import RolloutClient
from engine.domain import TerminationReason
from engine.events import (
    AbortClass,
    Envelope,
    PolicyVersionActivated,
    SampleAborted,
    ServerDown,
    ServerStale,
    ServerUp,
)
from engine.events.ids import id_ms
from engine.ops.embedded import EmbeddedRedis, start_redis_server
from engine.ops.processes import Processes
from tests.faults.harness import _records, _until
from tests.faults.policy import EVALUATOR, RECORD_ENV, TURNS
from workers.cli import ROLLOUT

ROOT = Path(__file__).resolve().parents[2]
POLICY = Path(__file__).with_name("policy.py")
SERVERS = ("server_a", "server_b")
ACTIVE = 1
INFRA = {AbortClass.INFRA_CONN, AbortClass.INFRA_SANDBOX, AbortClass.INFRA_OTHER}
INFRA_REASONS = {TerminationReason(c.value) for c in INFRA}
QUIET = ("--log-level", "WARNING")
HEALTH_TIMEOUT_S = SGLangConfig(url="http://127.0.0.1:1").health_timeout_s  # the workers'


@dataclass(frozen=True)
class RigSpec:
    workers: int = 1
    max_batches: int = 4  # per worker
    syncer: bool = False
    stall_s: float = 3.0
    heartbeat_ms: int = 500
    server_slots: int = 4  # each server's --max-running-requests
    prompts: int = 64  # lines of the dataset
    samples_per_prompt: int = 4
    record: Path | None = None  # the agent's turn records (RECORD_ENV)


class ServerRig:
    """See the module docstring; :meth:`start` blocks until every server answers."""

    def __init__(self, root: Path, model: Path, spec: RigSpec) -> None:
        self.root = root
        self.model = model
        self.spec = spec
        self.redis: EmbeddedRedis = start_redis_server()
        env = {"PYTHONPATH": str(ROOT)}
        if spec.record is not None:
            env[RECORD_ENV] = str(spec.record)
        self.procs = Processes(
            root / "logs", rollout=ROLLOUT, env=env, grace_s=10,
            settings={"redis_url": self.redis.url, "heartbeat_ms": spec.heartbeat_ms,
                      "claim_idle_ms": 10_000, "block_ms": 200},
        )  # fmt: skip
        self.client = RolloutClient.connect(self.redis.url, block_ms=200)
        self.urls: dict[str, str] = {}
        self.stopped: set[str] = set()
        self.version = ACTIVE

    def serve(self, name: str, version: int) -> float:
        """Start (or restart, on its port) server ``name`` at weight ``version``; returns
        the wall time it was started at."""
        port = int(self.urls[name].rsplit(":", 1)[1]) if name in self.urls else None
        started = time.time()
        proc = self.procs.serve_tinylm(
            name, self.model, "--weight-version", str(version),
            "--max-running-requests", str(self.spec.server_slots), port=port)  # fmt: skip
        self.urls[name] = proc.url
        return started

    @property
    def server_urls(self) -> list[str]:
        return [self.urls[name] for name in SERVERS]

    def start(self) -> None:
        spec = self.spec
        with ThreadPoolExecutor(len(SERVERS)) as starting:  # each waits for its server
            list(starting.map(lambda name: self.serve(name, ACTIVE), SERVERS))
        data = self.root / "prompts.jsonl"
        data.write_text("".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n'
                                for i in range(spec.prompts)))  # fmt: skip
        config = self.root / "rollout.yaml"
        config.write_text(f"rollout:\n  datasets:\n    faults: {{path: {data}, task_type: "
                          f"{EVALUATOR}, n_samples_per_prompt: {spec.samples_per_prompt}}}\n")
        servers = {"sglang_url": self.server_urls}
        self.procs.start("scheduler", "scheduler", "--rollout-config", str(config),
                         "--evaluator-config", str(POLICY), "--scheduler-id", "sf", *QUIET)
        for i in range(spec.workers):
            self.procs.start(f"worker{i + 1}", "worker", "--evaluator-config", str(POLICY),
                             "--worker-id", f"w{i + 1}", "--sandbox", "none", "--quiet", *QUIET,
                             settings={**servers, "stall_s": spec.stall_s,
                                       "max_batches": spec.max_batches,
                                       "model_retry_backoff_s": 0.2})  # fmt: skip
        self.procs.start("finalizer", "finalizer", "--worker-id", "fin", *QUIET)
        if spec.syncer:
            self.procs.start("syncer", "sync", "--worker-id", "sync1", *QUIET, settings=servers)

    async def activate(self) -> None:
        """What a weight sync leaves: version 1 active on both servers."""
        log = self.client.log
        await log.append(log.names.control,
                         PolicyVersionActivated(version=ACTIVE, servers=self.server_urls))

    async def publish(self) -> None:
        """A newer version (the same weights, loaded again under the next number) published
        and activated by the syncer."""
        self.version += 1
        await self.client.publish_version(self.version, str(self.model))
        await self.client.wait_version_active(self.version, timeout=120)

    async def control(self) -> list[Envelope]:
        log = self.client.log
        return await log.read_all(log.names.control)

    async def first(self, kind: type, name: str, after: float, timeout: float = 120.0) -> Any:
        """The first ``kind`` entry on ``rl:control`` naming server ``name`` appended at or
        after wall time ``after``, waiting for it."""
        url = self.urls[name]
        deadline = time.monotonic() + timeout
        while True:
            for env in await self.control():
                if (isinstance(env.event, kind) and getattr(env.event, "endpoint", None) == url
                        and id_ms(env.id) / 1000 >= after):
                    return env
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind.__name__} for {name} on rl:control "
                                   f"within {timeout:.0f}s")
            self.procs.check_alive()
            await asyncio.sleep(0.05)

    async def until_running(self, name: str, rids: list[str], timeout: float = 60.0) -> bool:
        """Until a generation of one of ``rids`` runs on the server (its ``running_rids``);
        False after ``timeout``."""
        url = self.urls[name]
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() < deadline:
                info = (await http.get(url + "/get_server_info")).json()
                if any(r.split(":", 1)[0] in rids for r in info.get("running_rids", [])):
                    return True
                await asyncio.sleep(0.02)
        return False

    def signal(self, name: str, sig: int) -> None:
        self.procs.signal(name, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(name)
        elif sig == signal.SIGCONT:
            self.stopped.discard(name)

    async def close(self) -> None:
        for name in list(self.stopped):
            with contextlib.suppress(Exception):
                self.procs.signal(name, signal.SIGCONT)
        with contextlib.suppress(Exception):
            await self.client.aclose()
        self.procs.stop()
        self.redis.stop()


@dataclass(frozen=True)
class Workload:
    in_flight: int = 2  # rollouts requested at once: one more as each is ready
    prompts: int = 8  # per rollout
    samples_per_prompt: int = 2
    workers: int = 2
    max_batches: int = 2  # per worker: both workers take batches
    stall_s: float = 1.5
    heartbeat_ms: int = 1000
    timeout_s: float = 180.0


@dataclass
class Report:
    seed: int
    rollouts_requested: int = 0
    rollouts_completed: int = 0
    samples: int = 0
    turns: int = 0  # turns the agent ran (its records)
    samples_aborted: int = 0
    infra_dummies: int = 0
    wrong_version_turns: int = 0
    repeated_turns: int = 0
    stall_detect_s: float | None = None
    restart_to_serving_s: float | None = None  # kill-one: restart -> ServerUp
    stale_to_serving_s: float | None = None  # older-weights: ServerStale -> ServerUp
    faults: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    startup_s: float = 0.0  # the processes started, every server answering
    faults_s: float = 0.0  # from the first request to the last fault's end
    wall_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "violations"} | {
            "violations": len(self.violations)
        }


FAULTS = ("kill-one", "stop-one", "kill-both", "older-weights")


async def run_scenario(seed: int, model: Path, workload: Workload | None = None,
                       root: Path | None = None) -> Report:
    """Run the seeded scenario of the module docstring on tinylm ``model``; its report."""
    workload = workload or Workload()
    root = Path(tempfile.mkdtemp(prefix=f"server-faults-{seed}-")) if root is None else root
    rng = random.Random(seed)
    record = root / "turns.jsonl"
    spec = RigSpec(workers=workload.workers, max_batches=workload.max_batches, syncer=True,
                   stall_s=workload.stall_s, heartbeat_ms=workload.heartbeat_ms,
                   prompts=workload.prompts, samples_per_prompt=workload.samples_per_prompt,
                   record=record)  # fmt: skip
    report = Report(seed=seed)
    started = time.monotonic()
    rig = ServerRig(root, model, spec)
    rids: list[str] = []
    try:
        await asyncio.to_thread(rig.start)
        await rig.activate()
        report.startup_s = round(time.monotonic() - started, 1)
        done = asyncio.Event()
        requesting = asyncio.create_task(_request(rig, seed, workload, rids, done))
        try:
            await _inject(rig, rids, rng, workload, report, record)
        except TimeoutError as exc:  # progress stalled: what is left is checked below
            report.violations.append(f"progress stalled: {exc}")
        finally:
            done.set()
            report.faults_s = round(time.monotonic() - started - report.startup_s, 1)
            await requesting
        report.rollouts_requested = len(rids)
        report.samples = len(rids) * workload.prompts * workload.samples_per_prompt
        await _check_rollouts(rig, rids, workload, report)
        _check_turns(_records(record), await rig.control(), report)
        try:
            rig.procs.check_alive()
        except Exception as exc:
            report.violations.append(str(exc))
    finally:
        await rig.close()
        report.wall_s = round(time.monotonic() - started, 1)
    return report


async def _request(rig: ServerRig, seed: int, workload: Workload, rids: list[str],
                   done: asyncio.Event) -> None:
    """A steady workload: ``in_flight`` rollouts at once, one more requested as each is
    ready, until ``done`` (the ones requested are waited for by the checks)."""
    open_: set[asyncio.Future[Any]] = set()
    ending = asyncio.ensure_future(done.wait())
    while not done.is_set():
        while len(open_) < workload.in_flight:
            i = len(rids)
            rid = await rig.client.request(
                iteration=i, n_prompts=workload.prompts,
                n_samples_per_prompt=workload.samples_per_prompt, seed=seed * 1000 + i,
                rollout_id=f"sf{seed}-r{i}")  # fmt: skip
            rids.append(rid)
            open_.add(asyncio.ensure_future(rig.client.wait_ready(rid, workload.timeout_s)))
        finished, _ = await asyncio.wait({*open_, ending}, return_when=asyncio.FIRST_COMPLETED)
        open_ -= finished
    for wait in open_:
        wait.cancel()
    await asyncio.gather(*open_, return_exceptions=True)


async def _inject(rig: ServerRig, rids: list[str], rng: random.Random, workload: Workload,
                  report: Report, record: Path) -> None:
    """Each fault of ``FAULTS`` once, in a seeded order, each a seeded number of turns
    (a fraction of a rollout's) after the previous one ended."""
    per_rollout = workload.prompts * workload.samples_per_prompt * TURNS
    began = time.monotonic()
    faults = list(FAULTS)
    rng.shuffle(faults)
    for fault in faults:
        mark = len(_records(record)) + int(rng.uniform(0.2, 0.8) * per_rollout)

        def reached(m: int = mark) -> bool:
            return len(_records(record)) >= m

        await _until(reached, workload.timeout_s, f"{fault} at turn {mark}")
        name = rng.choice(SERVERS)
        if fault == "older-weights":
            await rig.publish()
        cut = fault == "kill-both" or await rig.until_running(name, rids, timeout=20)
        at = (f"{fault} {name if fault != 'kill-both' else 'both'} at turn {mark} "
              f"({time.monotonic() - began:.1f} s)")
        if fault == "stop-one":
            if not cut:
                report.faults.append(f"{at}: skipped, no generation ran on it")
                continue
            await _stall(rig, name, workload, report)
        elif fault == "kill-both":
            for victim in SERVERS:
                rig.procs.kill(victim)
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            await asyncio.gather(*(asyncio.to_thread(rig.serve, v, rig.version)
                                   for v in SERVERS))  # fmt: skip
        else:
            rig.procs.kill(name)
            version = rig.version - 1 if fault == "older-weights" else rig.version
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            restarted = await asyncio.to_thread(rig.serve, name, version)
            if fault == "kill-one" and cut:  # a worker saw it die: it says when it is back
                up = await rig.first(ServerUp, name, restarted, timeout=workload.timeout_s)
                report.restart_to_serving_s = round(id_ms(up.id) / 1000 - restarted, 3)
            elif fault == "older-weights":  # named stale, then loaded by the syncer
                stale = await rig.first(ServerStale, name, restarted, timeout=workload.timeout_s)
                up = await rig.first(ServerUp, name, id_ms(stale.id) / 1000,
                                     timeout=workload.timeout_s)  # fmt: skip
                report.stale_to_serving_s = round((id_ms(up.id) - id_ms(stale.id)) / 1000, 3)
        report.faults.append(at + ("" if cut else ", no generation ran on it")
                             + f", recovered at {time.monotonic() - began:.1f} s")


async def _stall(rig: ServerRig, name: str, workload: Workload, report: Report) -> None:
    """SIGSTOP ``name``, SIGCONT it once a worker named it down (and ``stall_s`` passed).
    Detection is bounded by ``stall_s`` of silence, the ``/health_generate`` check that
    confirms it (``HEALTH_TIMEOUT_S``) and a heartbeat for the worker to say so."""
    stopped = time.time()
    rig.signal(name, signal.SIGSTOP)
    bound = workload.stall_s + HEALTH_TIMEOUT_S + workload.heartbeat_ms / 1000
    try:
        down = await rig.first(ServerDown, name, stopped, timeout=bound + 30)
        report.stall_detect_s = round(id_ms(down.id) / 1000 - stopped, 3)
        if report.stall_detect_s > bound:
            report.violations.append(f"stopped {name} named down after {report.stall_detect_s}"
                                     f" s, past stall_s, the health check and a heartbeat "
                                     f"({bound} s)")
    except TimeoutError as exc:
        report.violations.append(f"stopped {name} never named down: {exc}")
    await asyncio.sleep(max(0.0, stopped + workload.stall_s * 1.5 - time.time()))
    rig.signal(name, signal.SIGCONT)


async def _check_rollouts(rig: ServerRig, rids: list[str], workload: Workload,
                          report: Report) -> None:
    """Every rollout ready, no sample aborted, every sample loaded and none an infra dummy."""
    log = rig.client.log
    per_rollout = workload.prompts * workload.samples_per_prompt
    for rid in rids:
        try:
            ready = await rig.client.wait_ready(rid, workload.timeout_s)
        except Exception as exc:
            report.violations.append(f"rollout {rid} not ready: {exc!r}")
            continue
        report.rollouts_completed += 1
        if ready.dummy:
            report.violations.append(f"rollout {rid} is a dummy")
        for env in await log.read_all(log.names.rollout(rid)):
            if isinstance(env.event, SampleAborted):
                report.samples_aborted += 1
                report.violations.append(f"{env.event.sample_id} aborted "
                                         f"({env.event.abort_class}): {env.event.error}")
        samples = await rig.client.load(rid)
        if len(samples) != per_rollout:
            report.violations.append(f"{rid}: {len(samples)} samples loaded, "
                                     f"expected {per_rollout}")
        for s in samples:
            if s.termination_reason in INFRA_REASONS:
                report.infra_dummies += 1
                report.violations.append(f"{s.sample_id}: an infra dummy in the training batch "
                                         f"({s.termination_reason})")


def _check_turns(records: list[dict[str, Any]], control: list[Envelope], report: Report) -> None:
    """No turn run twice, no attempt re-run, every turn served at a version active while it
    ran (a turn spans one version: a sync lets turns in flight end before it loads)."""
    report.turns = len(records)
    runs = Counter((r["sid"], r["turn"]) for r in records)
    for (sid, turn), n in sorted(runs.items()):
        if n > 1:
            report.repeated_turns += n - 1
            report.violations.append(f"turn {turn} of {sid} ran {n} times")
    for sid in sorted({r["sid"] for r in records if r["attempt"] > 1}):
        report.violations.append(f"{sid} was run again (an attempt beyond the first)")
    activations = sorted((id_ms(e.id) / 1000, e.event.version) for e in control
                         if isinstance(e.event, PolicyVersionActivated))  # fmt: skip
    for r in records:
        before = [v for t, v in activations if t <= r["t0"]]
        during = {v for t, v in activations if r["t0"] < t <= r["t1"]}
        if r["version"] not in {*before[-1:], *during}:
            report.wrong_version_turns += 1
            report.violations.append(
                f"turn {r['turn']} of {r['sid']} served by {r['url']} at version "
                f"{r['version']}, active: {before[-1] if before else None}")
