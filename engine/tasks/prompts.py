"""The bundled tasks' system prompts: one definition for the agents that run the tasks
(``engine.tasks.evaluators``) and for the tinylm corpus that teaches the model their format."""

from __future__ import annotations

__all__ = ["MATH_SYSTEM_PROMPT", "SHELL_SYSTEM_PROMPT"]

MATH_SYSTEM_PROMPT = (
    "Solve the problem. Use the python tool to compute, then give the final answer inside "
    "<answer></answer>."
)
SHELL_SYSTEM_PROMPT = (
    "You work in a sandbox. Use the shell tool to change files. When the task is done, reply "
    "<answer>done</answer>."
)
