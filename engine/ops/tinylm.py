"""The engine's side of tinylm: build and serve the tiny model for the bundled agents.

tinylm imports nothing from the engine. This module hands it what the engine knows, the
bundled agents' system prompts (``engine.tasks.prompts``), so the model is trained on the
context it will be served in, and translates tinylm's errors into the engine's:
``tinylm.errors.ConfigError`` -> :class:`engine.errors.ConfigError`.
``rollout tinylm ...`` runs :func:`main`.

``rollout tinylm serve`` (how the launcher, ``engine.ops.processes``, starts it) serves tinylm
as an RL deployment must run SGLang: with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, so the logprobs
of sampled tokens are those of the raw distribution (what a re-score computes), not the
temperature-scaled one. A variable the caller set explicitly is left alone. An evaluator
worker refuses, at start, a server that returns temperature-scaled logprobs
(``engine.backends.fidelity.check_server_logprobs``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError
from engine.tasks.prompts import MATH_SYSTEM_PROMPT, SHELL_SYSTEM_PROMPT
from tinylm import errors as tinylm_errors
from tinylm.corpus import SystemPrompts

if TYPE_CHECKING:
    from tinylm.model import InitReport

__all__ = ["RL_SERVER_ENV", "SYSTEM_PROMPTS", "init_model", "main"]

RL_SERVER_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
"""What an RL deployment of SGLang must set, and ``rollout tinylm`` sets."""

SYSTEM_PROMPTS = SystemPrompts(math=MATH_SYSTEM_PROMPT, shell=SHELL_SYSTEM_PROMPT)
"""The bundled agents' system prompts, as the tinylm corpus takes them."""


def init_model(model_dir: str | Path, **kwargs: Any) -> InitReport:
    """``tinylm.model.init_model`` with the bundled agents' prompts (unless given)."""
    from tinylm.model import init_model as build

    kwargs.setdefault("system_prompts", SYSTEM_PROMPTS)
    try:
        return build(model_dir, **kwargs)
    except tinylm_errors.ConfigError as exc:
        raise ConfigError(str(exc)) from exc


def main(argv: list[str]) -> int:
    """``rollout tinylm ...``: tinylm's own command, with the bundled agents' prompts."""
    from tinylm.cli import main as tinylm_main

    for key, value in RL_SERVER_ENV.items():
        os.environ.setdefault(key, value)
    return tinylm_main(argv, system_prompts=SYSTEM_PROMPTS)
