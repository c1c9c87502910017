"""Model-server faults under a steady workload: two tinylm servers behind one worker.

A real redis-server, the engine's scheduler, one evaluator worker bound to two tinylm
servers (``--sglang-url`` twice, ``--stall-s``) and one finalizer, all started by the engine's
launcher (``engine.ops.processes``); the servers report weight version 1 and
``PolicyVersionActivated(1)`` is on ``rl:control``, as a weight sync leaves them. The agent
(``policy``, this file is also the worker's and the scheduler's evaluator config) makes
``TURNS`` streamed policy generations of ``TOKENS`` tokens per sample. One rollout of
``--samples-per-phase`` samples per phase, loaded with ``client.wait_load``, after one
warm-up rollout of as many (both up; counted for losses, not for samples/s):

1. both servers up: samples/s (request -> ready);
2. server B SIGKILLed once a generation of the rollout runs on it, dead for the whole phase:
   samples/s, and ``one_dead_throughput_share`` = phase 2 / phase 1;
3. B restarted on its port (same arguments, weight version 1) while the rollout runs:
   ``restart_to_serving_s`` = from the restart to the worker's first ``ServerUp`` for B on
   ``rl:control`` (the server answers ``/health_generate`` and reports the active version);
4. B SIGSTOPped once a generation of the rollout runs on it, SIGCONTed after the rollout is
   ready: ``stall_detect_s`` = from the SIGSTOP to the worker's first ``ServerDown`` naming B
   (the stalled turn is then retried on A), with ``stall_s`` as set.

Throughout: ``samples_lost`` = requested samples missing from the loaded rollouts plus samples
aborted with an infra class (``infra_conn``, ``infra_sandbox``, ``infra_other``), and
``infra_dummies_in_training`` = loaded samples whose termination reason is an infra class.
Samples/s on one host: the two servers share its cores, so a dead server frees CPU for the
other, and the share reads higher than it would with one accelerator per server.

    PYTHONPATH=$PWD python bench/server_faults.py [--samples-per-phase 96] [--stall-s 3]
        [--seed 0]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.agents.base import (  # noqa: E402
    AgentResult,
    BaseAgent,
    EpisodeContext,
    Reward,
    TurnRecord,
)
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason  # noqa: E402
from engine.events import (  # noqa: E402
    AbortClass,
    Event,
    PolicyVersionActivated,
    SampleAborted,
    ServerDown,
    ServerStale,
    ServerUp,
)
from engine.events.ids import id_ms  # noqa: E402

EVALUATOR = "policy"
PER_PROMPT = 4
BATCH_SIZE = 8
TURNS = 3
TOKENS = 16
ACTIVE = 1
INFRA = {AbortClass.INFRA_CONN, AbortClass.INFRA_SANDBOX, AbortClass.INFRA_OTHER}
INFRA_REASONS = {TerminationReason(c.value) for c in INFRA}
TIMINGS = {"heartbeat_ms": 500, "claim_idle_ms": 10_000, "block_ms": 200}


# -- the evaluator config (loaded by the scheduler and the worker) ---------------------------


class PolicyTurns(BaseAgent):
    """``TURNS`` generations of ``TOKENS`` tokens on the worker's policy servers, an
    observation token between them; reward: the sample's parity."""

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        assert context.backends is not None, "the worker has no policy servers"
        backend = context.backends.get()
        prompt = [1 + task.group_index % 7, 2, 3]
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns: list[TurnRecord] = []
        for t in range(TURNS):
            gen = await backend.generate(
                input_ids=prompt + response,
                sampling_params={"max_new_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True},
            )
            if gen.token_ids is None or gen.logprobs is None or gen.aborted:
                raise RuntimeError(f"{task.sample_id}: turn {t} returned no tokens: {gen}")
            n = len(gen.token_ids)
            response += [*gen.token_ids, 4]
            logprobs += [*gen.logprobs, 0.0]
            mask += [1] * n + [0]
            version = gen.weight_version if gen.weight_version is not None else -1
            versions += [version] * n + [-1]
            turns.append(
                TurnRecord(
                    index=t,
                    prompt_tokens=len(prompt) + len(response),
                    response_tokens=n,
                    weight_version=gen.weight_version,
                )
            )
        return AgentResult(
            prompt_token_ids=prompt,
            response_token_ids=response,
            response_logprobs=logprobs,
            loss_mask=mask,
            response_versions=versions,
            turns=tuple(turns),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return float(task.index % 2)


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id=EVALUATOR,
            resource=Resource(concurrency=BATCH_SIZE),
            batch_size=BATCH_SIZE,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    return {EVALUATOR: PolicyTurns()}


# -- the bench ------------------------------------------------------------------------------


def _control_events(kind: type[Event], url: str, after_s: float) -> Callable[[Any], bool]:
    def match(env: Any) -> bool:
        ev = env.event
        return (
            isinstance(ev, kind)
            and getattr(ev, "endpoint", None) == url
            and id_ms(env.id) / 1000 >= after_s
        )

    return match


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        from engine.client import RolloutClient
        from engine.ops.embedded import start_redis_server
        from engine.ops.processes import Processes
        from workers.cli import ROLLOUT

        self.args = args
        self.tmp = tmp
        self.redis = start_redis_server()
        self.procs = Processes(
            tmp / "logs",
            rollout=ROLLOUT,
            env={"PYTHONPATH": str(ROOT)},
            settings={"redis_url": self.redis.url, **TIMINGS},
            grace_s=10,
        )
        self.client = RolloutClient.connect(self.redis.url, block_ms=200)
        self.urls: dict[str, str] = {}
        self.seq = 0
        self.stopped: set[str] = set()

    def start(self) -> None:
        from engine.ops.tinylm import init_model

        t0 = time.perf_counter()
        model = self.tmp / "model"
        init_model(model, seed=self.args.seed, train_steps=0)
        print(f"tinylm built in {time.perf_counter() - t0:.1f}s", flush=True)
        for name in ("a", "b"):
            proc = self.procs.serve_tinylm(
                f"server_{name}",
                model,
                "--weight-version",
                str(ACTIVE),
                "--max-running-requests",
                str(self.args.server_slots),
            )
            self.urls[name] = proc.url
        n_prompts = 5 * self.args.samples_per_phase // PER_PROMPT + 1
        data = self.tmp / "prompts.jsonl"
        data.write_text(
            "".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(n_prompts))
        )
        (self.tmp / "rollout.yaml").write_text(
            "rollout:\n  datasets:\n"
            f"    bench: {{path: {data}, task_type: {EVALUATOR}, "
            f"n_samples_per_prompt: {PER_PROMPT}}}\n"
        )
        config = str(Path(__file__).resolve())
        quiet = ("--log-level", "WARNING")
        self.procs.start(
            "scheduler",
            "scheduler",
            "--rollout-config",
            str(self.tmp / "rollout.yaml"),
            "--evaluator-config",
            config,
            "--scheduler-id",
            "sf",
            *quiet,
        )
        self.procs.start(
            "worker",
            "worker",
            "--evaluator-config",
            config,
            "--worker-id",
            "w1",
            "--sandbox",
            "none",
            "--quiet",
            "--sglang-url",
            self.urls["a"],
            "--sglang-url",
            self.urls["b"],
            *quiet,
            settings={"stall_s": self.args.stall_s, "model_retry_backoff_s": 0.2},
        )
        self.procs.start("finalizer", "finalizer", "--worker-id", "fin", *quiet)

    async def activate(self) -> None:
        """What a weight sync leaves: version 1 active on both servers."""
        log = self.client.log
        await log.append(
            log.names.control,
            PolicyVersionActivated(version=ACTIVE, servers=list(self.urls.values())),
        )

    async def first(self, match: Callable[[Any], bool], timeout: float = 120.0) -> Any:
        """The first ``rl:control`` entry that ``match`` accepts, waiting for it."""
        log = self.client.log
        deadline = time.monotonic() + timeout
        while True:
            for env in await log.read_all(log.names.control):
                if match(env):
                    return env
            if time.monotonic() > deadline:
                raise TimeoutError("no matching event on rl:control")
            self.procs.check_alive()
            await asyncio.sleep(0.05)

    async def until_running(self, url: str, rid: str, timeout: float = 60.0) -> None:
        """Until a generation of rollout ``rid`` runs on the server (its ``running_rids``)."""
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as http:
            while time.monotonic() < deadline:
                info = (await http.get(url + "/get_server_info")).json()
                if any(r.startswith(f"{rid}:") for r in info.get("running_rids", [])):
                    return
                await asyncio.sleep(0.02)
        raise TimeoutError(f"no generation of {rid} ran on {url} within {timeout:.0f}s")

    async def request(self) -> tuple[str, float]:
        self.seq += 1
        n = self.args.samples_per_phase
        t0 = time.perf_counter()
        rid = await self.client.request(
            iteration=self.seq,
            n_prompts=n // PER_PROMPT,
            n_samples_per_prompt=PER_PROMPT,
            seed=self.args.seed,
            rollout_id=f"sf-{self.seq}",
        )
        return rid, t0

    async def finish(self, rid: str, t0: float) -> dict[str, Any]:
        """Wait for ``rid`` and load it (``wait_load``); the phase's figures."""
        ready, samples = await self.client.wait_load(rid, timeout=600)
        wall = time.perf_counter() - t0
        log = self.client.log
        aborts = {
            e.event.sample_id: e.event.abort_class
            for e in await log.read_all(log.names.rollout(rid))
            if isinstance(e.event, SampleAborted)
        }
        requested = self.args.samples_per_phase
        infra_aborted = sorted(s for s, c in aborts.items() if c in INFRA)
        infra_dummies = [s.sample_id for s in samples if s.termination_reason in INFRA_REASONS]
        return {
            "rollout_id": rid,
            "wall_s": round(wall, 2),
            "samples_per_s": round(ready.n_completed / wall, 3),
            "n_completed": ready.n_completed,
            "n_aborted": ready.n_aborted,
            "not_delivered": requested - len(samples),
            "infra_aborted": infra_aborted,
            "other_aborted": sorted(s for s, c in aborts.items() if c not in INFRA),
            "infra_dummies": infra_dummies,
            "version_tokens": ready.version_tokens,
        }

    async def phase_both_up(self) -> dict[str, Any]:
        rid, t0 = await self.request()
        return await self.finish(rid, t0)

    async def phase_one_dead(self) -> dict[str, Any]:
        b = self.urls["b"]
        rid, t0 = await self.request()
        await self.until_running(b, rid)
        killed = time.time()
        self.procs.kill("server_b")
        out = await self.finish(rid, t0)
        down = await self.first(_control_events(ServerDown, b, killed))
        out["kill_to_down_s"] = round(id_ms(down.id) / 1000 - killed, 3)
        out["down_reason"] = down.event.reason
        return out

    async def phase_restart(self) -> dict[str, Any]:
        b = self.urls["b"]
        rid, t0 = await self.request()
        await asyncio.sleep(0.5)  # the rollout is running on A when B comes back
        restarted = time.time()
        await asyncio.to_thread(self.procs.restart, "server_b")
        answering = time.time() - restarted
        up = await self.first(_control_events(ServerUp, b, restarted))
        out = await self.finish(rid, t0)
        stale = await self._any(_control_events(ServerStale, b, restarted))
        out.update(
            restart_to_serving_s=round(id_ms(up.id) / 1000 - restarted, 3),
            restart_to_http_s=round(answering, 3),
            up_weight_version=up.event.weight_version,
            stale_events=stale,
        )
        return out

    async def phase_stall(self) -> dict[str, Any]:
        b = self.urls["b"]
        rid, t0 = await self.request()
        await self.until_running(b, rid)
        stopped = time.time()
        self.procs.signal("server_b", signal.SIGSTOP)
        self.stopped.add("server_b")
        down = await self.first(_control_events(ServerDown, b, stopped))
        out = await self.finish(rid, t0)
        resumed = time.time()
        self.procs.signal("server_b", signal.SIGCONT)
        self.stopped.discard("server_b")
        up = await self.first(_control_events(ServerUp, b, resumed))
        out.update(
            stall_detect_s=round(id_ms(down.id) / 1000 - stopped, 3),
            down_reason=down.event.reason,
            cont_to_up_s=round(id_ms(up.id) / 1000 - resumed, 3),
        )
        return out

    async def _any(self, match: Callable[[Any], bool]) -> int:
        log = self.client.log
        return sum(1 for env in await log.read_all(log.names.control) if match(env))

    async def close(self) -> None:
        for name in list(self.stopped):
            with contextlib.suppress(Exception):
                self.procs.signal(name, signal.SIGCONT)
        with contextlib.suppress(Exception):
            await self.client.aclose()
        self.procs.stop()
        self.redis.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-server-faults-") as tmp_name:
        bench = Bench(args, Path(tmp_name))
        try:
            await asyncio.to_thread(bench.start)
            await bench.activate()
            started = time.perf_counter()
            phases: dict[str, dict[str, Any]] = {}
            for name, run in (
                ("warmup", bench.phase_both_up),
                ("both_up", bench.phase_both_up),
                ("one_dead", bench.phase_one_dead),
                ("restart", bench.phase_restart),
                ("stall", bench.phase_stall),
            ):
                phases[name] = await run()
                print(f"{name}: {json.dumps(phases[name])}", flush=True)
            phases_s = time.perf_counter() - started
        except BaseException:
            for name in bench.procs:
                print(f"--- {name} log (tail):\n  {bench.procs[name].tail(20)}", file=sys.stderr)
            raise
        finally:
            await bench.close()
    lost = sum(p["not_delivered"] + len(p["infra_aborted"]) for p in phases.values())
    dummies = sum(len(p["infra_dummies"]) for p in phases.values())
    return {
        "one_dead_throughput_share": round(
            phases["one_dead"]["samples_per_s"] / phases["both_up"]["samples_per_s"], 3
        ),
        "samples_lost": lost,
        "infra_dummies_in_training": dummies,
        "stall_s": args.stall_s,
        "stall_detect_s": phases["stall"]["stall_detect_s"],
        "restart_to_serving_s": phases["restart"]["restart_to_serving_s"],
        "samples_per_phase": args.samples_per_phase,
        "seed": args.seed,
        "server_slots": args.server_slots,
        "turns_per_sample": TURNS,
        "tokens_per_turn": TOKENS,
        "phases_s": round(phases_s, 1),
        "phases": phases,
        "targets": {
            "one_dead_throughput_share": 0.45,
            "samples_lost": 0,
            "infra_dummies_in_training": 0,
            "stall_detect_s": args.stall_s + 5,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--samples-per-phase", type=int, default=96)
    parser.add_argument("--stall-s", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--server-slots",
        type=int,
        default=4,
        help="each server's --max-running-requests (fewer than the worker's "
        "32 samples at once: the servers bound the throughput)",
    )
    args = parser.parse_args()
    if args.samples_per_phase % PER_PROMPT or args.samples_per_phase <= 0:
        parser.error(f"--samples-per-phase must be a positive multiple of {PER_PROMPT}")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
