"""Event-sourced rollout engine for agentic RL training.

Components coordinate only by appending typed events to Redis Streams; see DESIGN.md.
"""

from engine.errors import EngineError

__all__ = ["EngineError"]
