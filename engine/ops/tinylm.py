"""The engine's side of tinylm: build and serve the tiny model for the bundled agents.

tinylm imports nothing from the engine. This module hands it what the engine knows, the
bundled agents' system prompts (``engine.tasks.prompts``), so the model is trained on the
context it will be served in, and translates tinylm's errors into the engine's:
``tinylm.errors.ConfigError`` -> :class:`engine.errors.ConfigError`,
``tinylm.errors.ServerUnavailable`` -> :class:`engine.errors.BackendUnavailable`.
``rollout tinylm ...`` runs :func:`main`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import BackendUnavailable, ConfigError
from engine.tasks.prompts import MATH_SYSTEM_PROMPT, SHELL_SYSTEM_PROMPT
from tinylm import errors as tinylm_errors
from tinylm.corpus import SystemPrompts

if TYPE_CHECKING:
    from tinylm.model import InitReport
    from tinylm.process import ServerProcess

__all__ = ["SYSTEM_PROMPTS", "init_model", "main", "spawn_server"]

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


def spawn_server(model_dir: str | Path, **kwargs: Any) -> ServerProcess:
    """``tinylm.process.spawn_server``; a server that never becomes ready raises
    :class:`BackendUnavailable`."""
    from tinylm.process import spawn_server as spawn

    try:
        return spawn(model_dir, **kwargs)
    except tinylm_errors.ServerUnavailable as exc:
        raise BackendUnavailable(str(exc)) from exc


def main(argv: list[str]) -> int:
    """``rollout tinylm ...``: tinylm's own command, with the bundled agents' prompts."""
    from tinylm.cli import main as tinylm_main

    return tinylm_main(argv, system_prompts=SYSTEM_PROMPTS)
