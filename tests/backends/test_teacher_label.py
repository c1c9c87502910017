"""``TeacherBackend.label_turn`` (role A) against a real tinylm teacher in a subprocess, over
real HTTP, whose tokenizer differs from the student's; and its failure rules ("no label").

The teacher is overfit on the math dialogue with its own vocabulary (another seed, a smaller BPE
budget), so the same conversation is different token ids for it than for the student; greedy
decoding gives its action: a ``python`` call on the task, the answer after the tool's output.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends.base import ToolCall
from engine.backends.sglang import load_tokenizer
from engine.backends.teacher import TeacherBackend, TeacherConfig, canonical_messages
from engine.backends.toolcalls import ParsedToolCalls, render_tool_call
from tests.backends.conftest import MATH_DIALOGUE, MATH_QUESTION
from tests.conftest import overfit_tinylm
from tinylm.corpus import PYTHON_TOOL
from tinylm.model import ModelSize
from tinylm.process import ServerProcess

GREEDY = {"temperature": 0.0, "max_new_tokens": 64}
CALL = render_tool_call("python", {"code": "print(17 + 25)"})
ASKED = [{"role": "user", "content": MATH_QUESTION}]
# The student's conversation after its first turn: its call in its own text, the tool's output.
AFTER_CALL = [*ASKED, {"role": "assistant", "content": CALL}, {"role": "tool", "content": "42"}]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("teacher") / "model"
    return overfit_tinylm(
        path, MATH_DIALOGUE, seed=7, size=ModelSize(vocab_size=700), batch_size=2, warmup_steps=5
    )


class Recording(httpx.AsyncBaseTransport):
    """Real HTTP, every ``/generate`` request body kept."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.requests: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            self.requests.append(json.loads(request.content))
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def teacher_for(url: str, path: Path, transport: httpx.AsyncBaseTransport) -> TeacherBackend:
    return TeacherBackend(config=TeacherConfig(url=url, tokenizer_path=path), transport=transport)


def test_the_teacher_reads_the_conversation_in_its_own_tokens_and_acts(
    teacher_server: ServerProcess, teacher_dir: Path, toolcall_dir: Path
) -> None:
    import asyncio

    student_tok = load_tokenizer(toolcall_dir)
    teacher_tok = load_tokenizer(teacher_dir)
    assert student_tok.get_vocab() != teacher_tok.get_vocab()

    async def scenario() -> tuple[Any, Any, list[dict[str, Any]]]:
        recording = Recording()
        teacher = teacher_for(teacher_server.url, teacher_dir, recording)
        try:
            first = await teacher.label_turn(ASKED, tools=[PYTHON_TOOL], sampling_params=GREEDY)
            second = await teacher.label_turn(
                AFTER_CALL, tools=[PYTHON_TOOL], sampling_params=GREEDY
            )
        finally:
            await teacher.aclose()
        return first, second, recording.requests

    first, second, requests = asyncio.run(scenario())

    # What the teacher was sent: the conversation rendered by *its* template and tokenizer,
    # the student's <tool_call> text turned into a structured call the template writes itself.
    for request, history in zip(requests, (ASKED, AFTER_CALL), strict=True):
        rendered = teacher_tok.apply_chat_template(
            canonical_messages(history),
            tools=[PYTHON_TOOL],
            add_generation_prompt=True,
            tokenize=False,
        )
        expected = teacher_tok(rendered, add_special_tokens=False)["input_ids"]
        assert request["input_ids"] == expected
        assert request["input_ids"] != student_tok(rendered, add_special_tokens=False)["input_ids"]
        assert request["sampling_params"] == GREEDY
    assert canonical_messages(AFTER_CALL)[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "python", "arguments": {"code": "print(17 + 25)"}},
            }
        ],
    }

    # Its actions: the call, then the answer; ids in the teacher's vocabulary.
    assert first is not None and second is not None
    assert [(c.name, c.parsed_arguments()) for c in first.tool_calls] == [
        ("python", {"code": "print(17 + 25)"})
    ]
    assert second.tool_calls == () and "<answer>42</answer>" in second.content
    for label in (first, second):
        assert teacher_tok.decode(list(label.token_ids), skip_special_tokens=True) == label.text
        assert max(label.token_ids) < len(teacher_tok)


