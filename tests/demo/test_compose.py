"""compose.yaml: valid for docker-compose, and wired to what the engine really accepts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.ops.cli import _DELEGATES
from engine.settings import ENV_PREFIX, Settings
from tests.redis_server import redis_required

ROOT = Path(__file__).resolve().parents[2]


_IMAGE_VARIABLES = ("REDIS_IMAGE", "ENGINE_IMAGE", "BASE_IMAGE")


def _config(env: dict[str, str] | None = None) -> dict[str, Any]:
    binary = shutil.which("docker-compose")
    if binary is None:
        if redis_required():  # CI installs Debian's docker-compose
            pytest.fail("docker-compose is missing in CI: .ci/run must install it")
        pytest.skip("docker-compose not installed")
    out = subprocess.run(
        [binary, "-f", str(ROOT / "compose.yaml"), "--profile", "cpu", "--profile", "gpu",
         "config"],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if k not in _IMAGE_VARIABLES}, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    parsed: dict[str, Any] = yaml.safe_load(out.stdout)
    return parsed


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return _config()


ENGINE = ("scheduler", "evaluator", "capture", "finalizer", "sync", "tinylm")


def test_services_and_profiles(config: dict[str, Any]) -> None:
    services = config["services"]
    assert set(services) == {"redis", "redis-secret", "model-init", "sglang", "router", *ENGINE}
    assert "--appendonly yes" in " ".join(services["redis"]["command"])
    assert services["sglang"]["profiles"] == ["gpu"]
    assert services["tinylm"]["profiles"] == ["cpu"]
    gpu = services["sglang"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"]
    assert services["evaluator"]["deploy"]["replicas"] >= 2
    assert "sglang" in services["tinylm"]["networks"]["default"]["aliases"]
    # The policy folder is made (or checked) once, in either profile, before its readers start.
    assert "profiles" not in services["model-init"]
    for name in ("tinylm", "evaluator", "capture"):
        needs = services[name]["depends_on"]["model-init"]
        assert needs["condition"] == "service_completed_successfully", name


def test_images_come_from_variables(config: dict[str, Any]) -> None:
    """Registry defaults, and local images (scripts/build-images) through variables."""
    default = config["services"]
    assert default["redis"]["image"] == default["redis-secret"]["image"] == "redis:7"
    assert default["scheduler"]["image"] == "rollout-engine:local"
    assert default["scheduler"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"
    local = _config({"REDIS_IMAGE": "rollout-base:abc", "ENGINE_IMAGE": "rollout-engine:abc",
                     "BASE_IMAGE": "rollout-base:abc"})["services"]
    assert local["redis"]["image"] == local["redis-secret"]["image"] == "rollout-base:abc"
    for name in ("model-init", *ENGINE):
        assert local[name]["image"] == "rollout-engine:abc", name
        assert local[name]["build"]["args"]["BASE_IMAGE"] == "rollout-base:abc", name


def test_engine_services_use_declared_settings_only(config: dict[str, Any]) -> None:
    declared = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for name in ENGINE:
        env = config["services"][name]["environment"]
        used = {k for k in env if k.startswith(ENV_PREFIX)}
        assert used, name
        assert used <= declared, (name, used - declared)
        Settings.from_env({k: str(v) for k, v in env.items()})  # values parse too


def _mount(volume: Any) -> tuple[str, bool]:
    """(source, read-only) of a volume in either form docker-compose prints."""
    if isinstance(volume, str):
        parts = volume.split(":")
        return parts[0], parts[-1] == "ro"
    return str(volume["source"]), bool(volume.get("read_only"))


def test_redis_needs_the_stacks_generated_password(config: dict[str, Any]) -> None:
    services = config["services"]
    redis = services["redis"]
    command = " ".join(redis["command"])
    assert "--requirepass" in command and "cat /run/rollout-secrets/redis.password)" in command
    assert redis["depends_on"]["redis-secret"]["condition"] == "service_completed_successfully"
    assert "umask 077" in " ".join(services["redis-secret"]["command"])
    for name in ENGINE:
        service = services[name]
        assert service["environment"]["ROLLOUT_REDIS_PASSWORD_FILE"] == (
            "/run/rollout-secrets/redis.password"
        )
        assert "@" not in service["environment"]["ROLLOUT_REDIS_URL"]  # no password in a URL
        mounts = [_mount(v) for v in service["volumes"]]
        assert ("redis-secrets", True) in mounts, (name, service["volumes"])
    evaluator = services["evaluator"]
    assert evaluator["environment"]["ROLLOUT_SANDBOX_REQUIRE_ISOLATION"] == "1"
    assert {"SYS_ADMIN", "NET_ADMIN"} <= set(evaluator["cap_add"])  # netns, and its loopback


def test_engine_commands_are_real_subcommands_with_real_flags(config: dict[str, Any]) -> None:
    for name in ("scheduler", "evaluator", "capture", "finalizer"):
        command = config["services"][name]["command"]
        assert command[0] in _DELEGATES, (name, command)
        helped = subprocess.run(
            [sys.executable, "-m", "workers", command[0], "--help"],
            capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
            env={k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)},
        )
        assert helped.returncode == 0, helped.stderr
        for flag in (w for w in command[1:] if w.startswith("--")):
            assert flag in helped.stdout, (name, flag)
