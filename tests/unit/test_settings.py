from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.ops import cli
from engine.settings import Flags, Settings, env_name


def test_defaults_from_an_empty_environment() -> None:
    settings = Settings.from_env({})
    assert settings.stream_prefix == "rl"
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.root is None
    assert settings.heartbeat_ms < settings.claim_idle_ms


def test_values_are_parsed_and_other_variables_ignored() -> None:
    settings = Settings.from_env(
        {
            "ROLLOUT_STREAM_PREFIX": "exp1",
            "ROLLOUT_ROOT": "/data",
            "ROLLOUT_CLAIM_IDLE_MS": "90000",
            "ROLLOUT_MAX_DELIVERIES": "5",
            "ROLLOUT_LOG_LEVEL": "debug",
            "ROLLOUT_SGLANG_URL": "",  # empty counts as unset
            "PATH": "/usr/bin",
        }
    )
    assert settings.stream_prefix == "exp1"
    assert settings.root == Path("/data")
    assert settings.claim_idle_ms == 90000
    assert settings.max_deliveries == 5
    assert settings.log_level == "DEBUG"
    assert settings.sglang_url is None


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"ROLLOUT_BLOCK_MS": "soon"}, "ROLLOUT_BLOCK_MS must be an integer, got 'soon'"),
        ({"ROLLOUT_MAX_DELIVERIES": "0"}, "ROLLOUT_MAX_DELIVERIES must be at least 1"),
        ({"ROLLOUT_LOG_LEVEL": "LOUD"}, "ROLLOUT_LOG_LEVEL must be one of"),
        ({"ROLLOUT_STREAM_PREFIX": "a:b"}, "ROLLOUT_STREAM_PREFIX must be a name"),
        (
            {"ROLLOUT_REDIS_URLL": "x"},
            "unknown key 'ROLLOUT_REDIS_URLL' (did you mean 'ROLLOUT_REDIS_URL' or "
                "'ROLLOUT_REDIS_USERNAME'?)",
        ),
        (
            {"ROLLOUT_HEARTBEAT_MS": "70000"},
            "ROLLOUT_HEARTBEAT_MS (70000) must be below ROLLOUT_CLAIM_IDLE_MS (60000)",
        ),
    ],
)
def test_bad_values_name_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Settings.from_env(environ)


def test_describe_lists_every_variable_with_type_default_and_help() -> None:
    text = Settings.describe()
    lines = text.splitlines()
    assert len(lines) == len(Settings.model_fields)
    for name, info in Settings.model_fields.items():
        line = next(line for line in lines if line.startswith(f"ROLLOUT_{name.upper()} "))
        assert info.description and info.description in line
    block = next(line for line in lines if line.startswith("ROLLOUT_BLOCK_MS "))
    assert "int" in block and "2000" in block
    assert "DEBUG|INFO" in next(line for line in lines if line.startswith("ROLLOUT_LOG_LEVEL "))
    assert "path" in next(line for line in lines if line.startswith("ROLLOUT_ROOT "))


# -- flags, generated from the same declarations -------------------------------------------

PROCESSES = ("evaluator", "finalizer", "capture", "scheduler", "sync", "serve")

ONE_SHOT = {
    "replay": {"rollout_id", "source", "out"},
    "archive": {"rollout_id", "out"},
    "retention": {"every"},
    "tail": {"rollout", "stream", "from_start", "count"},
    "status": {"rollout_id"},
    "pool": {"at"},
    "top": {"once", "interval", "rollouts"},
}
"""Arguments of the log tools that are not settings: positionals and one-shot options."""

LEGACY = {
    "evaluator": "--redis-url --prefix --worker-id --heartbeat-ms --claim-idle-ms --block-ms "
    "--max-deliveries --log-level --outage-limit-s --evaluator-config --evaluators "
    "--max-batches --grace-s --sglang-url --model-dir --teacher-url --teacher-tokenizer "
    "--tmp-dir --verify-fraction --verify-threshold --sandbox --docker-image --docker-network "
    "--docker-cpus --sandbox-root --require-isolation --no-require-isolation --quiet",
    "finalizer": "--redis-url --prefix --worker-id --heartbeat-ms --claim-idle-ms --block-ms "
    "--max-deliveries --log-level --outage-limit-s --out-dir --top-k --distill-dump-dir "
    "--mixed-dump-dir --student-dump-dir --retention-store --retention-keep-s "
    "--retention-every-s",
    "capture": "--redis-url --prefix --worker-id --heartbeat-ms --claim-idle-ms --block-ms "
    "--max-deliveries --log-level --outage-limit-s --teacher-url --teacher-tokenizer "
    "--concurrency --max-tries",
    "scheduler": "--redis-url --prefix --rollout-config --evaluator-config --cluster-layout "
    "--env-num-cpus --env-memory-gb --scheduler-id --block-ms --heartbeat-ms --claim-idle-ms "
    "--outage-limit-s --plan-chunk --log-level",
    "sync": "--redis-url --prefix --worker-id --heartbeat-ms --claim-idle-ms --block-ms "
    "--max-deliveries --log-level --outage-limit-s --sglang-url --park-timeout-s "
    "--live-window-ms --grace-s",
    "retention": "--redis-url --prefix --store --keep-s --every",
}
"""The flags each command took when they were written by hand; scripts and docs use them."""


