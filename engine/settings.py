"""Every environment variable the project reads, declared once with its type, default and help.

A field ``foo_bar`` is read from ``ROLLOUT_FOO_BAR``. ``Settings.from_env(environ)`` is the only
place that looks at the environment; components receive the parsed values they need as typed
arguments. Rules:

- An empty value counts as unset (compose files often write ``VAR=``).
- A ``ROLLOUT_*`` variable that is not declared here is refused, so a misspelt name fails loudly
  instead of silently leaving the default in force.
- Per-iteration knobs (DAgger beta, t_max, seeds) are event fields, never variables here.

``Settings.describe()`` renders the table for ``--help`` output and the docs.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Iterable, Mapping
from difflib import get_close_matches
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from engine.domain import FrozenModel, check_identifier
from engine.errors import ConfigError
from engine.events.redis_settings import RedisSettings
from engine.messages import explain

__all__ = ["ENV_PREFIX", "LogLevel", "Settings", "unknown_variable_message"]

ENV_PREFIX = "ROLLOUT_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class Settings(FrozenModel):
    """Process-level settings; see the module docstring for how they are read."""

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis server that holds the event streams."
    )
    stream_prefix: str = Field("rl", description="Prefix of every stream and key name.")
    root: Path | None = Field(
        None,
        description="Anchor of relative dataset paths in the rollout YAML "
        "(unset: the YAML file's directory).",
    )
    config: Path | None = Field(None, description="The rollout YAML (datasets, eval datasets).")
    evaluator_config: Path | None = Field(
        None, description="Python file exposing evaluator_profiles(args) and build_agents(args)."
    )
    cluster_layout: str | None = Field(
        None,
        description="Cluster layout as inline JSON or a file path (unset: batches run ungated).",
    )
    env_num_cpus: float | None = Field(
        None, gt=0, description="CPUs of a layout node that does not state 'cpu'."
    )
    env_memory_gb: float | None = Field(
        None, gt=0, description="Memory (GB) of a layout node that does not state 'memory_gb'."
    )
    log_level: LogLevel = Field("INFO", description="Logging level of engine processes.")
    worker_id: str | None = Field(
        None, description="Consumer name of this worker in its groups (unset: host-pid)."
    )
    sglang_url: str | None = Field(
        None, description="Base URL of the student SGLang server or router."
    )
    sglang_admin_key_file: Path | None = Field(
        None,
        description="File holding the model servers' admin key (SGLang's --admin-api-key); "
        "read by the weight syncer only, never by evaluator workers.",
    )
    model_dir: Path | None = Field(
        None,
        description="The policy's Hugging Face folder (tokenizer, chat template), handed to "
        "the evaluator workers' build_agents(args) as args.model_dir.",
    )
    tmp_dir: Path | None = Field(
        None, description="Parent of per-episode temporary directories (unset: system temp)."
    )
    # -- the teacher (docs/trainers.md, "Teacher lanes") ---------------------------------
    teacher_url: str | None = Field(
        None,
        description="Base URL of the teacher's SGLang server: evaluator workers hand it to "
        "build_agents(args) as args.teacher (DAgger labels), capture workers force-decode on it.",
    )
    teacher_tokenizer: Path | None = Field(
        None,
        description="The teacher's Hugging Face folder (its tokenizer and chat template; "
        "unset: the server's own tokenization is not used and labels need it).",
    )
    # -- analysis dumps of the finalizer (docs/trainers.md, "Analysis dumps") ------------
    distill_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration OPD discrepancy dump (teacher and student "
        "logprobs, action mask) of per-token-lane rollouts (unset: off).",
    )
    mixed_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration mixed-loss dump (sentinel'd teacher "
        "logprobs, is-teacher mask) of mixed-lane rollouts (unset: off).",
    )
    student_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration student dump of eval rollouts (one .pt "
        "per finished sample and a manifest.json; unset: off).",
    )
    block_ms: int = Field(
        2_000,
        ge=1,
        description="How long a blocking stream read waits for new entries (the Redis socket "
        "timeout is derived from it, see engine.events.redis_settings.RedisSettings).",
    )
    heartbeat_ms: int = Field(
        10_000,
        ge=1,
        description="How often a busy worker proves it is alive by refreshing its claims.",
    )
    claim_idle_ms: int = Field(
        60_000,
        ge=1,
        description="Idle time after which another worker claims a pending entry; must "
        "exceed the heartbeat.",
    )
    max_deliveries: int = Field(
        3,
        ge=1,
        description="Deliveries after which an entry is dead-lettered and its samples are "
        "aborted as infra_other.",
    )
    # -- security (docs/security.md) ----------------------------------------------------
    sandbox_require_isolation: bool = Field(
        False,
        description="Evaluator workers refuse to start unless local sandboxes get their own "
        "network namespace and uid (unset: they start and log a warning).",
    )
    # -- sandboxes of evaluator workers (docs/configuration.md#sandboxes) ----------------
    sandbox: Literal["local", "docker", "none"] = Field(
        "local",
        description="Sandbox provider of evaluator workers: local processes, Docker "
        "containers, or none.",
    )
    docker_image: str | None = Field(
        None,
        description="Image of the Docker sandboxes (needs /bin/sh and sleep; required with "
        "sandbox=docker).",
    )
    docker_network: str = Field(
        "none", description="Network mode of the Docker sandboxes (default: no network)."
    )
    docker_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs per Docker sandbox (unset: the largest run_resource.cpu of the "
        "served evaluators, no cap when that is 0).",
    )
    redis_username: str | None = Field(
        None, description="ACL user of the Redis connection (unset: the URL's, else default)."
    )
    redis_password_file: Path | None = Field(
        None,
        description="File holding the Redis password (keep it mode 0600; unset: the URL's).",
    )
    redis_tls_ca_file: Path | None = Field(
        None, description="CA certificate that signs the Redis server's (rediss:// URLs)."
    )
    redis_tls_cert_file: Path | None = Field(
        None, description="Client certificate for Redis TLS (when the server asks for one)."
    )
    redis_tls_key_file: Path | None = Field(
        None, description="Private key of redis_tls_cert_file."
    )

    # -- metrics (engine.metrics): every process serves Prometheus /metrics when a port is set
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port on which this process serves Prometheus /metrics (unset: off). "
        "Give each process on a host its own port.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the /metrics server binds (0.0.0.0 exposes it to the network).",
    )
    # -- outages (docs/architecture.md, "Deliveries, outages and leases") --
    outage_limit_s: float = Field(
        300.0,
        gt=0,
        description="How long a process rides out an unreachable Redis (reconnecting with "
        "capped backoff) before it exits with a fatal error.",
    )
    # -- verification boundary (engine/actors/verify.py, docs/sglang.md) --
    verify_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of completed samples an evaluator worker re-scores on their model "
        "server (chosen by sample id; a request's verify_fraction knob overrides it).",
    )
    verify_threshold: float = Field(
        1e-3,
        ge=0.0,
        description="Largest |delta logprob| a re-scored sample may show before its rollout "
        "fails (a request's verify_threshold knob overrides it).",
    )
    # -- retention (docs/operations.md, "Retention and Redis memory"): `rollout retention` --
    retention_store: Path | None = Field(
        None, description="Directory `rollout retention` archives finished rollouts to."
    )
    retention_keep_s: float = Field(
        3600.0,
        ge=0,
        description="Retention window: `rollout retention` keeps finished rollouts and acked "
        "shared-stream entries younger than this in Redis.",
    )

    @field_validator("stream_prefix")
    @classmethod
    def _prefix_is_a_name(cls, value: str) -> str:
        return check_identifier(value)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _timings_compose(self) -> Settings:
        if self.heartbeat_ms >= self.claim_idle_ms:
            raise ValueError(
                f"{env_name('heartbeat_ms')} ({self.heartbeat_ms}) must be below "
                f"{env_name('claim_idle_ms')} ({self.claim_idle_ms}), or live workers lose "
                f"their entries to claims"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse the declared variables from ``environ`` (default: ``os.environ``).

        Raises ``ConfigError`` naming the variable for an undeclared ``ROLLOUT_*`` name or a
        value of the wrong type.
        """
        env = os.environ if environ is None else environ
        declared = {env_name(name): name for name in cls.model_fields}
        values: dict[str, str] = {}
        for key, value in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            if key not in declared:
                raise ConfigError(f"environment: {unknown_variable_message(key, declared)}")
            if value != "":
                values[declared[key]] = value
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = [
                f"{env_name(key)} {problem}" if key else problem for key, problem in explain(exc)
            ]
            raise ConfigError("environment: " + "; ".join(problems)) from None

    def redis(self, *, url: str | None = None, block_ms: int | None = None) -> RedisSettings:
        """Connection settings for the engine's own processes: ``url`` (default
        ``redis_url``) plus the credentials and TLS files set here. Reads the password file;
        ``ConfigError`` names it when it cannot."""
        password: str | None = None
        if self.redis_password_file is not None:
            try:
                password = self.redis_password_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(
                    f"{env_name('redis_password_file')}: cannot read "
                    f"{self.redis_password_file}: {exc.strerror}"
                ) from exc
            if not password:
                raise ConfigError(
                    f"{env_name('redis_password_file')}: {self.redis_password_file} is empty"
                )

        def path(value: Path | None) -> str | None:
            return None if value is None else str(value)

        return RedisSettings(
            url=url or self.redis_url,
            block_ms=self.block_ms if block_ms is None else block_ms,
            username=self.redis_username,
            password=password,
            tls_ca_file=path(self.redis_tls_ca_file),
            tls_cert_file=path(self.redis_tls_cert_file),
            tls_key_file=path(self.redis_tls_key_file),
        )

    @classmethod
    def describe(cls) -> str:
        """One line per variable: name, type, default, help."""
        lines = []
        for name, info in cls.model_fields.items():
            default = "unset" if info.default is None else repr(info.default)
            lines.append(
                f"{env_name(name):<32} {_type_name(info.annotation):<12} "
                f"default {default:<28} {info.description}"
            )
        return "\n".join(lines)


def unknown_variable_message(key: str, declared: Iterable[str]) -> str:
    """``unknown key 'ROLLOUT_REDIS_ULR' (did you mean 'ROLLOUT_REDIS_URL'?)``: the
    variable, up to three close matches (or every declared name), and where they live."""
    names = sorted(declared)
    close = get_close_matches(key, names, n=3, cutoff=0.75)
    if close:
        hint = "did you mean " + " or ".join(repr(c) for c in close) + "?"
    else:
        hint = "declared: " + ", ".join(names)
    return (
        f"unknown key {key!r} ({hint}); every variable the engine reads is declared in "
        f"engine/settings.py (`rollout env` lists them), and an unknown one is refused "
        f"rather than ignored"
    )


def env_name(field_name: str) -> str:
    """The variable a settings field is read from."""
    return ENV_PREFIX + field_name.upper()


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return " | ".join(names)
    if origin is Literal:
        return "|".join(str(arg) for arg in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation)).lower()