def test_a_failing_teacher_gives_no_label(
    teacher_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """HTTP error, timeout, an unreachable server, a reply cut at its budget, a malformed tool
    call, a conversation the template cannot render: each is ``None``, logged."""
    import asyncio

    tok = load_tokenizer(teacher_dir)

    def reply(text: str, finish: dict[str, Any]) -> httpx.Response:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return httpx.Response(
            200,
            json={
                "text": text,
                "output_ids": ids,
                "meta_info": {
                    "id": "r",
                    "finish_reason": finish,
                    "prompt_tokens": 3,
                    "completion_tokens": len(ids),
                    "output_token_logprobs": [[-0.5, t, None] for t in ids],
                },
            },
        )

    def handler(kind: str) -> httpx.MockTransport:
        def handle(request: httpx.Request) -> httpx.Response:
            if kind == "http500":
                return httpx.Response(500, json={"message": "teacher overloaded"})
            if kind == "timeout":
                raise httpx.ReadTimeout("timed out", request=request)
            if kind == "length":
                return reply("The answer is", {"type": "length", "length": 3})
            if kind == "malformed":
                return reply("<tool_call>\n{not json\n</tool_call>", {"type": "stop"})
            return reply("The answer is <answer>42</answer>", {"type": "stop"})

        return httpx.MockTransport(handle)

    async def label(kind: str, history: list[dict[str, Any]] = ASKED) -> Any:
        teacher = teacher_for("http://teacher.invalid", teacher_dir, handler(kind))
        try:
            return await teacher.label_turn(
                history, tools=[PYTHON_TOOL], sampling_params=GREEDY, where=f"case {kind}"
            )
        finally:
            await teacher.aclose()

    async def unreachable() -> Any:
        # A port nothing listens on: a real connection refused.
        teacher = TeacherBackend(
            config=TeacherConfig(url="http://127.0.0.1:9", tokenizer_path=teacher_dir)
        )
        try:
            return await teacher.label_turn(ASKED, tools=None, sampling_params=GREEDY)
        finally:
            await teacher.aclose()

    caplog.set_level(logging.WARNING, logger="engine.backends.teacher")
    ok = asyncio.run(label("ok"))
    assert ok is not None and "<answer>42</answer>" in ok.content  # the handler works
    for kind in ("http500", "timeout", "length", "malformed"):
        assert asyncio.run(label(kind)) is None, kind
        assert any(f"case {kind}: no label" in r.getMessage() for r in caplog.records), kind
    bad_history = [{"role": "user", "content": MATH_QUESTION}, {"role": 3}]
    assert asyncio.run(label("ok", bad_history)) is None
    assert asyncio.run(unreachable()) is None


# A teacher family of its own: another template, tools and calls in another syntax.
OTHER_TEMPLATE = (
    "{%- if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls is defined %}"
    "### assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<call>{{ c.function | tojson }}</call>{% endfor %}\n"
    "{%- else %}### {{ m.role }}\n{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}### assistant\n{% endif %}"
)
_CALL = re.compile(r"<call>(.*?)</call>", re.DOTALL)


def parse_other(text: str) -> ParsedToolCalls:
    """The other family's calls: ``<call>{"name": ..., "arguments": {...}}</call>``."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, body in enumerate(_CALL.findall(text)):
        try:
            obj = json.loads(body)
            calls.append(
                ToolCall(name=obj["name"], arguments=json.dumps(obj["arguments"]), id=f"c{i}")
            )
        except (ValueError, KeyError) as exc:
            errors.append(f"bad call {body!r}: {exc}")
    return ParsedToolCalls(
        content=_CALL.sub("", text).strip(), tool_calls=tuple(calls), errors=tuple(errors)
    )


def test_a_teacher_with_its_own_template_and_tool_syntax(teacher_dir: Path) -> None:
    """The student's ``<tool_call>`` text reaches the teacher in the teacher's syntax, and the
    teacher's ``<call>`` reply comes back as canonical calls (nothing of either syntax leaks)."""
    import asyncio

    tok = load_tokenizer(teacher_dir)
    tok.chat_template = OTHER_TEMPLATE
    seen: list[str] = []
    reply_text = (
        'Let me check. <call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</call>'
    )

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(tok.decode(body["input_ids"]))
        ids = tok(reply_text, add_special_tokens=False)["input_ids"]
        return httpx.Response(
            200,
            json={
                "text": reply_text,
                "output_ids": ids,
                "meta_info": {
                    "id": "r",
                    "finish_reason": {"type": "stop"},
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids),
                    "output_token_logprobs": [[-0.1, t, None] for t in ids],
                },
            },
        )

    async def scenario() -> Any:
        teacher = TeacherBackend(
            config=TeacherConfig(url="http://teacher.invalid"),
            tokenizer=tok,
            transport=httpx.MockTransport(handle),
            reply_parser=parse_other,
        )
        try:
            return await teacher.label_turn(AFTER_CALL, tools=[PYTHON_TOOL], sampling_params=GREEDY)
        finally:
            await teacher.aclose()

    label = asyncio.run(scenario())
    (prompt,) = seen
    assert prompt.startswith("TOOLS [")
    assert '<call>{"name": "python", "arguments": {"code": "print(17 + 25)"}}</call>' in prompt
    assert "<tool_call>" not in prompt and prompt.endswith("### assistant\n")
    assert label is not None
    assert label.content == "Let me check."
    assert [(c.name, c.parsed_arguments()) for c in label.tool_calls] == [
        ("python", {"code": "print(6 * 7)"})
    ]
