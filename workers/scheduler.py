"""The scheduler process: parse settings, load the configs, run ``engine.actors.scheduler``.

    rollout scheduler --redis-url redis://127.0.0.1:6379/0 \\
        --rollout-config rollout.yaml --evaluator-config evaluators.py \\
        [--cluster-layout '{"node-a": [0, 1, 2, 3]}'] [--env-num-cpus 96] [--env-memory-gb 384]

Every flag defaults to its ``ROLLOUT_*`` variable (``engine.settings``). The scheduler reads
only the evaluator profiles of ``--evaluator-config`` (``evaluator_profiles(args)``): it never
builds an agent or loads a tokenizer, so it needs no model. Bad input (rollout YAML, evaluator
config, cluster layout, a deadlock between a profile and the layout, settings, a dataset
whose ``task_type`` no evaluator profile serves, a dataset line that does not parse)
is reported on stderr at start-up, naming the file, node, evaluator and numbers at fault, and
the process exits with status 2 before touching Redis. SIGTERM or SIGINT stops it cleanly:
rollouts in flight stay pending in the ``schedulers`` group and are resumed from the log by
the next scheduler (a restart with the same ``--scheduler-id`` resumes them at once; another
scheduler claims them after ``--claim-idle-ms``). A Redis outage is ridden out (reads and
writes retried with capped backoff); exit status 1 only when Redis stays unreachable longer
than ``--outage-limit-s`` (``ROLLOUT_OUTAGE_LIMIT_S``) or refuses a command.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from engine.actors.planning import Planner
from engine.actors.scheduler import Scheduler, SchedulerConfig, check_layout
from engine.config.evaluators import load_profiles
from engine.config.layout import ClusterLayout, parse_cluster_layout
from engine.config.rollout import load_rollout_config
from engine.errors import ConfigError, DeadlockError, EngineError, LogError, OutageExceeded
from engine.events.names import StreamNames
from engine.events.redis_log import RedisSettings, open_log
from engine.runtime.consumer import ride_out
from engine.settings import PROCESS, Flags, Settings
from workers._common import consumer_name, settings_parser, start

__all__ = ["FLAGS", "GC_THRESHOLDS", "build_parser", "main", "tune_gc"]

logger = logging.getLogger("workers.scheduler")


GC_THRESHOLDS = (10_000, 10, 10)


def tune_gc() -> None:
    """Collect young objects every 10,000 allocations instead of Python's 700.

    Planning and admitting allocate some twenty short-lived, acyclic objects per sample
    (freed by reference counting). With the default threshold a 100k-sample plan triggers
    thousands of young collections and a dozen full ones that re-traverse the growing plan,
    making the per-sample cost grow with the rollout (bench/schedule.py measures both).
    """
    gc.set_threshold(*GC_THRESHOLDS)


FLAGS = Flags(
    (*PROCESS, "config", "root", "evaluator_config", "cluster_layout", "env_num_cpus",
     "env_memory_gb", "plan_chunk"),
    aliases={"worker_id": "--scheduler-id"},
)


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    return settings_parser(
        "rollout scheduler",
        "Plan requested rollouts and admit their batches through the event log.",
        FLAGS,
        settings,
    )


@dataclass(frozen=True)
class _Components:
    planner: Planner
    layout: ClusterLayout | None
    config: SchedulerConfig
    redis: RedisSettings
    names: StreamNames


def _build(settings: Settings, args: argparse.Namespace) -> _Components:
    """Load and validate every input; raises ConfigError / DeadlockError naming the fault."""
    if settings.config is None:
        raise ConfigError("--rollout-config (or ROLLOUT_CONFIG) is required")
    if settings.evaluator_config is None:
        raise ConfigError("--evaluator-config (or ROLLOUT_EVALUATOR_CONFIG) is required")
    rollout = load_rollout_config(settings.config, root=settings.root)
    profiles = load_profiles(settings.evaluator_config, args)
    layout = None
    if settings.cluster_layout:
        layout = parse_cluster_layout(
            settings.cluster_layout,
            default_cpu=settings.env_num_cpus,
            default_memory_gb=settings.env_memory_gb,
        )
    config = SchedulerConfig(
        scheduler_id=consumer_name(settings, "scheduler"),
        block_ms=settings.block_ms,
        heartbeat_ms=settings.heartbeat_ms,
        claim_idle_ms=settings.claim_idle_ms,
        outage_limit_s=settings.outage_limit_s,
        plan_chunk=settings.plan_chunk,
    )
    names = StreamNames(settings.stream_prefix)
    return _Components(Planner(rollout, profiles), layout, config, settings.redis(), names)


async def _serve(parts: _Components) -> int:
    log = open_log(
        parts.redis, names=parts.names, producer=f"scheduler:{parts.config.scheduler_id}"
    )
    scheduler = Scheduler(log, planner=parts.planner, layout=parts.layout, config=parts.config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await ride_out(scheduler.start, scheduler.consumer.backoff, what="scheduler start-up")
        logger.info(
            "scheduler %s serving %s (%s)",
            parts.config.scheduler_id,
            parts.names.control,
            "gated" if parts.layout else "ungated",
        )
        await scheduler.run(stop)
    except (DeadlockError, ConfigError) as exc:  # ConfigError: e.g. refused credentials
        print(f"scheduler: {exc}", file=sys.stderr)
        return 2
    except (LogError, OutageExceeded) as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return 1
    finally:
        await log.aclose()
    logger.info("scheduler %s stopped", parts.config.scheduler_id)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    started = start(FLAGS, build_parser, argv)
    if started is None:
        return 2
    settings, args = started
    try:
        parts = _build(settings, args)
        check_layout(parts.planner.specs, parts.layout)
        parts.planner.validate()  # task types served, every dataset line parses
    except EngineError as exc:
        print(f"scheduler: {exc}", file=sys.stderr)
        return 2
    tune_gc()
    return asyncio.run(_serve(parts))


if __name__ == "__main__":
    sys.exit(main())
