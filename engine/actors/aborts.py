"""``classify_abort``: which class of failure ended a sample (seeds: classify_abort).

``agent_timeout`` (``EpisodeTimeout``, ``TimeoutError``), ``infra_conn`` (``BackendError``,
``ConnectionError``), ``infra_sandbox`` (``SandboxError``) or ``infra_other``. Classes are
looked up along the whole chain (causes, context, ``ExceptionGroup`` members) first, so an
``AgentError`` raised from a ``BackendUnavailable`` is a connection failure. Only then do
message heuristics apply, for agents that wrap errors in plain exceptions: connection words
before sandbox words before timeout words, since "connection timed out" is a connection
failure.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from engine.errors import BackendError, EpisodeTimeout, SandboxError
from engine.events.catalog import AbortClass

__all__ = ["classify_abort", "describe_exception"]

_CONN = re.compile(
    r"connection (refused|reset|aborted|error|closed)|connecterror|remote ?protocol|"
    r"remote end closed|broken pipe|bad gateway|service unavailable|gateway time-?out|"
    r"\b50[234]\b|name or service not known|temporary failure in name resolution|"
    r"max retries exceeded|server disconnected|sglang|connection timed out"
)
_SANDBOX = re.compile(
    r"sandbox|container|docker|\bcgroup|out of memory|\boom\b|no space left|"
    r"killed by signal|exec failed"
)
_TIMEOUT = re.compile(r"timed? ?out|timeout|deadline exceeded")

_MAX_CHAIN = 16


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception, its causes, contexts and group members, each once, breadth first."""
    seen: set[int] = set()
    queue = [exc]
    while queue and len(seen) < _MAX_CHAIN:
        cur = queue.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        if isinstance(cur, BaseExceptionGroup):
            queue.extend(cur.exceptions)
        if cur.__cause__ is not None:
            queue.append(cur.__cause__)
        elif cur.__context__ is not None and not cur.__suppress_context__:
            queue.append(cur.__context__)


def _by_class(exc: BaseException) -> AbortClass | None:
    if isinstance(exc, EpisodeTimeout | TimeoutError):
        return AbortClass.AGENT_TIMEOUT
    if isinstance(exc, BackendError | ConnectionError):
        return AbortClass.INFRA_CONN
    if isinstance(exc, SandboxError):
        return AbortClass.INFRA_SANDBOX
    return None


def classify_abort(exc: BaseException) -> AbortClass:
    chain = list(_chain(exc))
    for cur in chain:
        found = _by_class(cur)
        if found is not None:
            return found
    text = " | ".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    if _CONN.search(text):
        return AbortClass.INFRA_CONN
    if _SANDBOX.search(text):
        return AbortClass.INFRA_SANDBOX
    if _TIMEOUT.search(text):
        return AbortClass.AGENT_TIMEOUT
    return AbortClass.INFRA_OTHER


def describe_exception(exc: BaseException, *, limit: int = 2000) -> str:
    """``Type: message`` (plus its direct cause), cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__
    if cause is not None:
        text += f" (caused by {type(cause).__name__}: {cause})"
    return text if len(text) <= limit else text[: limit - 3] + "..."
