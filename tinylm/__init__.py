"""tinylm: a tiny Qwen2-style model and an SGLang-compatible CPU server for it.

``init_model`` (``rollout tinylm init DIR``) writes a briefly trained model in Hugging Face
format, trained on dialogues rendered with the ``SystemPrompts`` of the agents it will serve;
``start_server`` (in-process, for tests), ``spawn_server`` (a subprocess) and ``serve``
(``rollout tinylm serve --model-path DIR --port P``) serve it with SGLang's ``/generate``, OpenAI's
``/v1/chat/completions`` and ``/abort_request``. Demos and tests exercise real HTTP, real
tokenizers and real logprobs with it, without a GPU.

tinylm imports nothing from the engine (an import-linter contract holds it to that): it is
the model server's side, as SGLang is. Importing this package is cheap; torch and
transformers load when a model is built or served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinylm.corpus import SystemPrompts
    from tinylm.model import InitReport, init_model
    from tinylm.process import ServerProcess, spawn_server
    from tinylm.server import ServerConfig, TinyLMServer, serve, start_server

__all__ = [
    "InitReport",
    "ServerConfig",
    "ServerProcess",
    "SystemPrompts",
    "TinyLMServer",
    "init_model",
    "serve",
    "spawn_server",
    "start_server",
]

_HOMES = {
    "SystemPrompts": "tinylm.corpus",
    "InitReport": "tinylm.model",
    "init_model": "tinylm.model",
    "ServerProcess": "tinylm.process",
    "spawn_server": "tinylm.process",
    "ServerConfig": "tinylm.server",
    "TinyLMServer": "tinylm.server",
    "serve": "tinylm.server",
    "start_server": "tinylm.server",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'tinylm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
