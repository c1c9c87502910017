"""tinylm's own exceptions (it imports nothing from the engine).

::

    TinyLMError
    ├── ConfigError        a model folder, checkpoint or server setting is invalid
    └── ServerUnavailable  a spawned server never became ready

The engine side translates them where it drives tinylm (``engine.ops.tinylm``).
"""

from __future__ import annotations

__all__ = ["ConfigError", "ServerUnavailable", "TinyLMError"]


class TinyLMError(Exception):
    """Root of every error tinylm raises on purpose."""


class ConfigError(TinyLMError):
    """Invalid model folder, checkpoint, corpus or server setting; the message names it."""


class ServerUnavailable(TinyLMError):
    """A spawned tinylm server exited or did not print its ready line in time."""
