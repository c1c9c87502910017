from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.settings import Settings


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
