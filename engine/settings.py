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
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from engine.domain import FrozenModel, check_identifier
from engine.errors import ConfigError
from engine.messages import explain, unknown_key_message

__all__ = ["ENV_PREFIX", "LogLevel", "Settings"]

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
    model_dir: Path | None = Field(
        None,
        description="The policy's Hugging Face folder (tokenizer, chat template), handed to "
        "the evaluator workers' build_agents(args) as args.model_dir.",
    )
    tmp_dir: Path | None = Field(
        None, description="Parent of per-episode temporary directories (unset: system temp)."
    )
    block_ms: int = Field(
        2_000,
        ge=1,
        description="How long a blocking stream read waits for new entries (the Redis socket "
        "timeout is derived from it, see engine.events.log.RedisSettings).",
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
    # -- outages (issue 11) --
    outage_limit_s: float = Field(
        300.0,
        gt=0,
        description="How long a process rides out an unreachable Redis (reconnecting with "
        "capped backoff) before it exits with a fatal error.",
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
                raise ConfigError(
                    f"environment: {unknown_key_message(key, declared)}; every variable the "
                    f"engine reads is declared in engine/settings.py"
                )
            if value != "":
                values[declared[key]] = value
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = [
                f"{env_name(key)} {problem}" if key else problem for key, problem in explain(exc)
            ]
            raise ConfigError("environment: " + "; ".join(problems)) from None

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