def _commands() -> dict[str, tuple[argparse.ArgumentParser, Flags]]:
    """Every command that takes settings: its parser and the settings it declares."""
    settings = Settings()
    out = {}
    for name in PROCESSES:
        module = importlib.import_module(f"workers.{name}")
        out[name] = (module.build_parser(settings), module.FLAGS)
    [sub] = [a for a in cli.build_parser(settings)._actions
             if isinstance(a, argparse._SubParsersAction)]
    for name in ONE_SHOT:
        out[name] = (sub.choices[name], cli._FLAGS.get(name, cli.LOG_TOOL))
    return out


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", [*PROCESSES, *ONE_SHOT])
def test_every_flag_is_a_variable_and_every_declared_setting_a_flag(command: str) -> None:
    parser, flags = _commands()[command]
    dests = {a.dest for a in _options(parser)}
    settings = dests & set(Settings.model_fields)
    assert settings == set(flags.names)
    assert dests - settings == ONE_SHOT.get(command, set())
    text = parser.format_help()
    for action in _options(parser):
        if action.dest in settings:
            assert f"[{env_name(action.dest)}, default " in (action.help or "")
            assert env_name(action.dest) in text
            assert f"--{action.dest.replace('_', '-')}" in action.option_strings


def test_every_setting_is_a_flag_somewhere_or_a_credential() -> None:
    taken = {name for _, flags in _commands().values() for name in flags.names}
    credentials = {"redis_username", "redis_password_file", "redis_tls_ca_file",
                   "redis_tls_cert_file", "redis_tls_key_file", "sglang_admin_key_file"}
    assert set(Settings.model_fields) - taken == credentials
    with pytest.raises(ValueError, match="ROLLOUT_REDIS_PASSWORD_FILE is read from the env"):
        Flags(("redis_password_file",))
    with pytest.raises(ValueError, match="'redis_ulr' is not a setting"):
        Flags(("redis_ulr",))


@pytest.mark.parametrize("command", sorted(LEGACY))
def test_the_flags_scripts_and_docs_use_still_parse(command: str) -> None:
    parser, _ = _commands()[command]
    spelled = {o for a in _options(parser) for o in a.option_strings}
    assert set(LEGACY[command].split()) <= spelled


def test_a_flag_overrides_its_variable_and_defaults_to_it() -> None:
    from workers.evaluator import FLAGS, build_parser

    env = Settings.from_env({"ROLLOUT_MAX_BATCHES": "7", "ROLLOUT_SANDBOX": "docker"})
    parser = build_parser(env)
    [shown] = [a.help for a in parser._actions if a.dest == "max_batches"]
    assert shown is not None and shown.endswith("[ROLLOUT_MAX_BATCHES, default 7]")
    args = parser.parse_args(["--sandbox", "none", "--prefix", "exp2", "--require-isolation"])
    settings = FLAGS.apply(env, args)
    assert (settings.max_batches, settings.sandbox) == (7, "none")
    assert settings.stream_prefix == "exp2" and settings.sandbox_require_isolation
    assert FLAGS.apply(env, parser.parse_args(["--no-require-isolation"])).sandbox == "docker"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heartbeat-ms", "70000"],
         "ROLLOUT_HEARTBEAT_MS (70000) must be below ROLLOUT_CLAIM_IDLE_MS (60000), or live "
         "workers lose their entries to claims (flags --heartbeat-ms, --claim-idle-ms)"),
        (["--max-batches", "0"], "--max-batches must be at least 1, got 0 (ROLLOUT_MAX_BATCHES)"),
        (["--sandbox", "vm"], "--sandbox must be one of 'local', 'docker' or 'none', got 'vm' "
         "(ROLLOUT_SANDBOX)"),
        (["--prefix", "a:b"], "--prefix must be a name"),
    ],
)
def test_a_bad_flag_names_the_flag_and_its_variable(argv: list[str], message: str) -> None:
    from workers.evaluator import FLAGS, build_parser

    settings = Settings()
    with pytest.raises(ConfigError, match=re.escape(message)):
        FLAGS.apply(settings, build_parser(settings).parse_args(argv))


def test_a_command_spelling_names_the_flag_in_messages() -> None:
    settings = Settings()
    parser, flags = _commands()["scheduler"]
    args = parser.parse_args(["--scheduler-id", "s1", "--plan-chunk", "1"])
    with pytest.raises(ConfigError, match=re.escape("--plan-chunk must be at least 2")):
        flags.apply(settings, args)
    args = parser.parse_args(["--scheduler-id", "s1", "--worker-id", "s2"])
    assert flags.apply(settings, args).worker_id == "s2"  # one setting, two spellings


def test_the_configuration_doc_holds_the_generated_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    assert Settings.markdown() in doc, (
        "docs/configuration.md: the settings table is out of date; paste the output of "
        "`rollout env --markdown`"
    )
