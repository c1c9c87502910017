"""The pure parts of the sandbox port: limits, classification, labels, argv."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError, SandboxError, SandboxLimitExceeded, SandboxTimeout
from engine.sandbox import ExecOutcome, ExecResult, KillReason, SandboxLimits, classify
from engine.sandbox.base import (
    attribute_end,
    command_argv,
    raise_for_outcome,
    validate_labels,
    validate_selector,
)


def result(**fields: object) -> ExecResult:
    values: dict[str, object] = {"exit_code": 0, "stdout": "", "stderr": ""}
    values.update(fields)
    return ExecResult(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("cpu_time_s", 0),
        ("cpu_time_s", float("inf")),
        ("memory_mb", 1),
        ("max_procs", 0),
        ("wall_timeout_s", -1),
        ("max_output_bytes", -5),
        ("disk_mb", 0),
        ("max_procs", True),
    ],
)
def test_limits_refuse_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**{field: value})  # type: ignore[arg-type]


def test_limits_round_cpu_up_and_cap_timeouts() -> None:
    limits = SandboxLimits(cpu_time_s=1.2, wall_timeout_s=30)
    assert limits.cpu_seconds == 2
    assert limits.effective_timeout(None) == 30
    assert limits.effective_timeout(5) == 5
    assert limits.effective_timeout(500) == 30
    with pytest.raises(SandboxError, match="timeout_s"):
        limits.effective_timeout(-1)


@pytest.mark.parametrize(
    ("fields", "outcome"),
    [
        ({}, ExecOutcome.OK),
        ({"exit_code": 2}, ExecOutcome.NONZERO_EXIT),
        ({"exit_code": 137, "timed_out": True, "killed_by": "timeout"}, ExecOutcome.TIMEOUT),
        ({"exit_code": 152, "killed_by": "cpu"}, ExecOutcome.CPU_LIMIT),
        ({"exit_code": 1, "killed_by": "memory"}, ExecOutcome.MEMORY_LIMIT),
        ({"exit_code": 1, "killed_by": "pids", "timed_out": True}, ExecOutcome.PIDS_LIMIT),
        ({"exit_code": 153, "killed_by": "disk"}, ExecOutcome.DISK_LIMIT),
        ({"exit_code": 139, "killed_by": "SIGSEGV"}, ExecOutcome.SIGNALED),
    ],
)
def test_classify(fields: dict[str, object], outcome: ExecOutcome) -> None:
    assert classify(result(**fields)) is outcome


@pytest.mark.parametrize(
    ("exit_code", "timed_out", "stderr", "counters", "expected"),
    [
        (0, False, "", {}, None),
        (1, False, "plain failure", {}, None),
        (152, False, "", {}, KillReason.CPU),
        (153, False, "", {}, KillReason.DISK),
        (137, False, "", {"oom_killed": True}, KillReason.MEMORY),
        (137, False, "", {}, "SIGKILL"),
        (139, False, "", {}, "SIGSEGV"),
        (1, False, "Traceback...\nMemoryError\n", {}, KillReason.MEMORY),
        (2, False, "sh: 1: Cannot fork\n", {}, KillReason.PIDS),
        (1, False, "BlockingIOError: [Errno 11] Resource temporarily unavailable", {}, "pids"),
        (1, False, "write: No space left on device", {}, KillReason.DISK),
        (137, True, "", {}, KillReason.TIMEOUT),
        (137, True, "bash: fork: retry: Resource temporarily unavailable", {}, KillReason.PIDS),
        (137, True, "", {"pids_exhausted": True}, KillReason.PIDS),
        (0, False, "MemoryError", {"oom_killed": True}, None),  # succeeded: nothing to blame
    ],
)
def test_attribute_end(
    exit_code: int,
    timed_out: bool,
    stderr: str,
    counters: dict[str, bool],
    expected: str | None,
) -> None:
    assert attribute_end(exit_code, timed_out=timed_out, stderr=stderr, **counters) == expected


def test_raise_for_outcome() -> None:
    ok = result()
    assert raise_for_outcome(ok, sandbox_id="sb-1", command="true") is ok
    failed = result(exit_code=1)
    assert raise_for_outcome(failed, sandbox_id="sb-1", command="false") is failed
    with pytest.raises(SandboxTimeout, match="'sleep 9' in sandbox sb-1"):
        raise_for_outcome(
            result(exit_code=137, timed_out=True, killed_by="timeout"),
            sandbox_id="sb-1",
            command="sleep 9",
        )
    with pytest.raises(SandboxLimitExceeded, match="memory limit"):
        raise_for_outcome(
            result(exit_code=1, killed_by="memory"), sandbox_id="sb-1", command="alloc"
        )


def test_command_argv() -> None:
    assert command_argv("echo hi") == ["/bin/sh", "-c", "echo hi"]
    assert command_argv(("ls", "-l")) == ["ls", "-l"]
    for bad in ("", "   ", [], ["a\0b"]):
        with pytest.raises(SandboxError):
            command_argv(bad)


def test_labels_and_selectors() -> None:
    assert validate_labels({"rollout.worker": "w-1", "a/b_c": ""}) == {
        "rollout.worker": "w-1",
        "a/b_c": "",
    }
    for bad in ({"": "x"}, {"white space": "x"}, {"k=v": "x"}, {"ok": "a\nb"}):
        with pytest.raises(SandboxError, match="label"):
            validate_labels(bad)
    with pytest.raises(SandboxError, match="empty label selector"):
        validate_selector({})
