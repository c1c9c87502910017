"""``AgentResult``'s checks: what an agent hands back is refused with a message naming the
field when its per-response-token arrays do not line up, and its empty defaults are shared
immutable arrays that still read as "not recorded"."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from engine.agents.result import AgentResult
from engine.domain import TerminationReason
from engine.events.arrays import LogProbs, Mask, TokenIds

FINISH = TerminationReason.FINISH
OK: dict[str, Any] = {
    "prompt_token_ids": [1, 2], "response_token_ids": [3, 4, 5],
    "response_logprobs": [-0.1, -0.2, -0.3], "loss_mask": [1, 1, 0],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [1, 1]}, "loss_mask has 2 entries for 3 response tokens"),
        ({"loss_mask": [1, 2, 0]}, "loss_mask entries must be 0 or 1"),
        ({"response_logprobs": [-0.1]}, "response logprobs have 1 entries for 3"),
        ({"response_versions": [1, 1]}, "response_versions has 2 entries for 3 response"),
        ({"teacher_mask": [0, 1]}, "teacher_mask has 2 entries for 3 response tokens"),
        ({"teacher_mask": [0, 1, 3]}, "teacher_mask entries must be 0 or 1"),
        ({"student_cut_points": (1, 1)}, r"must be increasing response offsets, got \(1, 1\)"),
        ({"student_cut_points": (2, 0)}, "student_cut_points must be increasing"),
        ({"student_cut_points": (0, 3)}, r"got \(0, 3\) for 3 response tokens"),
        ({"response_token_ids": [3, -4, 5]}, "token ids must be non-negative"),
        ({"prompt_token_ids": [-1]}, "token ids must be non-negative"),
    ],
)
def test_arrays_that_do_not_line_up_are_refused_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        AgentResult(**{**OK, **change}, termination_reason=FINISH)


def test_what_lines_up_is_accepted() -> None:
    result = AgentResult(**OK, response_versions=[2, -1, 2], teacher_mask=[0, 0, 1],
                         student_cut_points=(0, 2), termination_reason=FINISH)
    assert result.student_cut_points == (0, 2) and result.has_logprobs
    assert result.response_versions.tolist() == [2, -1, 2]


def test_the_empty_defaults_are_empty_arrays_of_their_class() -> None:
    a = AgentResult(termination_reason=FINISH)
    b = AgentResult(termination_reason=FINISH)
    for name, cls in [("prompt_token_ids", TokenIds), ("response_token_ids", TokenIds),
                      ("response_logprobs", LogProbs), ("loss_mask", Mask),
                      ("response_versions", TokenIds)]:
        value = getattr(a, name)
        assert type(value) is cls and len(value) == 0 and value == getattr(b, name)
    assert a.model_fields_set == {"termination_reason"} and a == b
    assert a.metrics == {} and a.metrics is not b.metrics  # a dict is still one per result
    assert not a.has_logprobs
