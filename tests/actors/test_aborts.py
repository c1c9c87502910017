"""classify_abort: engine error classes first (along the chain), then message heuristics."""

from __future__ import annotations

import pytest

from engine.actors.aborts import classify_abort, describe_exception
from engine.errors import (
    AgentError,
    BackendHTTPError,
    BackendUnavailable,
    EpisodeTimeout,
    GenerationAborted,
    SandboxError,
    SandboxLimitExceeded,
)
from engine.events import AbortClass


def _chained(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as exc:
            raise outer from exc
    except Exception as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (EpisodeTimeout("window elapsed"), AbortClass.AGENT_TIMEOUT),
        (TimeoutError(), AbortClass.AGENT_TIMEOUT),
        (BackendUnavailable("refused"), AbortClass.INFRA_CONN),
        (BackendHTTPError("http://x/generate", 503, "busy"), AbortClass.INFRA_CONN),
        (GenerationAborted("aborted"), AbortClass.INFRA_CONN),
        (ConnectionResetError(), AbortClass.INFRA_CONN),
        (SandboxError("gone"), AbortClass.INFRA_SANDBOX),
        (SandboxLimitExceeded("memory"), AbortClass.INFRA_SANDBOX),
        (ValueError("bad"), AbortClass.INFRA_OTHER),
        (KeyError("x"), AbortClass.INFRA_OTHER),
        # message heuristics for agents that wrap errors in plain exceptions
        (RuntimeError("Connection refused by 10.0.0.5:30000"), AbortClass.INFRA_CONN),
        (RuntimeError("upstream answered 502 Bad Gateway"), AbortClass.INFRA_CONN),
        (RuntimeError("connection timed out"), AbortClass.INFRA_CONN),
        (RuntimeError("docker container exited with 137"), AbortClass.INFRA_SANDBOX),
        (RuntimeError("command timed out after 600s"), AbortClass.AGENT_TIMEOUT),
    ],
)
def test_classes(exc: BaseException, expected: AbortClass) -> None:
    assert classify_abort(exc) is expected


def test_class_along_the_chain_beats_the_message() -> None:
    exc = _chained(AgentError("the tool failed (timeout?)"), BackendUnavailable("refused"))
    assert classify_abort(exc) is AbortClass.INFRA_CONN


def test_exception_group_members_count() -> None:
    group = ExceptionGroup("episode", [ValueError("x"), SandboxError("died")])
    assert classify_abort(group) is AbortClass.INFRA_SANDBOX


def test_describe_names_type_and_cause() -> None:
    exc = _chained(AgentError("step 3 failed"), BackendUnavailable("refused"))
    text = describe_exception(exc)
    assert text == "AgentError: step 3 failed (caused by BackendUnavailable: refused)"
    assert len(describe_exception(ValueError("x" * 5000))) == 2000
