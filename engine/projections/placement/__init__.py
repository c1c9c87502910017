"""The placement pool: the fold of ``rl:pool`` (``pool``) and the pure decisions taken on
its state (``allocation``); the scheduler records the grants it decides as ``TokenAcquired``."""

from engine.projections.placement import allocation, pool
from engine.projections.placement.allocation import *  # noqa: F403
from engine.projections.placement.pool import *  # noqa: F403

__all__ = [*allocation.__all__, *pool.__all__]
