"""The evaluator worker process: run admitted batches (``engine.actors.evaluator_worker``).

    rollout worker --redis-url redis://127.0.0.1:6379/0 \\
        --evaluator-config evaluators.py [--evaluators swe,math] [--max-batches 4]

Reads ``rl:work:{evaluator_id}`` for every evaluator the config defines (or those listed in
``--evaluators``) through the consumer group ``evaluators``. Prints a progress line per
finished batch on stdout. SIGTERM or SIGINT: no new batches; running ones get
``--grace-s`` to finish, the rest stay pending for another worker. Exit status 2: bad
settings or evaluator config; 1: Redis failed while serving.

The process owns the ports its episodes use: one backend pool (one pooled client per model
endpoint, the default being ``--sglang-url``) and one sandbox provider (``--sandbox``), both
built at start, handed to every episode and closed when the worker stops.

``--sandbox docker`` runs each sandbox as a container of ``--docker-image`` on the daemon the
environment names (``DOCKER_HOST``, as the docker CLI): network ``--docker-network`` (default
none), ``--docker-cpus`` CPUs (default: the largest ``run_resource.cpu`` of the served
evaluators), memory and pids from the agent's ``SandboxLimits`` or, when it gives none, memory
from the largest ``run_resource.memory_gb``. Containers carry the episode's labels, so the worker
that claims a dead worker's batch removes the containers it left. The worker exits with status 2
when the daemon does not answer or has no such image.

``--sglang-url`` may name several policy servers (repeat it, or separate URLs with commas;
``ROLLOUT_SGLANG_URL`` takes a comma-separated list too). The pool then keeps each trajectory
on one server, the least loaded when its first turn starts (``engine/backends/pool.py``), and
``build_agents(args)`` sees ``args.sglang_urls`` (all of them) and ``args.sglang_url`` set only
when there is exactly one, so agents that take it leave the choice to the pool.

With ``ROLLOUT_SERVERS_FROM_LOG`` (``--servers-from-log``) the policy servers are those
``rollout serve`` registered on ``rl:control``, followed live: the worker waits up to
``--outage-limit-s`` for the first, and each later registration or retirement changes its
pool's servers (``BackendPool.use_servers``); ``args.sglang_urls`` is then empty. Servers
registered in the ``eval`` role are followed the same way (``BackendPool.use_eval_servers``):
they run the eval rollouts pinned to their version.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.actors.evaluator_worker import BatchReport, EvaluatorWorker, WorkerConfig
from engine.actors.verify import VerifyPolicy
from engine.agents.binding import EvaluatorBinding
from engine.backends.base import ModelBackend
from engine.backends.pool import BackendPool, parse_urls
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.config.evaluators import load_evaluators
from engine.domain import Resource
from engine.errors import ConfigError, SandboxError
from engine.events.log import EventLog
from engine.sandbox.base import SandboxLimits, SandboxProvider
from engine.sandbox.docker import DockerSandboxConfig, DockerSandboxProvider
from engine.sandbox.local import LocalSandboxConfig, LocalSandboxProvider
from engine.settings import PROCESS, Flags, Settings
from workers._common import (
    Actor,
    consumer_name,
    follow_servers,
    serve_actor,
    servers_from_log,
    settings_parser,
    start,
)

__all__ = [
    "FLAGS", "Progress", "build_parser", "docker_config", "main", "policy_pool", "teacher_port"
]

logger = logging.getLogger("workers.evaluator")


FLAGS = Flags((
    *PROCESS, "max_deliveries", "evaluator_config", "evaluators", "max_batches", "grace_s",
    "sglang_url", "stall_s", "model_retries", "model_retry_backoff_s", "model_dir",
    "teacher_url", "teacher_tokenizer", "tmp_dir", "verify_fraction",
    "verify_threshold", "sandbox", "docker_image", "docker_network", "docker_cpus",
    "sandbox_root", "sandbox_require_isolation", "quiet", "servers_from_log",
))


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    return settings_parser(
        "rollout worker",
        "Run admitted batches' episodes and record them as events.",
        FLAGS,
        settings,
    )


class Progress:
    """The live progress printer: a line per finished batch with the running totals.

    It counts from each batch's report, not from a row per sample: building every sample's
    row in the worker only to count it is a measurable share of the worker's CPU."""

    def __init__(self, worker_id: str, *, out: Any = sys.stdout, quiet: bool = False) -> None:
        self.worker_id = worker_id
        self.out = out
        self.quiet = quiet
        self.completed = 0
        self.aborted = 0

    def on_batch_done(self, report: BatchReport) -> None:
        self.completed += report.completed
        self.aborted += report.aborted
        if self.quiet:
            return
        again = " (recovered)" if report.redelivered else ""
        print(
            f"[{self.worker_id}] batch {report.batch_id}{again}: {report.completed} completed, "
            f"{report.aborted} aborted | total {self.completed} completed, "
            f"{self.aborted} aborted",
            file=self.out,
            flush=True,
        )


