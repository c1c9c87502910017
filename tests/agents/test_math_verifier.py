"""The ``math`` verifier: answer extraction and exact/numeric matching."""

from __future__ import annotations

import pytest

from engine.errors import ConfigError
from engine.tasks.math import (
    answers_match,
    extract_answer,
    label_text,
    parse_number,
    verify_math,
)
from tests.agents.conftest import make_task


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("42.0", 42.0),
        ("4.2e1", 42.0),
        ("1,234", 1234.0),
        ("-1,234.5", -1234.5),
        (" +7 ", 7.0),
        ("$12", 12.0),
        ("42.", 42.0),
        (".5", 0.5),
        ("3/4", 0.75),
        ("1,23", None),
        ("1/0", None),
        ("forty-two", None),
        ("", None),
        ("1e999", None),
    ],
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("text", "extracted", "source"),
    [
        ("The answer is <answer>42</answer>", "42", "answer_tag"),
        ("<answer>1</answer> no wait <answer> 2 </answer>", "2", "answer_tag"),
        ("<answer>the answer is 1,234.</answer>", "1,234", "answer_tag_number"),
        ("<answer>lemon</answer>", "lemon", "answer_tag"),
        ("17 + 25 = 42", "42", "last_number"),
        ("x = -3.5e2 then", "-3.5e2", "last_number"),
        ("a2b and v3 are not numbers", None, "none"),
        ("no numbers at all", None, "none"),
    ],
)
def test_extract_answer(text: str, extracted: str | None, source: str) -> None:
    found = extract_answer(text)
    assert (found.text, found.source) == (extracted, source)


@pytest.mark.parametrize(
    ("predicted", "label", "match"),
    [
        ("42", "42", "exact"),
        (" 42 ", "42", "exact"),
        ("42.0", "42", "numeric"),
        ("4.2e1", "42", "numeric"),
        ("1,234", "1234", "numeric"),
        ("0.3333333", "1/3", "numeric"),
        ("0.33", "1/3", "none"),
        ("1000000.5", "1000000", "numeric"),  # relative tolerance above 1
        ("43", "42", "none"),
        ("lemon", "lemon", "exact"),
        ("lime", "lemon", "none"),
    ],
)
def test_answers_match(predicted: str, label: str, match: str) -> None:
    assert answers_match(predicted, label) == match


def test_verify_math_scores_and_explains() -> None:
    right = verify_math("I computed it. <answer>42.0</answer>", "42")
    assert right.score == 1.0
    assert right.detail["match"] == "numeric" and right.detail["has_answer_tag"] is True
    assert right.as_reward() == {
        "score": 1.0,
        "has_answer_tag": 1.0,
        "exact_match": 0.0,
        "numeric_match": 1.0,
        "predicted_value": 42.0,
    }
    fallback = verify_math("so it is 42", "42")
    assert fallback.score == 1.0 and fallback.detail["source"] == "last_number"
    wrong = verify_math("<answer>41</answer> (42 was a guess)", "42")
    assert wrong.score == 0.0 and wrong.detail["extracted"] == "41"
    nothing = verify_math("I do not know", "42")
    assert nothing.score == 0.0 and nothing.as_reward()["score"] == 0.0
    assert "predicted_value" not in nothing.detail


def test_label_text() -> None:
    assert label_text(make_task(label="42")) == "42"
    for bad in ("", "  "):
        with pytest.raises(ConfigError, match="r1:s0"):
            label_text(make_task(label=bad))
