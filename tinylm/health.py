"""``GET /health``, ``/health_generate`` and ``/ready`` as SGLang 0.5.23 serves them.

Sources, under ``python/sglang/srt/``: ``entrypoints/http_server.py`` (``health_generate``,
which serves both health routes, and ``ready``), ``managers/tokenizer_manager.py``
(``is_ready``, ``last_receive_tstamp``), ``environ.py`` (the variables below).

- While the server shuts down, a health route answers 503 with an empty body.
- ``/health`` answers 200 at once when ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false;
  by default (true) it is ``/health_generate``.
- ``/health_generate`` sends a one-token greedy generation (``input_ids=[0]``, rid
  ``HEALTH_CHECK_<hex>``) the way any request goes: it waits while generation is paused or a
  weight update holds the model, then runs in the scheduler's batch, unless the scheduler is
  busy (``Scheduler`` skips it then: its requests' output is the news). Every second it looks
  whether the scheduler produced anything since the check began and answers 200, empty, as
  soon as it has. After ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (default 20) without news it answers
  503, empty. So a healthy check takes about one poll (SGLang sleeps a second before the
  first look), and a server paused with nothing running fails its health check.
- ``/ready`` answers 200 when the server is not shutting down, its last health check did not
  fail, and generation is not paused; else 503.

tinylm keeps SGLang's poll of one second (``poll_s``) unless told otherwise.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio

from tinylm.errors import ConfigError

__all__ = [
    "ENABLE_GENERATION_ENV",
    "HEALTH_CHECK_RID_PREFIX",
    "TIMEOUT_ENV",
    "HealthSettings",
    "health_generate",
    "health_rid",
]

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # srt/constants.py
TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
ENABLE_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"


@dataclass(frozen=True, kw_only=True)
class HealthSettings:
    timeout_s: float = 20.0
    generate_on_health: bool = True  # /health runs the generation too
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.poll_s <= 0:
            raise ConfigError(
                f"health check timeout and poll must be > 0, got {self.timeout_s} and {self.poll_s}"
            )

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, poll_s: float = 1.0
    ) -> HealthSettings:
        """SGLang's variables (``environ.py``: an ``EnvBool`` takes true/1/yes/y and
        false/0/no/n; ``SGLANG_HEALTH_CHECK_TIMEOUT`` is an integer of seconds)."""
        env = os.environ if environ is None else environ
        raw_timeout = env.get(TIMEOUT_ENV, "20")
        try:
            timeout = int(raw_timeout)
        except ValueError as exc:
            raise ConfigError(f"{TIMEOUT_ENV}={raw_timeout!r} is not an integer") from exc
        raw_flag = env.get(ENABLE_GENERATION_ENV, "true").lower()
        if raw_flag not in ("true", "1", "yes", "y", "false", "0", "no", "n"):
            raise ConfigError(f"{ENABLE_GENERATION_ENV}={raw_flag!r} is not a boolean")
        return cls(
            timeout_s=float(timeout),
            generate_on_health=raw_flag in ("true", "1", "yes", "y"),
            poll_s=poll_s,
        )


def health_rid() -> str:
    return f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"


async def health_generate(
    settings: HealthSettings,
    *,
    try_submit: Callable[[], bool],
    last_output_at: Callable[[], float],
) -> bool:
    """Whether the scheduler produced anything within the timeout (see the module docstring).

    ``try_submit`` sends the one-token request if it can start now (False while generation is
    paused or an update holds the model; it is tried again each poll); ``last_output_at`` is
    the scheduler's ``time.monotonic()`` of its last output."""
    tic = time.monotonic()
    submitted = try_submit()
    while time.monotonic() < tic + settings.timeout_s:
        await anyio.sleep(settings.poll_s)
        if last_output_at() > tic:
            return True
        if not submitted:
            submitted = try_submit()
    return False