def _select(specs: Mapping[str, EvaluatorBinding], wanted: str | None) -> tuple[str, ...]:
    if not wanted:
        return tuple(specs)
    ids = tuple(e.strip() for e in wanted.split(",") if e.strip())
    unknown = [e for e in ids if e not in specs]
    if unknown:
        raise ConfigError(f"--evaluators names {unknown}, not in the config ({sorted(specs)})")
    return ids


def _run_peak(specs: Mapping[str, EvaluatorBinding], ids: Sequence[str]) -> Resource:
    """The largest per-sample run resource of the served evaluators (field by field)."""
    peak = Resource()
    for evaluator_id in ids:
        peak = peak.peak(specs[evaluator_id].profile.run_resource)
    return peak


def docker_config(
    image: str | None,
    *,
    network: str = "none",
    cpus: float | None = None,
    run_resource: Resource | None = None,
) -> DockerSandboxConfig:
    """The Docker provider's settings: ``cpus`` (else ``run_resource.cpu``, no cap when 0) and,
    for sandboxes whose agent gives no limits, memory from ``run_resource.memory_gb``."""
    if not image:
        raise ConfigError("--sandbox docker needs --docker-image (or ROLLOUT_DOCKER_IMAGE)")
    resource = run_resource or Resource()
    if cpus is None and resource.cpu > 0:
        cpus = resource.cpu
    defaults = SandboxLimits()
    if resource.memory_gb > 0:
        defaults = SandboxLimits(memory_mb=max(16, round(resource.memory_gb * 1024)))
    return DockerSandboxConfig(
        image=image, network_mode=network, cpus=cpus, default_limits=defaults
    )


def _sandbox_provider(
    kind: str,
    root: Path | None,
    *,
    require_isolation: bool = False,
    docker: DockerSandboxConfig | None = None,
) -> SandboxProvider | None:
    """The worker's provider; says at start, loudly when it falls short, how sandboxes are
    contained. ``ConfigError`` when isolation is required and this machine cannot give it,
    or when ``kind`` is docker and ``docker`` is missing."""
    if kind == "none":
        return None
    if kind == "docker":
        if docker is None:
            raise ConfigError("--sandbox docker needs a Docker configuration")
        logger.info(
            "sandboxes: docker containers of %s, network %s, cpus %s, default limits %s",
            docker.image, docker.network_mode, docker.cpus, docker.default_limits,
        )
        return DockerSandboxProvider(docker)
    options: dict[str, Any] = {"require_isolation": require_isolation}
    if root is not None:
        options["root"] = root.resolve()
    provider = LocalSandboxProvider(LocalSandboxConfig(**options))
    containment = provider.containment
    if containment.isolated:
        logger.info("sandboxes: %s", containment.describe())
    else:
        logger.warning(
            "SANDBOXES ARE NOT ISOLATED: agent commands can reach what this worker can "
            "(Redis, the model server's admin endpoints): %s. Set "
            "ROLLOUT_SANDBOX_REQUIRE_ISOLATION=1 to refuse to start like this.",
            containment.describe(),
        )
    return provider


