"""The ``math`` task's verifier: is the episode's final answer the label?

The answer (``extract_answer``, from the last generated turn) is the content of the last
``<answer>...</answer>`` block, or the last number inside it when the content is not a number,
else the last number of the text. It matches (``answers_match``) when it equals the label, both
stripped, or both read as numbers within ``1e-6`` (absolute below 1, relative above). Numbers
may carry a sign, decimals, an exponent and thousands separators, or be a fraction of integers
(``"3/4"``); a leading ``$`` and a trailing period are ignored. ``MathVerifier`` scores 1.0 or
0.0, its detail saying what was extracted, from where and how it matched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import JsonValue

from engine.agents.tool_agent import FinishedEpisode, Verdict
from engine.domain import Task
from engine.errors import ConfigError

__all__ = [
    "DEFAULT_TOLERANCE",
    "Extraction",
    "MathVerifier",
    "answers_match",
    "extract_answer",
    "label_text",
    "parse_number",
    "verify_math",
]

DEFAULT_TOLERANCE = 1e-6

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_TEXT = (
    r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?(?![\w])"
    r"|(?<![\w.])[-+]?\.\d+(?:[eE][-+]?\d+)?"
)
_NUMBER_IN_TEXT = re.compile(_NUMBER_TEXT)
_PLAIN = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_GROUPED = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_FRACTION = re.compile(r"([-+]?\d+)/(\d+)")

Source = Literal["answer_tag", "answer_tag_number", "last_number", "none"]


def parse_number(text: str) -> float | None:
    """``text`` as a finite number, or ``None``."""
    s = text.strip()
    if s.startswith("$"):
        s = s[1:].strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    if _GROUPED.fullmatch(s):
        s = s.replace(",", "")
    fraction = _FRACTION.fullmatch(s)
    if fraction is not None:
        denominator = int(fraction.group(2))
        if denominator == 0:
            return None
        return int(fraction.group(1)) / denominator
    if not _PLAIN.fullmatch(s):
        return None
    value = float(s)
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class Extraction:
    """The answer text found in a generation and where it came from."""

    text: str | None
    source: Source


def _last_number(text: str) -> str | None:
    found = _NUMBER_IN_TEXT.findall(text)
    return found[-1] if found else None


def extract_answer(text: str) -> Extraction:
    tags = _ANSWER.findall(text)
    if tags:
        content = tags[-1].strip()
        if parse_number(content) is not None:
            return Extraction(content, "answer_tag")
        number = _last_number(content)
        if number is not None:
            return Extraction(number, "answer_tag_number")
        return Extraction(content, "answer_tag")
    number = _last_number(text)
    if number is not None:
        return Extraction(number, "last_number")
    return Extraction(None, "none")


def answers_match(
    predicted: str, label: str, *, tolerance: float = DEFAULT_TOLERANCE
) -> Literal["exact", "numeric", "none"]:
    """How ``predicted`` matches ``label``: as strings, as numbers, or not at all."""
    if predicted.strip() == label.strip():
        return "exact"
    a, b = parse_number(predicted), parse_number(label)
    if a is not None and b is not None and abs(a - b) <= tolerance * max(1.0, abs(b)):
        return "numeric"
    return "none"


def verify_math(text: str, label: str, *, tolerance: float = DEFAULT_TOLERANCE) -> Verdict:
    found = extract_answer(text)
    match = "none" if found.text is None else answers_match(found.text, label, tolerance=tolerance)
    value = None if found.text is None else parse_number(found.text)
    detail: dict[str, JsonValue] = {
        "extracted": found.text,
        "source": found.source,
        "match": match,
        "has_answer_tag": found.source in ("answer_tag", "answer_tag_number"),
        "exact_match": match == "exact",
        "numeric_match": match == "numeric",
    }
    if value is not None:
        detail["predicted_value"] = value
    return Verdict(score=1.0 if match != "none" else 0.0, detail=detail)


def label_text(task: Task) -> str:
    """The task's label as text; ``ConfigError`` naming the task when there is none."""
    label = task.label
    if isinstance(label, bool) or label is None:
        raise ConfigError(
            f"math task {task.sample_id} (dataset {task.dataset_name!r}, line "
            f"{task.source_line}): the label must be the answer as a string or number, "
            f"got {label!r}"
        )
    if isinstance(label, int | float):
        return repr(label) if isinstance(label, float) else str(label)
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(
            f"math task {task.sample_id} (dataset {task.dataset_name!r}, line "
            f"{task.source_line}): the label must be a non-empty string or a number, "
            f"got {label!r}"
        )
    return label


@dataclass(frozen=True, kw_only=True)
class MathVerifier:
    """``Verifier`` of the ``math`` task type: the last generated turn against the label."""

    tolerance: float = DEFAULT_TOLERANCE

    async def verify(self, task: Task, episode: FinishedEpisode) -> Verdict:
        return verify_math(episode.final_text, label_text(task), tolerance=self.tolerance)
