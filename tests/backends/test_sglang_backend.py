"""``SGLangBackend`` and ``TeacherBackend`` against the tinylm server, over real sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.backends import (
    Capabilities,
    GenerationResult,
    HTTPSettings,
    ModelBackend,
    SGLangBackend,
    SGLangConfig,
    TeacherBackend,
    TeacherConfig,
)
from engine.errors import BackendUnavailable
from tests.backends.conftest import MATH_QUESTION
from tests.backends.test_tinylm_server import wait_until
from tinylm.corpus import PYTHON_TOOL
from tinylm.server import TinyLMServer, start_server

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]


@pytest.fixture
async def sglang(tinylm_server: TinyLMServer, tinylm_dir: Path) -> AsyncIterator[SGLangBackend]:
    backend = SGLangBackend(config=SGLangConfig(url=tinylm_server.url, tokenizer_path=tinylm_dir))
    yield backend
    await backend.aclose()


async def test_is_a_token_level_model_backend(sglang: SGLangBackend) -> None:
    assert isinstance(sglang, ModelBackend) and sglang.capabilities == Capabilities(
        token_ids=True, scoring=True, abort=True, weight_version=True, health=True
    )
    ids = sglang.tokenize("What is 17 + 25?")
    assert sglang.decode(ids) == "What is 17 + 25?"


async def test_generate_returns_the_sampled_tokens_and_their_logprobs(
    sglang: SGLangBackend,
) -> None:
    result = await sglang.generate(
        input_ids=PROMPT,
        sampling_params={
            "max_new_tokens": 8,
            "temperature": 1.0,
            "sampling_seed": 1,
            "ignore_eos": True,
        },
    )
    assert result.finish_reason == "length"
    assert result.token_ids is not None and result.logprobs is not None
    assert len(result.token_ids) == len(result.logprobs) == 8
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.usage is not None and result.usage.prompt_tokens == len(PROMPT)
    assert result.usage.completion_tokens == 8
    assert result.text == sglang.decode(result.token_ids)


async def test_same_seed_same_tokens(sglang: SGLangBackend) -> None:
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 99}
    first = await sglang.generate(input_ids=PROMPT, sampling_params=params)
    again = await sglang.generate(input_ids=PROMPT, sampling_params=params)
    assert first.token_ids == again.token_ids and first.logprobs == again.logprobs


async def test_messages_are_rendered_with_the_chat_template(sglang: SGLangBackend) -> None:
    messages = [{"role": "user", "content": MATH_QUESTION}]
    params = {"max_new_tokens": 6, "temperature": 0}
    via_messages = await sglang.generate(
        messages=messages, tools=[PYTHON_TOOL], sampling_params=params
    )
    ids = sglang.render_messages(messages, [PYTHON_TOOL])
    assert sglang.decode(ids).endswith(f"user\n{MATH_QUESTION}\nassistant\n")
    via_ids = await sglang.generate(input_ids=ids, sampling_params=params)
    assert via_messages.token_ids == via_ids.token_ids


async def test_stop_token_is_kept_in_the_tokens(sglang: SGLangBackend) -> None:
    greedy = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = await sglang.generate(input_ids=PROMPT, sampling_params=greedy)
    assert full.token_ids is not None
    stop = full.token_ids[2]
    cut = await sglang.generate(
        input_ids=PROMPT, sampling_params={**greedy, "stop_token_ids": [stop]}
    )
    assert cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]


async def test_concurrent_generations_share_one_pooled_client(sglang: SGLangBackend) -> None:
    params = {"max_new_tokens": 4, "temperature": 0}
    results = await asyncio.gather(
        *[sglang.generate(input_ids=PROMPT, sampling_params=params) for _ in range(6)]
    )
    assert len({r.token_ids for r in results}) == 1
    client = sglang._http._client
    await sglang.generate(input_ids=PROMPT, sampling_params=params)
    assert sglang._http._client is client  # created once, reused
    await sglang.aclose()
    assert sglang._http._client is None


async def test_abort_by_rid_gives_an_aborted_result_holding_the_partial_output(
    sglang: SGLangBackend, tinylm_server: TinyLMServer
) -> None:
    task = asyncio.create_task(
        sglang.generate(
            input_ids=PROMPT,
            rid="abort-me",
            sampling_params={"max_new_tokens": 100_000, "ignore_eos": True},
        )
    )
    await asyncio.to_thread(
        wait_until,
        lambda: "abort-me" in tinylm_server.scheduler.running_rids(),
        "the request to run",
    )
    await sglang.abort("abort-me")
    result = await task
    # The tokens sampled before the abort come back with their logprobs (SGLang answers a
    # running request it aborts with its partial output), so a turn can be continued.
    assert result == GenerationResult(
        text=result.text, token_ids=result.token_ids, logprobs=result.logprobs,
        finish_reason="abort", usage=result.usage,
    )  # fmt: skip
    assert result.aborted and result.usage is not None
    assert len(result.token_ids or ()) == len(result.logprobs or ()) == (
        result.usage.completion_tokens
    )


async def test_health_and_weight_version_read_the_servers_routes(tinylm_dir: Path) -> None:
    with start_server(tinylm_dir, weight_version="7") as server:
        backend = SGLangBackend(config=SGLangConfig(url=server.url))
        try:
            await backend.health()
            await backend.health(generate=True)
            assert await backend.weight_version() == 7
        finally:
            await backend.aclose()
    with start_server(tinylm_dir) as server:  # no --weight-version: SGLang's "default"
        backend = SGLangBackend(config=SGLangConfig(url=server.url))
        try:
            assert await backend.weight_version() is None
        finally:
            await backend.aclose()
    gone = SGLangBackend(config=SGLangConfig(url=server.url, http=HTTPSettings(connect_retries=0)))
    with pytest.raises(BackendUnavailable, match="/health"):
        await gone.health()
    await gone.aclose()


async def test_server_shutdown_aborts_a_generation_in_flight(tinylm_dir: Path) -> None:
    server = start_server(tinylm_dir, max_running_requests=1)
    backend = SGLangBackend(config=SGLangConfig(url=server.url))
    task = asyncio.create_task(
        backend.generate(
            input_ids=PROMPT,
            rid="in-flight",
            sampling_params={"max_new_tokens": 100_000, "ignore_eos": True},
        )
    )
    await asyncio.to_thread(
        wait_until, lambda: "in-flight" in server.scheduler.running_rids(), "the request to run"
    )
    closer = threading.Thread(target=server.close)
    closer.start()
    result = await task
    closer.join()
    await backend.aclose()
    assert result.aborted


async def test_score_returns_per_token_logprobs_and_sorted_top_k(sglang: SGLangBackend) -> None:
    sampled = await sglang.generate(
        input_ids=PROMPT,
        sampling_params={
            "max_new_tokens": 10,
            "temperature": 1.0,
            "sampling_seed": 5,
            "ignore_eos": True,
        },
    )
    assert sampled.token_ids is not None and sampled.logprobs is not None
    score = await sglang.score(PROMPT, sampled.token_ids, top_logprobs_num=4)
    assert score.token_ids == sampled.token_ids
    assert score.logprobs == pytest.approx(sampled.logprobs, abs=1e-5)
    assert len(score.top_token_ids) == len(score.top_logprobs) == 10
    for ids, lps, chosen, lp in zip(
        score.top_token_ids, score.top_logprobs, score.token_ids, score.logprobs, strict=True
    ):
        assert len(ids) == 4 and list(lps) == sorted(lps, reverse=True)
        assert lps[0] >= lp - 1e-6  # the best alternative is at least as likely as the chosen
        if chosen in ids:
            assert lps[ids.index(chosen)] == pytest.approx(lp, abs=1e-6)
    assert (await sglang.score(PROMPT, [])).token_ids == ()
    with pytest.raises(ValueError, match="non-empty prompt"):
        await sglang.score([], [1, 2])


async def test_teacher_scores_with_its_own_tokenizer_and_default_k(
    tinylm_server: TinyLMServer, tinylm_dir: Path
) -> None:
    teacher = TeacherBackend(config=TeacherConfig(url=tinylm_server.url, tokenizer_path=tinylm_dir))
    prompt = teacher.tokenize("What is 17 + 25?")
    response = teacher.tokenize(" 42")
    score = await teacher.score_response(prompt, response)
    await teacher.aclose()
    assert score.token_ids == tuple(response)
    assert all(len(top) == 20 for top in score.top_token_ids)
    assert teacher.tokenizer is not None and teacher.decode(response) == " 42"