async def _serve(
    settings: Settings,
    args: argparse.Namespace,
    specs: Mapping[str, EvaluatorBinding],
    ids: tuple[str, ...],
    backends: BackendPool,
    provider: SandboxProvider | None,
) -> int:
    worker_id = consumer_name(settings, "evaluator")
    progress = Progress(worker_id, quiet=settings.quiet)
    config = WorkerConfig(
        worker_id=worker_id,
        evaluator_ids=ids,
        max_batches=settings.max_batches,
        heartbeat_ms=settings.heartbeat_ms,
        claim_idle_ms=settings.claim_idle_ms,
        block_ms=settings.block_ms,
        outage_limit_s=settings.outage_limit_s,
        grace_s=settings.grace_s,
        tmp_root=settings.tmp_dir,
        verify=VerifyPolicy(
            fraction=settings.verify_fraction, threshold=settings.verify_threshold
        ),
        model_retries=settings.model_retries,
        retry_backoff_s=settings.model_retry_backoff_s,
    )
    logger.info("worker %s serving %s", worker_id, ", ".join(ids))

    def build(log: EventLog) -> Actor:
        worker = EvaluatorWorker(log, specs, config, backends=backends, sandboxes=provider,
                                 on_batch_done=progress.on_batch_done)  # fmt: skip
        return _FollowingServers(worker, backends) if settings.servers_from_log else worker

    try:
        if isinstance(provider, DockerSandboxProvider):
            try:  # no daemon or no image: refuse to start rather than fail every episode
                await provider.ping()
            except SandboxError as exc:
                print(f"error: --sandbox docker: {exc}", file=sys.stderr)
                return 2
        return await serve_actor(settings, worker_id, build, logger=logger, what="worker")
    except ConfigError as exc:  # e.g. a model server with temperature-scaled logprobs
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await backends.aclose()
        if args.teacher is not None:  # the worker's teacher port, built in main
            await args.teacher.aclose()
        if isinstance(provider, LocalSandboxProvider | DockerSandboxProvider):
            provider.close()


class _FollowingServers:
    """The worker, with its pool's policy and eval servers those registered on
    ``rl:control``."""

    def __init__(self, worker: EvaluatorWorker, backends: BackendPool) -> None:
        self.worker = worker
        self.backends = backends

    async def run(self, stop: asyncio.Event) -> None:
        limit = self.worker.config.outage_limit_s
        async with follow_servers(self.worker.control, self.backends.use_servers,
                                  outage_limit_s=limit,
                                  use_eval=self.backends.use_eval_servers):  # fmt: skip
            await self.worker.run(stop)


def policy_urls(args: argparse.Namespace, settings: Settings) -> list[str]:
    """The policy servers of ``settings.sglang_url`` (flags repeated or comma-separated, else
    ``ROLLOUT_SGLANG_URL``), also set on ``args`` for ``build_agents(args)``: all of them as
    ``args.sglang_urls``, and ``args.sglang_url`` only when there is exactly one."""
    urls = list(parse_urls(settings.sglang_url))
    args.sglang_urls = urls
    args.sglang_url = urls[0] if len(urls) == 1 else None
    return urls


def policy_pool(urls: Sequence[str], settings: Settings) -> BackendPool:
    """The worker's pool of policy servers: streamed generations watched for ``--stall-s``,
    and turns that wait for a server for at most ``--outage-limit-s``."""

    def build(url: str) -> ModelBackend:
        return SGLangBackend(config=SGLangConfig(url=url, stall_s=settings.stall_s))

    return BackendPool(urls, build=build, outage_limit_s=settings.outage_limit_s)


def teacher_port(settings: Settings) -> TeacherBackend | None:
    """The worker's teacher (``--teacher-url``), like its student ``BackendPool``: built once,
    handed to ``build_agents`` as ``args.teacher``, closed when the worker stops."""
    if not settings.teacher_url:
        return None
    if settings.teacher_tokenizer is None:
        logger.warning(
            "--teacher-url without --teacher-tokenizer: the teacher cannot render a "
            "conversation, so DAgger turns get no label and the student's turn stands"
        )
    return TeacherBackend(
        config=TeacherConfig(url=settings.teacher_url, tokenizer_path=settings.teacher_tokenizer)
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = start(FLAGS, build_parser, argv)
    if started is None:
        return 2
    settings, args = started
    if settings.evaluator_config is None:
        print("error: --evaluator-config (or ROLLOUT_EVALUATOR_CONFIG) is required",
              file=sys.stderr)
        return 2
    try:
        servers_from_log(settings)
        policy_urls(args, settings)
        args.teacher = teacher_port(settings)
        specs = load_evaluators(settings.evaluator_config, args)
        ids = _select(specs, settings.evaluators)
        docker = None
        if settings.sandbox == "docker":
            docker = docker_config(
                settings.docker_image,
                network=settings.docker_network,
                cpus=settings.docker_cpus,
                run_resource=_run_peak(specs, ids),
            )
        provider = _sandbox_provider(
            settings.sandbox,
            settings.sandbox_root,
            require_isolation=settings.sandbox_require_isolation,
            docker=docker,
        )
        backends = policy_pool(args.sglang_urls, settings)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(settings, args, specs, ids, backends, provider))


if __name__ == "__main__":
    sys.exit(main())
