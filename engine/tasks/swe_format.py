"""Teach tinylm mini-swe-agent's reply format, as ``tinylm init`` teaches it the tool format.

mini-swe-agent accepts a reply only with exactly one fenced ``bash`` block and gives up after
three malformed ones, which an untrained tiny model never writes. These dialogues are the
conversations mini-swe-agent would hold on generated ``swe`` tasks (seeds apart from the bundled
datasets'), rendered with the plug-in's own templates: the ``sed`` edit the hint names,
``sh test.sh``, then the submit command. The model needs only to speak the format, not to solve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import StrictUndefined, Template

from engine.agents.scaffolds.mini_swe_agent import (
    INSTANCE_TEMPLATE,
    OBSERVATION_TEMPLATE,
    SUBMIT_COMMAND,
    SYSTEM_TEMPLATE,
)
from engine.tasks.swe import SweItem, fix_command, generate_items

if TYPE_CHECKING:
    from tinylm.model import InitReport

__all__ = ["CORPUS_SEED", "format_dialogues", "init_swe_model", "reply", "swe_messages"]

CORPUS_SEED = 1000  # the bundled datasets use seeds 1 and 2


def _render(template: str, **values: Any) -> str:
    return str(Template(template, undefined=StrictUndefined).render(**values))


def reply(thought: str, command: str) -> str:
    return f"THOUGHT: {thought}\n\n```bash\n{command}\n```"


def observation(returncode: int, output: str) -> str:
    return _render(
        OBSERVATION_TEMPLATE,
        output={"returncode": returncode, "output": output, "exception_info": ""},
    )


def swe_messages(item: SweItem) -> list[dict[str, Any]]:
    """The conversation mini-swe-agent holds when the model fixes ``item`` in three steps."""
    return [
        {"role": "system", "content": _render(SYSTEM_TEMPLATE)},
        {"role": "user", "content": _render(INSTANCE_TEMPLATE, task=item.issue)},
        {"role": "assistant", "content": reply(
            f"The hint says what to change in {item.fix_file}, so I edit it.",
            fix_command(item))},
        {"role": "user", "content": observation(0, "")},
        {"role": "assistant", "content": reply("Now I run the tests.", "sh test.sh")},
        {"role": "user", "content": observation(0, "PASS\n")},
        {"role": "assistant", "content": reply("The tests pass, so I submit.", SUBMIT_COMMAND)},
    ]  # fmt: skip


def format_dialogues(n: int, *, seed: int = CORPUS_SEED) -> list[Any]:
    """``n`` format dialogues (``tinylm.corpus.Dialogue``), deterministic in ``seed``."""
    from tinylm.corpus import Dialogue

    return [Dialogue(messages=swe_messages(item)) for item in generate_items(n, seed=seed)]


def init_swe_model(
    model_dir: str | Path,
    *,
    dialogues: Sequence[Any] | None = None,
    steps: int = 300,
    batch_size: int = 4,
    seed: int = 0,
    log: Callable[[str], None] = lambda _msg: None,
) -> InitReport:
    """A tinylm that speaks mini-swe-agent's format."""
    from engine.tasks.prompts import MATH_SYSTEM_PROMPT, SHELL_SYSTEM_PROMPT
    from tinylm.corpus import SystemPrompts
    from tinylm.model import TrainSettings, init_model

    corpus = list(dialogues) if dialogues is not None else format_dialogues(240)
    return init_model(
        model_dir,
        system_prompts=SystemPrompts(math=MATH_SYSTEM_PROMPT, shell=SHELL_SYSTEM_PROMPT),
        seed=seed,
        dialogues=corpus,
        train=TrainSettings(
            steps=steps, batch_size=batch_size, learning_rate=5e-3, warmup_steps=10
        ),
        log=log,
    )
