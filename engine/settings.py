"""Every setting the engine reads, declared once: a ``ROLLOUT_*`` variable and a flag.

A field ``foo_bar`` is read from ``ROLLOUT_FOO_BAR``; its type, default and help are the
field's. ``Settings.from_env(environ)`` is the only place that looks at the environment, and a
command's flags are generated from the same fields by ``Flags``: ``--foo-bar`` (and the field's
``Flag.alias``) defaults to the variable's value and carries its help. An empty value counts
as unset; an undeclared ``ROLLOUT_*`` variable is refused (a misspelt name fails loudly);
values from the environment and from flags are validated by this one model, so a rule that
spans settings is checked once. Credentials come from the environment only, never from argv,
which other local users can read. Per-iteration knobs are event fields, never variables.
``Settings.describe()`` is what ``rollout env`` prints; ``Settings.markdown()`` is the table of
docs/configuration.md.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from engine.domain import FrozenModel, check_identifier
from engine.errors import ConfigError
from engine.events.redis_settings import RedisSettings
from engine.messages import explain

__all__ = [
    "CONNECTION",
    "ENV_PREFIX",
    "PROCESS",
    "Flag",
    "Flags",
    "LogLevel",
    "Settings",
    "env_name",
    "unknown_variable_message",
]

ENV_PREFIX = "ROLLOUT_"

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


@dataclass(frozen=True)
class Flag:
    """How a setting appears on command lines besides its ``--foo-bar``."""

    alias: str | None = None
    """A second spelling, named first in help and messages (``--prefix``)."""
    repeat: bool = False
    """A comma-separated list: the flag may be repeated; its values are joined with commas."""
    env_only: bool = False
    """A credential: read from the environment only, never a flag."""


ENV_ONLY = Flag(env_only=True)


class Settings(FrozenModel):
    """Process-level settings; see the module docstring for how they are read."""

    # -- the log --------------------------------------------------------------------------
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis holding the streams (redis://host:port/db; a Redis Cluster: "
        "redis+cluster://host:port).",
    )
    stream_prefix: Annotated[str, Flag(alias="--prefix")] = Field(
        "rl", description="Prefix of every stream and key name; one per experiment."
    )
    redis_username: Annotated[str | None, ENV_ONLY] = Field(
        None, description="ACL user of the Redis connection (unset: the URL's, else default)."
    )
    redis_password_file: Annotated[Path | None, ENV_ONLY] = Field(
        None, description="File holding the Redis password (keep it mode 0600; unset: the URL's)."
    )
    redis_tls_ca_file: Annotated[Path | None, ENV_ONLY] = Field(
        None, description="CA certificate that signs the Redis server's (rediss:// URLs)."
    )
    redis_tls_cert_file: Annotated[Path | None, ENV_ONLY] = Field(
        None, description="Client certificate for Redis TLS (when the server asks for one)."
    )
    redis_tls_key_file: Annotated[Path | None, ENV_ONLY] = Field(
        None, description="Private key of redis_tls_cert_file."
    )
    # -- every process ----------------------------------------------------------------------
    worker_id: str | None = Field(
        None,
        description="Consumer name of this process in its group; a restarted process with the "
        "same name resumes its own pending entries (unset: role-host-pid).",
    )
    block_ms: int = Field(
        2_000, ge=1, description="How long a blocking stream read waits for new entries."
    )
    heartbeat_ms: int = Field(
        10_000, ge=1, description="How often a busy process refreshes its claims."
    )
    claim_idle_ms: int = Field(
        60_000,
        ge=1,
        description="Idle time after which another process claims a pending entry; must "
        "exceed the heartbeat.",
    )
    max_deliveries: int = Field(
        3,
        ge=1,
        description="Deliveries after which an entry is dead-lettered and its samples are "
        "aborted as infra_other.",
    )
    outage_limit_s: float = Field(
        300.0,
        gt=0,
        description="How long a process rides out an unreachable Redis (reconnecting with "
        "capped backoff) before it exits with a fatal error.",
    )
    log_level: LogLevel = Field("INFO", description="Logging level (DEBUG shows every request).")
    metrics_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of this process's Prometheus /metrics (unset: off); one per process "
        "on a host.",
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address /metrics binds (0.0.0.0 exposes it to the network)."
    )
    grace_s: float = Field(
        30.0, ge=0, description="Time running batches (worker) or a running sync get on SIGTERM."
    )
    # -- the scheduler ----------------------------------------------------------------------
    config: Annotated[Path | None, Flag(alias="--rollout-config")] = Field(
        None, description="The rollout YAML (datasets, eval datasets)."
    )
    root: Path | None = Field(
        None,
        description="Anchor of relative dataset paths in the rollout YAML "
        "(unset: the YAML file's directory).",
    )
    evaluator_config: Path | None = Field(
        None,
        description="Python file exposing evaluator_profiles(args) (scheduler, workers) and "
        "build_agents(args) (workers).",
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
    plan_chunk: int = Field(
        4_096, ge=2, description="Rollout-stream events per atomic append when writing a plan."
    )
    # -- evaluator workers ------------------------------------------------------------------
    evaluators: str | None = Field(
        None, description="Comma-separated evaluator ids a worker serves (unset: every one)."
    )
    max_batches: int = Field(4, ge=1, description="Batches a worker runs at once.")
    sglang_url: Annotated[str | None, Flag(repeat=True)] = Field(
        None,
        description="The policy's model servers or router, comma-separated (the flag may be "
        "repeated); each trajectory stays on one. rollout sync loads weights on them.",
    )
    stall_s: float = Field(
        20.0,
        gt=0,
        description="A policy generation (streamed) that receives nothing for this long, from "
        "a server that then fails /health_generate, is stalled: aborted and retried elsewhere.",
    )
    model_retries: int = Field(
        4,
        ge=0,
        description="Retries per sample of model-server failures (a turn sent again or the "
        "attempt re-run); past them the sample is aborted naming the servers tried.",
    )
    model_retry_backoff_s: float = Field(
        0.5,
        ge=0,
        description="Pause before a sample's first model-server retry; it doubles per retry "
        "(at most 10 s).",
    )
    model_dir: Path | None = Field(
        None,
        description="The policy's Hugging Face folder (tokenizer, chat template), handed to "
        "build_agents(args) as args.model_dir.",
    )
    tmp_dir: Path | None = Field(
        None, description="Parent of per-episode temporary directories (unset: system temp)."
    )
    quiet: bool = Field(False, description="A worker prints no line per finished batch.")
    verify_fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of completed samples a worker re-scores on their model server "
        "(chosen by sample id; a request's verify_fraction knob overrides it).",
    )
    verify_threshold: float = Field(
        1e-3,
        ge=0.0,
        description="Largest |delta logprob| a re-scored sample may show before its rollout "
        "fails (a request's verify_threshold knob overrides it).",
    )
    # -- sandboxes of evaluator workers (docs/configuration.md, "Docker sandboxes") ---------
    sandbox: Literal["local", "docker", "none"] = Field(
        "local", description="Sandbox provider: local processes, Docker containers, or none."
    )
    sandbox_root: Path | None = Field(
        None, description="Directory of local sandboxes (workers that reap each other share it)."
    )
    sandbox_require_isolation: Annotated[bool, Flag(alias="--require-isolation")] = Field(
        False,
        description="Refuse to start unless local sandboxes get their own network namespace "
        "and uid (off: start and log a warning).",
    )
    docker_image: str | None = Field(
        None, description="Image of Docker sandboxes (needs /bin/sh and sleep; sandbox=docker)."
    )
    docker_network: str = Field("none", description="Network mode of Docker sandboxes.")
    docker_cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs per Docker sandbox (unset: the largest run_resource.cpu of the "
        "served evaluators, no cap when that is 0).",
    )
    # -- the teacher (docs/trainers.md, "Teacher lanes") ------------------------------------
    teacher_url: str | None = Field(
        None,
        description="The teacher's SGLang server: workers hand it to build_agents(args) as "
        "args.teacher (DAgger labels), capture workers force-decode on it.",
    )
    teacher_tokenizer: Path | None = Field(
        None, description="The teacher's Hugging Face folder (tokenizer and chat template)."
    )
    capture_concurrency: Annotated[int, Flag(alias="--concurrency")] = Field(
        8, ge=1, description="Samples a capture worker scores at once."
    )
    capture_max_tries: Annotated[int, Flag(alias="--max-tries")] = Field(
        3, ge=1, description="Tries per sample of a capture worker."
    )
    # -- the finalizer (artifacts; docs/trainers.md, "Analysis dumps") ----------------------
    out_dir: Path | None = Field(
        None, description="The finalizer writes each ready rollout's artifacts to OUT_DIR/ID/."
    )
    teacher_top_k: Annotated[int, Flag(alias="--top-k")] = Field(
        20, ge=1, description="Teacher top-K logprobs the finalizer asks capture for."
    )
    distill_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration OPD discrepancy dump of per-token-lane "
        "rollouts (unset: off).",
    )
    mixed_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration mixed-loss dump of mixed-lane rollouts "
        "(unset: off).",
    )
    student_dump_dir: Path | None = Field(
        None,
        description="Directory of the per-iteration student dump of eval rollouts (unset: off).",
    )
    stall_window_s: float = Field(
        300.0,
        ge=0,
        description="A rollout whose stream gets no new entry for this long gets a "
        "RolloutStalled naming what it waits for, again every window (0: off).",
    )
    # -- retention (docs/operations.md, "Retention and Redis memory") -----------------------
    work_dir: Path = Field(
        Path("runs"),
        description="Directory of the engine's files on this host: the finalizer archives "
        "finished rollouts to WORK_DIR/archive unless retention_store is set.",
    )
    retention: bool = Field(
        True,
        description="The finalizer runs retention passes (archive and delete finished "
        "rollouts, trim rl:control, rl:work, rl:capture, rl:pool, rl:data, rl:dead).",
    )
    retention_store: Path | None = Field(
        None,
        description="Directory finished rollouts are archived to (unset: WORK_DIR/archive).",
    )
    retention_keep_s: float = Field(
        3600.0,
        ge=0,
        description="Retention window: finished rollouts and acked shared-stream entries "
        "younger than this stay in Redis.",
    )
    retention_every_s: float = Field(
        60.0, gt=0, description="Seconds between two retention passes of a finalizer."
    )
    retention_dead_max: int = Field(
        10_000,
        ge=0,
        description="Dead letters rl:dead keeps; older ones are trimmed, and their seen-set "
        "marks once the entries they name are gone.",
    )
    # -- the weight syncer (docs/operations.md, "Weight sync") ------------------------------
    sglang_admin_key_file: Annotated[Path | None, ENV_ONLY] = Field(
        None,
        description="File holding the model servers' admin key (SGLang's --admin-api-key); "
        "read by the weight syncer only, never by evaluator workers.",
    )
    park_timeout_s: float = Field(
        120.0, ge=0, description="How long a sync waits for live workers to park."
    )
    live_window_ms: int | None = Field(
        None, ge=1, description="A worker silent on its work streams for longer is not waited "
        "for by a sync (unset: the claim window).",
    )
    sync_interrupt: bool = Field(True, description="A sync aborts the turns in flight and "
                                 "continues them on the new weights instead of waiting for them.")
    # -- rollout serve ----------------------------------------------------------------------
    serve_backend: Literal["tinylm", "sglang"] = Field(
        "tinylm", description="What rollout serve runs: tinylm on CPU or SGLang's launch_server."
    )
    serve_count: int = Field(1, ge=1, description="Model servers rollout serve starts.")
    serve_role: Literal["policy", "teacher", "eval"] = Field("policy", description="What rollout "
        "serve's servers serve (a teacher or an eval server stays at --model, never synced).")
    serve_weight_version: int | None = Field(None, ge=0, description="An eval server's version.")
    serve_host: str = Field("127.0.0.1", description="Address rollout serve's servers bind.")
    serve_port: int | None = Field(
        None, ge=1, le=65535, description="Port of rollout serve's first server, the next ones "
        "counting up (unset: free ports); kept across restarts either way.",
    )
    serve_args: str | None = Field(
        None, description="SGLang server arguments for every server (shell words; checked "
        "against SGLang's ServerArgs at start), before those after `--`.",
    )
    serve_backoff_s: float = Field(
        1.0, gt=0, description="First wait before restarting a server that exited; doubles."
    )
    serve_backoff_max_s: float = Field(
        30.0, gt=0, description="Cap of the restart wait; a server up this long starts over."
    )
    serve_log_dir: Path | None = Field(
        None, description="Folder of the servers' logs (<name>.log; unset: a new temporary one)."
    )
    servers_from_log: bool = Field(
        False, description="Workers and the syncer follow the policy servers rollout serve "
        "registers on rl:control, live, instead of --sglang-url.",
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
                f"their entries to claims (flags --heartbeat-ms, --claim-idle-ms)"
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

    def redis(self, *, block_ms: int | None = None) -> RedisSettings:
        """Connection settings for the engine's own processes: ``redis_url`` plus the
        credentials and TLS files set here. Reads the password file; ``ConfigError`` names it
        when it cannot."""
        password: str | None = None
        if self.redis_password_file is not None:
            password = _read_secret("redis_password_file", self.redis_password_file)

        def path(value: Path | None) -> str | None:
            return None if value is None else str(value)

        return RedisSettings(
            url=self.redis_url,
            block_ms=self.block_ms if block_ms is None else block_ms,
            username=self.redis_username,
            password=password,
            tls_ca_file=path(self.redis_tls_ca_file),
            tls_cert_file=path(self.redis_tls_cert_file),
            tls_key_file=path(self.redis_tls_key_file),
        )

    def archive_dir(self) -> Path:
        """Where finished rollouts are archived: ``retention_store``, else WORK_DIR/archive."""
        return self.retention_store or self.work_dir / "archive"

    def admin_key(self) -> str | None:
        """The model servers' admin key from ``sglang_admin_key_file``, if set."""
        path = self.sglang_admin_key_file
        return None if path is None else _read_secret("sglang_admin_key_file", path)

    @classmethod
    def describe(cls) -> str:
        """One line per variable: name, type, default, flag, help."""
        lines = []
        for name, info in cls.model_fields.items():
            flag = next(iter(_options(name)), "-")
            lines.append(
                f"{env_name(name):<32} {_type_name(info.annotation):<12} "
                f"default {_shown(info.default):<26} {flag:<22} {info.description}"
            )
        return "\n".join(lines)

    @classmethod
    def markdown(cls) -> str:
        """The settings table of docs/configuration.md."""
        rows = [
            "| variable | flag | type | default | meaning |",
            "|---|---|---|---|---|",
        ]
        for name, info in cls.model_fields.items():
            flags = ", ".join(f"`{o}`" for o in _options(name)) or "- (environment only)"
            cells = [_type_name(info.annotation), _shown(info.default), info.description or ""]
            type_, default, meaning = (cell.replace("|", "\\|") for cell in cells)
            rows.append(f"| `{env_name(name)}` | {flags} | {type_} | {default} | {meaning} |")
        return "\n".join(rows) + "\n"


