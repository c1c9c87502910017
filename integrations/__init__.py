"""Adapters that plug the rollout engine into other projects' trainers.

Each module speaks one trainer's own shapes over the engine's public client
(``engine.client``) and is installed with its extra: ``integrations.trl`` (TRL's
``GRPOTrainer``, extra ``trl``), ``integrations.slime`` (slime's rollout function and
rollout manager), ``integrations.verl`` (verl's agent loop, extra ``verl``). The engine never
imports this package (an import-linter contract holds it so); docs/integrations.md shows each
one in use.
"""
