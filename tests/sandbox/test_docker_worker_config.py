"""How ``rollout worker --sandbox docker`` turns its flags and the served evaluators' run
resources into the Docker provider's settings (no daemon needed)."""

from __future__ import annotations

import pytest

from engine.domain import Resource
from engine.errors import ConfigError
from engine.sandbox import SandboxLimits
from engine.settings import Settings
from workers.evaluator import build_parser, docker_config, main


def test_limits_come_from_the_run_resource() -> None:
    config = docker_config("img:1", run_resource=Resource(cpu=0.5, memory_gb=0.25))
    assert (config.image, config.network_mode, config.cpus) == ("img:1", "none", 0.5)
    assert config.default_limits.memory_mb == 256


def test_explicit_cpus_and_network_win_and_no_resource_means_no_cpu_cap() -> None:
    config = docker_config(
        "img:1", network="bridge", cpus=2.0, run_resource=Resource(cpu=0.5)
    )
    assert (config.network_mode, config.cpus) == ("bridge", 2.0)
    assert config.default_limits == SandboxLimits()
    assert docker_config("img:1").cpus is None


def test_docker_without_an_image_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--docker-image"):
        docker_config(None)


def test_flags_default_to_the_settings() -> None:
    settings = Settings.from_env(
        {"ROLLOUT_SANDBOX": "docker", "ROLLOUT_DOCKER_IMAGE": "img:2", "ROLLOUT_DOCKER_CPUS": "3"}
    )
    args = build_parser(settings).parse_args([])
    assert (args.sandbox, args.docker_image, args.docker_cpus) == ("docker", "img:2", 3.0)
    assert args.docker_network == "none"


def test_the_worker_refuses_docker_without_an_image(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ROLLOUT_DOCKER_IMAGE", "ROLLOUT_SANDBOX"):
        monkeypatch.delenv(name, raising=False)
    config = "tests/actors/fixtures/docker_evaluators.py"
    code = main(["--evaluator-config", config, "--sandbox", "docker", "--quiet"])
    assert code == 2
    assert "--docker-image" in capsys.readouterr().err
