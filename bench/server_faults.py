"""Model-server faults under a steady workload: two tinylm servers behind one worker.

The fault suite's setup (``tests/faults/server_harness.py``, ``ServerRig``) with one worker:
a real redis-server, the engine's scheduler, one evaluator worker bound to two tinylm
servers (``--sglang-url`` twice, ``--stall-s``) and one finalizer, all started by the engine's
launcher (``engine.ops.processes``); the servers report weight version 1 and
``PolicyVersionActivated(1)`` is on ``rl:control``, as a weight sync leaves them. The agent
(``tests/faults/policy.py``, re-exported here: this file is an evaluator config too) makes
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

With ``--scenario-seeds 1,2`` the fault suite's seeded scenario (``run_scenario``: kill one
server, stop one past ``stall_s``, kill both, restart one from older weights, under two
workers) runs after the phases on the same model, and each seed's report (its figures and
violated checks) goes under ``scenarios``.

    PYTHONPATH=$PWD python bench/server_faults.py [--samples-per-phase 96] [--stall-s 3]
        [--seed 0] [--scenario-seeds 1,2]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.events import SampleAborted, ServerDown, ServerStale, ServerUp  # noqa: E402
from engine.events.ids import id_ms  # noqa: E402
from tests.faults.policy import (  # noqa: E402
    EVALUATOR,
    TOKENS,
    TURNS,
    PolicyTurns,
    build_agents,
    evaluator_profiles,
)
from tests.faults.server_harness import (  # noqa: E402
    ACTIVE,
    INFRA,
    INFRA_REASONS,
    RigSpec,
    ServerRig,
    run_scenario,
)

__all__ = ["EVALUATOR", "PolicyTurns", "build_agents", "evaluator_profiles", "main_async"]

PER_PROMPT = 4


class Bench:
    def __init__(self, args: argparse.Namespace, rig: ServerRig) -> None:
        self.args = args
        self.rig = rig
        self.seq = 0

    async def request(self) -> tuple[str, float]:
        self.seq += 1
        n = self.args.samples_per_phase
        t0 = time.perf_counter()
        rid = await self.rig.client.request(
            iteration=self.seq,
            n_prompts=n // PER_PROMPT,
            n_samples_per_prompt=PER_PROMPT,
            seed=self.args.seed,
            rollout_id=f"sf-{self.seq}",
        )
        return rid, t0

    async def finish(self, rid: str, t0: float) -> dict[str, Any]:
        """Wait for ``rid`` and load it (``wait_load``); the phase's figures."""
        ready, samples = await self.rig.client.wait_load(rid, timeout=600)
        wall = time.perf_counter() - t0
        log = self.rig.client.log
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
        rid, t0 = await self.request()
        if not await self.rig.until_running("server_b", [rid]):
            raise TimeoutError(f"no generation of {rid} ran on server_b")
        killed = time.time()
        self.rig.procs.kill("server_b")
        out = await self.finish(rid, t0)
        down = await self.rig.first(ServerDown, "server_b", killed)
        out["kill_to_down_s"] = round(id_ms(down.id) / 1000 - killed, 3)
        out["down_reason"] = down.event.reason
        return out

    async def phase_restart(self) -> dict[str, Any]:
        rid, t0 = await self.request()
        await asyncio.sleep(0.5)  # the rollout is running on A when B comes back
        restarted = await asyncio.to_thread(self.rig.serve, "server_b", ACTIVE)
        answering = time.time() - restarted
        up = await self.rig.first(ServerUp, "server_b", restarted)
        out = await self.finish(rid, t0)
        stale = sum(1 for env in await self.rig.control()
                    if isinstance(env.event, ServerStale) and id_ms(env.id) / 1000 >= restarted
                    and env.event.endpoint == self.rig.urls["server_b"])  # fmt: skip
        out.update(
            restart_to_serving_s=round(id_ms(up.id) / 1000 - restarted, 3),
            restart_to_http_s=round(answering, 3),
            up_weight_version=up.event.weight_version,
            stale_events=stale,
        )
        return out

    async def phase_stall(self) -> dict[str, Any]:
        rid, t0 = await self.request()
        if not await self.rig.until_running("server_b", [rid]):
            raise TimeoutError(f"no generation of {rid} ran on server_b")
        stopped = time.time()
        self.rig.signal("server_b", signal.SIGSTOP)
        down = await self.rig.first(ServerDown, "server_b", stopped)
        out = await self.finish(rid, t0)
        resumed = time.time()
        self.rig.signal("server_b", signal.SIGCONT)
        up = await self.rig.first(ServerUp, "server_b", resumed)
        out.update(
            stall_detect_s=round(id_ms(down.id) / 1000 - stopped, 3),
            down_reason=down.event.reason,
            cont_to_up_s=round(id_ms(up.id) / 1000 - resumed, 3),
        )
        return out


async def _phases(args: argparse.Namespace, tmp: Path,
                  model: Path) -> tuple[dict[str, Any], float]:
    spec = RigSpec(stall_s=args.stall_s, server_slots=args.server_slots,
                   prompts=5 * args.samples_per_phase // PER_PROMPT + 1,
                   samples_per_prompt=PER_PROMPT)  # fmt: skip
    rig = ServerRig(tmp, model, spec)
    bench = Bench(args, rig)
    try:
        await asyncio.to_thread(rig.start)
        await rig.activate()
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
        return phases, time.perf_counter() - started
    except BaseException:
        for name in rig.procs:
            print(f"--- {name} log (tail):\n  {rig.procs[name].tail(20)}", file=sys.stderr)
        raise
    finally:
        await rig.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from engine.ops.tinylm import init_model

    scenarios: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-server-faults-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        init_model(tmp / "model", seed=args.seed, train_steps=0)
        print(f"tinylm built in {time.perf_counter() - t0:.1f}s", flush=True)
        phases, phases_s = await _phases(args, tmp, tmp / "model")
        for seed in getattr(args, "scenario_seeds", ()):
            report = await run_scenario(seed, tmp / "model", root=tmp / f"scenario-{seed}")
            scenarios.append(report.figures() | {"violated": report.violations})
            print(f"scenario {seed}: {json.dumps(scenarios[-1])}", flush=True)
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
        "scenarios": scenarios,
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
        "--scenario-seeds",
        type=lambda text: [int(s) for s in text.split(",") if s],
        default=[],
        help="comma-separated seeds of the fault suite's scenario to run after the phases "
        "(tests/faults/server_harness.py); their reports go under 'scenarios'",
    )
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
