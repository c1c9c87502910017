"""``rollout demo``: a whole rollout through the event-sourced engine on one machine.

Embedded defaults, nothing to set up beyond ``pip install``:

* Redis: the one ``--redis-url`` or ``ROLLOUT_REDIS_URL`` names; else a ``redis-server`` on
  a free port when the binary exists, else fakeredis's TCP server (``engine.ops.embedded``);
* the policy: tinylm, built once into ``<workdir>/tinylm`` (``rollout tinylm init``) and
  served by its SGLang-compatible server, run by ``rollout serve`` (``engine.ops.serve``: a
  free port, restarted at the active version if it exits, registered on ``rl:control``,
  where the workers and the syncer find it);
* the bundled tasks (``engine/tasks``): arithmetic with a python tool and shell/file tasks
  checked by a script, run in the local sandbox;
* processes: ``rollout serve``, one scheduler, ``--workers`` evaluator workers, a finalizer
  and a weight syncer
  (``rollout sync``: a trainer may publish new weights to the stack, see
  ``examples/async_loop.py``), each a real process talking only through the streams.

It requests a mixed-dataset training rollout and then an eval pass through the trainer
client, shows live progress from the rollout stream, prints the summary table and where
the archive, ``summary.json`` and eval details are, says how to replay, and stops every
process it started (also on Ctrl-C, SIGTERM or an error). With ``--keep`` it leaves the
stack up after the rollouts and prints the exact ``rollout status / tail / replay / pool /
top`` commands for it, until Ctrl-C or SIGTERM. Progress (the model build, each rollout) is
a rich bar on a terminal and plain, never repeated lines elsewhere (``engine.ops.progress``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError, RolloutFailed
from engine.events import (
    EventLog,
    RolloutKind,
    RolloutPlanned,
    SampleAborted,
    SampleCompleted,
    StreamNames,
)
from engine.events.catalog.servers import ServerRegistered, ServerRole
from engine.events.ids import EMPTY_ID
from engine.events.redis_log import RedisSettings, open_log
from engine.ops.embedded import EmbeddedRedis, redact, start_redis
from engine.ops.processes import Processes
from engine.ops.progress import Bar

TASKS = Path(__file__).resolve().parents[1] / "tasks"  # engine/tasks
ROLLOUT_YAML = TASKS / "rollout.yaml"
EVALUATORS = TASKS / "evaluators.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rollout demo",
        description="Run a training rollout and an eval pass end to end on embedded defaults.",
    )
    p.add_argument("--workdir", type=Path, default=Path("runs/demo"),
                   help="where the model, logs, archives and outputs go (default runs/demo)")
    p.add_argument("--task", choices=["bundled", "swe"], default="bundled",
                   help="bundled: math and shell with the native tool agent; swe: tiny "
                        "repositories with a failing test, fixed by mini-swe-agent through the "
                        "recording proxy (needs pip install 'rollout-engine[scaffolds]')")
    p.add_argument("--prompts", type=int, default=None,
                   help="prompts in the training rollout (default 24 bundled: 16 math, then "
                        "shell, FIFO; 4 swe)")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="group size")
    p.add_argument("--workers", type=int, default=2, help="evaluator worker processes")
    p.add_argument("--verify-fraction", type=float, default=1.0,
                   help="share of samples re-scored on the model server (the verification "
                   "boundary, docs/sglang.md; default 1: every sample)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="tinylm training steps when the model is first built (default: tinylm's)")
    p.add_argument("--no-eval", action="store_true", help="skip the eval pass")
    p.add_argument("--seed", type=int, default=0, help="the request's seed")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait per rollout")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting one (default: ROLLOUT_REDIS_URL "
                        "when set, else an embedded redis-server on a free port)")
    p.add_argument("--keep", action="store_true",
                   help="keep Redis, the model server and every process up after the rollouts, "
                        "print the commands to inspect them, and stop on Ctrl-C or SIGTERM")
    return p


SERVE_GRACE_S = 5.0
"""``rollout serve``'s own grace for its servers, well inside the launcher's, so that serve
has stopped them (and retired them on the log) before the launcher would SIGKILL it."""


@dataclass
class Stack:
    """What the demo started: Redis (unless it is the user's) and the launcher holding the
    engine's processes (``rollout serve`` among them), so that all of it can be stopped."""

    workdir: Path
    processes: Processes
    redis: EmbeddedRedis | None = None
    redis_url: str = ""  # the engine's processes' URL (credentials included)
    trainer_url: str = ""  # the trainer's client: may only request and read
    model_dir: Path | None = None

    @classmethod
    def open(cls, workdir: Path, *, rollout: Sequence[str], redis_url: str | None) -> Stack:
        """A stack on ``redis_url``, or on an embedded Redis started now (an engine user for
        the processes, a trainer user for the client); its processes log to ``workdir/logs``."""
        redis = start_redis() if redis_url is None else None
        engine_url = redis.engine_url if redis is not None else str(redis_url)
        processes = Processes(workdir / "logs", rollout=rollout,
                              settings={"redis_url": engine_url})
        trainer_url = redis.trainer_url if redis is not None else engine_url
        return cls(workdir, processes, redis, engine_url, trainer_url)

    def check_alive(self) -> None:
        self.processes.check_alive()

    def serve(self, name: str, model_dir: Path, *server_args: str, supervisor: str,
              role: ServerRole = "policy", timeout_s: float = 600.0) -> str:
        """Start ``rollout serve`` as ``name`` (``supervisor`` on the log): one tinylm server
        for ``role`` on ``model_dir``, its log beside the others'. Returns its URL once serve
        registered it on ``rl:control``; ``EngineError`` with serve's last lines if it exits."""
        settings = {"model_dir": model_dir, "serve_role": role, "worker_id": supervisor,
                    "serve_log_dir": self.processes.logs, "grace_s": SERVE_GRACE_S}

        async def registered() -> str:
            log = open_log(RedisSettings(url=self.redis_url, block_ms=500),
                           names=StreamNames(), producer=f"{supervisor}-wait")
            try:
                position = await log.last_id(log.names.control)  # ours come after it
                self.processes.start(name, "serve", *(("--", *server_args) if server_args
                                                      else ()), settings=settings)
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    self.check_alive()
                    envs, position = await log.read_after(log.names.control, position,
                                                          block_ms=500)
                    for ev in (env.event for env in envs):
                        if isinstance(ev, ServerRegistered) and ev.supervisor == supervisor:
                            return ev.endpoint
            finally:
                await log.aclose()
            raise EngineError(f"{name} registered no server within {timeout_s:.0f}s; see "
                              f"{self.processes[name].log}")

        return asyncio.run(registered())

    def stop(self) -> None:
        self.processes.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def say(msg: str) -> None:
    print(msg, flush=True)


BUILD_SECONDS_PER_STEP = 0.3
"""Measured cost of one tinylm training step on a 2-core CPU, rounded up (0.24 s measured, see
docs/benchmarks.md); the demo multiplies it by the steps to say how long a build takes."""


def ensure_model(model_dir: Path, train_steps: int | None) -> None:
    if (model_dir / "config.json").is_file():
        say(f"model     tinylm at {model_dir} (built earlier)")
        return
    from engine.ops.tinylm import init_model
    from tinylm.model import DEFAULT_TRAIN_STEPS

    steps = DEFAULT_TRAIN_STEPS if train_steps is None else train_steps
    seconds = 10 + steps * BUILD_SECONDS_PER_STEP  # + tokenizer, corpus and saving
    took = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"
    say(f"model     building tinylm into {model_dir}: {steps} training steps, about "
        f"{took} on a 2-core CPU (once; later runs reuse it)")
    t0 = time.monotonic()
    with Bar("model") as bar:
        bar.update(0, steps or None, "tokenizer and corpus")

        def on_log(message: str) -> None:
            match = _STEP.search(message)
            if match:
                loss = _LOSS.search(message)
                bar.update(int(match[1]), int(match[2]), f"loss {loss[1]}" if loss else "")

        init_model(model_dir, train_steps=train_steps, log=on_log)
    say(f"model     built in {time.monotonic() - t0:.0f}s")


_STEP = re.compile(r"step (\d+)/(\d+)")
_LOSS = re.compile(r"loss ([0-9.]+)")


def redis_for(args: argparse.Namespace) -> str | None:
    """The Redis the user asked for (``--redis-url``, else ``ROLLOUT_REDIS_URL``), or None
    to start an embedded one. A misspelt ``ROLLOUT_*`` variable is refused here."""
    if args.redis_url:
        return str(args.redis_url)
    from engine.settings import Settings, env_name

    if os.environ.get(env_name("redis_url")):
        return Settings.from_env().redis_url
    Settings.from_env()  # refuses unknown variables before anything starts
    return None


def start_stack(args: argparse.Namespace, *, rollout: Sequence[str]) -> Stack:
    workdir: Path = args.workdir.resolve()
    for sub in ("logs", "out", "archives"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    url = redis_for(args)
    stack = Stack.open(workdir, rollout=rollout, redis_url=url)
    try:
        if stack.redis is not None:
            say(f"redis     {stack.redis.kind} at {redact(stack.redis_url)} (started for the "
                f"demo; set ROLLOUT_REDIS_URL or --redis-url to use your own)")
            if not stack.redis.authenticated:
                say("redis     WARNING: the fakeredis fallback has no authentication (see "
                    "docs/security.md); install redis-server for ACL users")
        else:
            say(f"redis     {redact(stack.redis_url)} (yours: from --redis-url / "
                f"ROLLOUT_REDIS_URL)")
        start_processes(stack, args)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_processes(stack: Stack, args: argparse.Namespace) -> None:
    rollout_yaml, evaluators = ROLLOUT_YAML, EVALUATORS
    if args.task == "swe":
        from engine.ops.swe_demo import SWE_EVALUATORS, SWE_ROLLOUT_YAML, ensure_swe_model

        rollout_yaml, evaluators = SWE_ROLLOUT_YAML, SWE_EVALUATORS
        model_dir = stack.workdir / "tinylm-swe"
        ensure_swe_model(model_dir, args.train_steps, say)
    else:
        model_dir = stack.workdir / "tinylm"
        ensure_model(model_dir, args.train_steps)
    stack.model_dir = model_dir
    procs = stack.processes
    policy = stack.serve("serve", model_dir, supervisor="demo-serve")
    say(f"policy    tinylm server at {policy} (run by rollout serve: restarted if it exits)")
    found = {"servers_from_log": True}  # the workers and the syncer find it on rl:control
    # The scheduler reads only the evaluator profiles: it needs no model.
    procs.start("scheduler", "scheduler", settings={
        "config": rollout_yaml, "evaluator_config": evaluators, "worker_id": "demo-scheduler"})
    for i in range(args.workers):
        procs.start(f"worker-{i}", "worker", settings={
            **found, "evaluator_config": evaluators, "model_dir": model_dir,
            "worker_id": f"demo-worker-{i}"})
    procs.start("finalizer", "finalizer", settings={
        "out_dir": stack.workdir / "out", "worker_id": "demo-finalizer"})
    procs.start("sync", "sync", settings={**found, "worker_id": "demo-sync"})
    say(f"processes serve, scheduler, {args.workers} evaluator workers, finalizer, weight syncer "
        f"(logs in {stack.workdir / 'logs'})")


async def follow(log: EventLog, stack: Stack, rollout_id: str, label: str) -> str | None:
    """Print live progress from the rollout stream until every sample is terminal.

    Returns the first abort's class and error, if any sample aborted, so the demo can say
    why instead of leaving the user to dig through the logs."""
    stream = log.names.rollout(rollout_id)
    total: int | None = None
    done: set[str] = set()
    completed = aborted = 0
    position = EMPTY_ID
    first_abort: str | None = None
    with Bar(label) as bar:
        while total is None or completed + aborted < total:
            stack.check_alive()
            envs, position = await log.read_after(stream, position, block_ms=500)
            for env in envs:
                ev = env.event
                if isinstance(ev, RolloutPlanned):
                    total = ev.n_samples
                elif isinstance(ev, SampleCompleted | SampleAborted) and ev.sample_id not in done:
                    done.add(ev.sample_id)
                    if isinstance(ev, SampleCompleted):
                        completed += 1
                    else:
                        aborted += 1
                        first_abort = first_abort or f"{ev.abort_class.value}: {ev.error}"
            bar.update(completed + aborted, total, f"{completed} completed, {aborted} aborted")
    return first_abort


def table(summary: dict[str, Any]) -> list[str]:
    classes = [c for c, n in summary["counts"].items() if n]
    head = f"  {'dataset':<14}{'n':>4}{'mean reward':>13}  " + "".join(f"{c:>18}" for c in classes)
    rows = [head, "  " + "-" * (len(head) - 2)]
    for name, ds in sorted(summary["datasets"].items()):
        rewards = [t["reward"] for t in summary["tasks"] if t["dataset"] == name]
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        rows.append(f"  {name:<14}{ds['n']:>4}{mean:>13.3f}  "
                    + "".join(f"{ds['counts'][c]:>18}" for c in classes))
        metrics = ", ".join(f"{k} {v:.3f}" for k, v in sorted(ds.get("metrics", {}).items()))
        if metrics:
            rows.append(f"  {'':<14}    {metrics}")
    return rows


async def run_rollout(
    stack: Stack, log: EventLog, args: argparse.Namespace, kind: RolloutKind, iteration: int
) -> str:
    import json

    from engine.client import RolloutClient
    from engine.ops.replay import archive_rollout

    client = RolloutClient(log)
    knobs = {"verify_fraction": args.verify_fraction}
    if kind is RolloutKind.TRAIN:
        prompts = args.prompts or (4 if args.task == "swe" else 24)
        rid = await client.request(iteration=iteration, n_prompts=prompts,
                                   n_samples_per_prompt=args.samples_per_prompt,
                                   seed=args.seed, kind=kind, knobs=knobs)
    else:
        rid = await client.request(iteration=iteration, n_prompts=1, seed=args.seed, kind=kind,
                                   knobs=knobs)
    say(f"\n{kind.value} rollout {rid} requested")
    t0 = time.monotonic()
    first_abort = await asyncio.wait_for(follow(log, stack, rid, kind.value), args.timeout)
    try:
        ready = await client.wait_ready(rid, timeout=args.timeout)
    except RolloutFailed as exc:
        raise EngineError(str(exc)) from exc
    elapsed = time.monotonic() - t0
    samples = await client.load(rid)
    out_dir = stack.workdir / "out" / rid
    summary_path = out_dir / "summary.json"
    deadline = time.monotonic() + 30
    while not summary_path.is_file():  # the finalizer writes it right after RolloutReady
        stack.check_alive()
        if time.monotonic() > deadline:
            raise EngineError(f"the finalizer wrote no {summary_path}")
        await asyncio.sleep(0.1)
    summary = json.loads(summary_path.read_text())
    archive = stack.workdir / "archives" / f"{rid}.rollout"
    await archive_rollout(log, rid, archive)
    n_tokens = sum(len(s.tokens) for s in samples)
    kept = "kept for training" if kind is RolloutKind.TRAIN else "kept"
    say(f"{kind.value} rollout {rid}: READY in {elapsed:.1f}s - {len(ready.sample_ids)} samples "
        f"{kept}, {len(ready.dropped_sample_ids)} dropped, {n_tokens} tokens")
    for line in table(summary):
        say(line)
    if ready.metrics.get("verify/selected"):
        m = ready.metrics
        say(f"  {'verified':<18} {m['verify/checked']:.0f} samples re-scored on the server "
            f"({m['verify/tokens']:.0f} tokens): max |delta logprob| "
            f"{m['verify/max_abs_delta']:.2g}")
    if first_abort is not None:
        say(f"  first abort  {first_abort[:300]}")
    say(f"  {'summary':<18} {summary_path}")
    for name in sorted(p.name for p in out_dir.iterdir() if p.name != "summary.json"):
        say(f"  {name:<18} {out_dir / name}")
    say(f"  {'archive':<18} {archive}")
    if args.task == "swe" and kind is RolloutKind.TRAIN:
        show_trajectory(stack, samples)
    replay_dir = stack.workdir / "replay" / rid
    say(f"  replay with: rollout replay {rid} --from {archive} --out {replay_dir}")
    return rid


def show_trajectory(stack: Stack, samples: Sequence[Any]) -> None:
    """One scaffold trajectory as the trainer got it: replies (mask 1) and observations."""
    from engine.backends.sglang import load_tokenizer
    from engine.ops.swe_demo import trajectory_lines

    captured = [s for s in samples if not s.remove_sample and s.response_length]
    if not captured or stack.model_dir is None:
        say("  no captured trajectory to show (every episode was aborted or dropped)")
        return
    tokenizer = load_tokenizer(stack.model_dir)
    best = max(captured, key=lambda s: float(s.reward if not isinstance(s.reward, dict)
                                               else s.reward.get("score", 0.0)))
    for line in trajectory_lines(best, lambda ids: tokenizer.decode(ids)):
        say(f"  {line}")


async def run(args: argparse.Namespace, stack: Stack) -> list[str]:
    log = open_log(RedisSettings(url=stack.trainer_url, block_ms=500), names=StreamNames(),
                   producer="demo")
    try:
        rids = [await run_rollout(stack, log, args, RolloutKind.TRAIN, iteration=0)]
        if not args.no_eval:
            rids.append(await run_rollout(stack, log, args, RolloutKind.EVAL, iteration=0))
    finally:
        await log.aclose()
    return rids


def _without_credentials(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}" if sep else url


def inspect_commands(redis_url: str, rids: Sequence[str], workdir: Path) -> list[str]:
    """The exact commands that inspect the kept stack, one per line (credentials come from
    the environment, see ``keep_up``, so no password is printed)."""
    at = f"--redis-url {_without_credentials(redis_url)}"
    lines = []
    for rid in rids:
        lines += [
            f"rollout status {rid} {at}",
            f"rollout tail --rollout {rid} --from-start {at}",
            f"rollout replay {rid} {at} --out {workdir / 'replay' / rid}",
        ]
    return [*lines, f"rollout pool {at}", f"rollout top {at}"]


def credentials_line(stack: Stack) -> str | None:
    """An ``export`` line giving the inspect commands the engine user's credentials through a
    0600 file in the workdir, so the password never reaches the terminal; None when the
    Redis needs none or is the user's own (their credentials are theirs to pass)."""
    if stack.redis is None or not stack.redis.authenticated:
        return None
    secret = stack.workdir / "redis-engine.secret"
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(stack.redis.passwords["engine"])
    return f"export ROLLOUT_REDIS_USERNAME=engine ROLLOUT_REDIS_PASSWORD_FILE={secret}"


def keep_up(stack: Stack, rids: Sequence[str]) -> None:
    """Leave everything running until Ctrl-C or SIGTERM, saying how to look at it."""
    say(f"\nthe stack is still up (--keep): Redis at {redact(stack.redis_url)}, "
        f"logs in {stack.workdir / 'logs'}. Inspect it with:")
    export = credentials_line(stack)
    if export is not None:
        say(f"  {export}")
    elif stack.redis is None:
        say("  (with your Redis credentials: ROLLOUT_REDIS_USERNAME / "
            "ROLLOUT_REDIS_PASSWORD_FILE, as for the engine's processes)")
    for line in inspect_commands(stack.redis_url, rids, stack.workdir):
        say(f"  {line}")
    say(f"stop it with Ctrl-C here, or: kill {os.getpid()}")
    while True:
        stack.check_alive()
        time.sleep(1.0)


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None, *, rollout: Sequence[str] = ()) -> int:
    """``rollout demo``; ``rollout``: the Python arguments that run the ``rollout`` command
    (``workers.cli.ROLLOUT``), through which the demo starts the engine's processes."""
    args = build_parser().parse_args(argv)
    if not rollout:
        print("error: the demo starts the engine's processes through the rollout command: "
              "run it as `rollout demo` (or python -m workers demo)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    stack: Stack | None = None
    kept = False
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the stack like Ctrl-C
    try:
        stack = start_stack(args, rollout=rollout)
        rids = asyncio.run(run(args, stack))
        if args.keep:
            kept = True
            keep_up(stack, rids)
    except KeyboardInterrupt:
        if not kept:
            say("\ninterrupted; stopping every process")
            return 130
        say("\nstopping the kept stack")
    except (EngineError, TimeoutError, OSError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.stop()
    say(f"\ndemo finished in {time.monotonic() - t0:.0f}s; every process stopped")
    return 0