CONNECTION = ("redis_url", "stream_prefix")
"""What every command that talks to the log takes (the credentials are environment-only)."""

PROCESS = (
    *CONNECTION, "worker_id", "block_ms", "heartbeat_ms", "claim_idle_ms", "outage_limit_s",
    "log_level", "metrics_port", "metrics_host",
)
"""What every long-running engine process takes."""


@dataclass(frozen=True)
class Flags:
    """The settings one command takes as flags.

    Each is ``--foo-bar`` for ``ROLLOUT_FOO_BAR`` (and its ``Flag.alias``, and the command's own
    spelling in ``aliases``, named first), defaults to the variable's value, and shows the
    variable in ``--help``. ``apply`` folds the parsed flags into the settings through the
    model, so a bad value fails with the flag, the variable and the rule it breaks.
    """

    names: tuple[str, ...]
    aliases: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (*self.names, *self.aliases):
            if name not in Settings.model_fields:
                raise ValueError(f"{name!r} is not a setting (engine/settings.py)")
            if _flag(name).env_only:
                raise ValueError(f"{env_name(name)} is read from the environment only")

    def options(self, name: str) -> list[str]:
        """The flag's spellings, the one named in messages first."""
        return list(dict.fromkeys(o for o in (self.aliases.get(name), *_options(name)) if o))

    def add_to(self, parser: argparse.ArgumentParser, settings: Settings) -> None:
        for name in self.names:
            info = Settings.model_fields[name]
            value = getattr(settings, name)
            help_text = f"{info.description} [{env_name(name)}, default {_shown(value)}]"
            kwargs: dict[str, Any] = {"dest": name, "help": help_text.replace("%", "%%")}
            kind, choices = _scalar(info.annotation)
            if kind is bool:
                kwargs.update(action=argparse.BooleanOptionalAction, default=value)
            elif _flag(name).repeat:
                kwargs.update(action="append", default=None, metavar="URL[,URL]")
            else:
                metavar = "{" + ",".join(choices) + "}" if choices else kind.__name__.upper()
                kwargs.update(type=kind, default=value, metavar=metavar)
            parser.add_argument(*self.options(name), **kwargs)

    def apply(self, settings: Settings, args: argparse.Namespace) -> Settings:
        """``settings`` with the parsed flags in force; ``ConfigError`` naming the flag."""
        values = settings.model_dump()
        for name in self.names:
            value = getattr(args, name)
            if _flag(name).repeat:
                if value is None:
                    continue
                value = ",".join(value)
            values[name] = value
        try:
            return Settings.model_validate(values)
        except ValidationError as exc:
            problems = [self._explain(key, problem) for key, problem in explain(exc)]
            raise ConfigError("; ".join(problems)) from None

    def _explain(self, key: str, problem: str) -> str:
        if not key:  # a rule across settings: its message names them
            return problem
        if key not in self.names:
            return f"{env_name(key)} {problem}"
        return f"{self.options(key)[0]} {problem} ({env_name(key)})"


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


def _read_secret(name: str, path: Path) -> str:
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{env_name(name)}: cannot read {path}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(f"{env_name(name)}: {path} is empty")
    return secret


def _flag(name: str) -> Flag:
    info: FieldInfo = Settings.model_fields[name]
    return next((m for m in info.metadata if isinstance(m, Flag)), Flag())


def _options(name: str) -> list[str]:
    """The setting's flag spellings (none for a credential), its alias first."""
    flag = _flag(name)
    if flag.env_only:
        return []
    generated = "--" + name.replace("_", "-")
    return list(dict.fromkeys(o for o in (flag.alias, generated) if o))


def _scalar(annotation: Any) -> tuple[Any, tuple[str, ...]]:
    """The argparse type of a field (``X | None`` -> X) and a Literal's choices."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return str, tuple(str(arg) for arg in typing.get_args(annotation))
    return annotation, ()


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(arg) for arg in typing.get_args(annotation) if arg is not type(None)]
        return " | ".join(names)
    if origin is Literal:
        return "|".join(str(arg) for arg in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation)).lower()
