"""Loaders of the engine's configuration inputs; each refuses bad input with a ``ConfigError``
naming the file (or variable), the entry and the key.

- ``engine.config.rollout``: the rollout YAML (training and eval datasets);
- ``engine.config.evaluators``: the Python file exposing ``evaluator_profiles(args)`` and
  ``build_agents(args)``;
- ``engine.config.layout``: the cluster layout (inline JSON or a file).

Validation errors are phrased by ``engine.messages`` (shared with ``engine.settings``, where
every environment variable is declared).
"""
