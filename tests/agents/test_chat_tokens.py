"""Observation increments: what the chat template adds after a turn, tokenized on its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.agents.chat_tokens import ChatTokens, TokenSeries
from engine.agents.tools import PythonTool
from engine.backends.sglang import load_tokenizer
from engine.errors import AgentError

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
TOOL = [{"role": "tool", "name": "python", "content": "42"}]
TAIL = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_increment_after_the_end_of_turn_token(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer, [PythonTool().schema()])
    assert chat.assistant_close(HISTORY) == "<|im_end|>\n"
    generated = [*chat.encode("<tool_call>\nx\n</tool_call>"), tokenizer.eos_token_id]
    obs = chat.observation(HISTORY, generated, TOOL)
    assert obs.text == "\n" + TAIL
    assert list(obs.token_ids) == chat.encode(obs.text)


@pytest.mark.parametrize("last", ["words", "<|endoftext|>"])
def test_turn_not_closed_by_the_model_gets_the_whole_close(tokenizer: Any, last: str) -> None:
    chat = ChatTokens(tokenizer, None)
    generated = chat.encode(f"some text {last}")
    obs = chat.observation(HISTORY, generated, TOOL)
    assert obs.text == "<|im_end|>\n" + TAIL
    # Rendered after the generation, the series decodes to the conversation plus the close.
    series = chat.prompt_ids(HISTORY) + generated + list(obs.token_ids)
    assert chat.decode(series, skip_special_tokens=False) == chat.render(
        [*HISTORY, {"role": "assistant", "content": f"some text {last}"}, *TOOL],
        generation_prompt=True,
    )


def test_a_template_that_is_not_append_only_is_refused(model_dir: Path) -> None:
    tok = load_tokenizer(model_dir)
    tok.chat_template = (
        "{%- for m in messages[-1:] -%}{{ m.role }}: {{ m.content }}\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}assistant: {%- endif -%}"
    )
    chat = ChatTokens(tok, None)
    with pytest.raises(AgentError, match="token-exactly"):
        chat.observation(HISTORY, [1], TOOL)


def test_generated_tokens_keep_the_version_each_was_sampled_with() -> None:
    series = TokenSeries(prompt=[1, 2])
    series.generated([5, 6, 7], [-0.1, -0.2, -0.3], [0, 0, 1])  # a turn continued on v1
    series.observed([9])
    series.generated([8], [-0.4], [None])
    assert series.versions == [0, 0, 1, -1, -1]
    assert series.mask == [1, 1, 1, 0, 1] and series.ids() == [1, 2, 5, 6, 7, 9, 8]
    with pytest.raises(ValueError, match="2 versions for 3 generated tokens"):
        series.generated([1, 2, 3], [0.0, 0.0, 0.0], [1, 1])
