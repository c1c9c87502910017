"""The recorder's guard and result checks, on the tinylm tokenizer (no server needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.proxy.series import AppendOnlyViolation, Recorder, message_signature
from tinylm.corpus import PYTHON_TOOL

USER = {"role": "user", "content": "hello"}


def _one_turn(tokenizer: Any, tools: Any = None) -> tuple[Recorder, list[int]]:
    rec = Recorder(tokenizer)
    series = rec.sync([USER], tools)
    ids = list(tokenizer("hi there", add_special_tokens=False)["input_ids"])
    rec.generated(
        ids,
        [-0.5] * len(ids),
        content="hi there",
        calls=[],
        prompt_tokens=len(series),
        elapsed_s=0.0,
        finish_reason="stop",
    )
    return rec, ids


def test_signature_sees_role_content_calls_and_ids() -> None:
    base = {"role": "tool", "content": "42", "tool_call_id": "c0", "name": "python"}
    assert message_signature(base) == message_signature(dict(base))
    for key, value in [("role", "user"), ("content", "41"), ("tool_call_id", "c1"), ("name", "x")]:
        assert message_signature({**base, key: value}) != message_signature(base)
    # text parts and a plain string with the same text are the same content
    parts = {**base, "content": [{"type": "text", "text": "42"}]}
    assert message_signature(parts) == message_signature(base)


def test_the_echoed_reply_must_be_the_one_given(random_tokenizer: Any) -> None:
    rec, _ = _one_turn(random_tokenizer)
    before = rec.series()
    with pytest.raises(AppendOnlyViolation, match="not the assistant reply"):
        rec.sync([USER, {"role": "assistant", "content": "something else"}, USER], None)
    with pytest.raises(AppendOnlyViolation, match="should echo the assistant reply"):
        rec.sync([USER, USER], None)
    assert rec.series() == before  # a refused call changes nothing
    rec.sync([USER, {"role": "assistant", "content": "hi there"}, USER], None)
    assert len(rec.series()) > len(before)


def test_an_assistant_turn_the_model_did_not_write_is_refused(random_tokenizer: Any) -> None:
    rec, _ = _one_turn(random_tokenizer)
    echo = {"role": "assistant", "content": "hi there"}
    with pytest.raises(AppendOnlyViolation, match="did not generate"):
        rec.sync([USER, echo, USER, {"role": "assistant", "content": "made up"}], None)


def test_changed_tools_are_a_rewrite(random_tokenizer: Any) -> None:
    rec, _ = _one_turn(random_tokenizer, [PYTHON_TOOL])
    echo = {"role": "assistant", "content": "hi there"}
    with pytest.raises(AppendOnlyViolation, match="tools changed"):
        rec.sync([USER, echo, USER], None)


def test_no_token_data_when_invalid_or_inconsistent(random_tokenizer: Any) -> None:
    rec, ids = _one_turn(random_tokenizer)
    traj = rec.trajectory()
    assert traj is not None and traj.response_token_ids == tuple(ids)
    assert traj.loss_mask == (1,) * len(ids)

    rec.logprobs.pop()  # a length-inconsistent series
    assert rec.trajectory() is None
    rec.logprobs.append(-0.5)
    rec.mask[0] = 0  # the mask no longer matches what the turns generated
    assert rec.trajectory() is None
    rec.mask[0] = 1
    assert rec.trajectory() is not None
    rec.invalidate("test")
    rec.invalidate("second reason")
    assert rec.trajectory() is None and rec.invalid_reason == "test"


def test_nothing_generated_is_no_trajectory(random_tokenizer: Any) -> None:
    rec = Recorder(random_tokenizer)
    assert rec.trajectory() is None
    rec.sync([USER], None)
    assert rec.trajectory() is None


def test_a_consumed_message_is_checked_by_signature_when_it_differs(
    random_tokenizer: Any,
) -> None:
    """The guard's fast path (an unchanged consumed message compares equal) must not let a
    rewrite through, nor refuse a message that differs only where the signature ignores."""
    rec, ids = _one_turn(random_tokenizer)
    echo = {"role": "assistant", "content": "hi there"}
    obs = {"role": "user", "content": "next"}
    rec.sync([USER, echo, obs], None)
    rec.generated(ids, [-0.5] * len(ids), content="hi there", calls=[], prompt_tokens=1,
                  elapsed_s=0.0, finish_reason="stop")  # fmt: skip
    before = rec.series()
    # an extra field the signature ignores, and text parts for a string: the same history
    same = [{**USER, "extra": 1}, echo, {"role": "user", "content": [{"type": "text",
                                                                     "text": "next"}]}]
    with pytest.raises(AppendOnlyViolation, match="rewritten at message 2"):
        rec.sync([USER, echo, {"role": "user", "content": "changed"}, echo, obs], None)
    assert rec.series() == before
    rec.sync([*same, echo, obs], None)
    assert len(rec.series()) > len(before)
    assert len(rec.consumed) == len(rec.seen) == 5


def test_tools_mutated_in_place_are_still_a_rewrite(random_tokenizer: Any) -> None:
    """The copy kept of the first call's tools is the recorder's own: a caller that edits its
    list in place between calls cannot make a change look like no change."""
    tools = [json.loads(json.dumps(PYTHON_TOOL))]
    rec, _ = _one_turn(random_tokenizer, tools)
    tools[0]["function"]["description"] = "something else"
    echo = {"role": "assistant", "content": "hi there"}
    with pytest.raises(AppendOnlyViolation, match="tools changed"):
        rec.sync([USER, echo, USER], tools)


def test_a_call_that_fails_midway_leaves_the_series_as_it_was(random_tokenizer: Any) -> None:
    rec, _ = _one_turn(random_tokenizer)
    before, consumed = rec.series(), list(rec.consumed)
    echo = {"role": "assistant", "content": "hi there"}
    # renders (the template ignores a user message's tool_calls) but has no signature
    odd = {"role": "user", "content": "x", "tool_calls": 5}
    with pytest.raises(TypeError):  # the server turns capture off on such an error
        rec.sync([USER, echo, odd], None)
    assert rec.series() == before and rec.consumed == consumed and len(rec.seen) == 1


def test_work_prepared_ahead_gives_the_same_series(random_tokenizer: Any) -> None:
    """``prepare`` (run by the proxy once a reply is sent) moves the next call's template work
    off its path: the series, history and turns must be what computing it inline gives, also
    when a refused call comes between the prepare and the call that uses it."""
    ids = list(random_tokenizer("hi there", add_special_tokens=False)["input_ids"])
    eos = random_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos in random_tokenizer.all_special_ids
    ahead, inline = Recorder(random_tokenizer), Recorder(random_tokenizer)
    messages: list[dict[str, Any]] = [USER]
    for turn in range(4):
        series = [rec.sync(messages, None) for rec in (ahead, inline)]
        assert series[0] == series[1]
        assert ahead.ahead is None  # used up by the call that consumed it
        out = [*ids, eos] if turn % 2 else ids  # with and without the end-of-turn token
        for rec in (ahead, inline):
            rec.generated(
                out,
                [-0.5] * len(out),
                content="hi there",
                calls=[],
                prompt_tokens=len(series[0]),
                elapsed_s=0.0,
                finish_reason="stop",
            )
        ahead.prepare()
        assert ahead.ahead is not None and ahead.ahead.reply is ahead.last
        if turn == 1:
            with pytest.raises(AppendOnlyViolation, match="not the assistant reply"):
                ahead.sync([*messages, {"role": "assistant", "content": "other"}, USER], None)
        messages = [*messages, {"role": "assistant", "content": "hi there"},
                    {"role": "user", "content": f"observation {turn}"}]  # fmt: skip
    assert ahead.history == inline.history
    assert ahead.trajectory() == inline.trajectory() is not None
