"""Loaders of the engine's configuration inputs: the rollout YAML (``rollout``), the evaluator
config file (``evaluators``) and the cluster layout (``layout``). Each refuses bad input with a
``ConfigError`` naming the file (or variable), the entry and the key, phrased by
``engine.messages``."""
