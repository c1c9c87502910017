"""Token fidelity: sampling-time logprobs against a force-decode of the same tokens."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from engine.backends import SGLangBackend, SGLangConfig, check_generation, check_token_fidelity
from engine.backends.fidelity import compare_logprobs
from tinylm.sampling import LogprobMode
from tinylm.server import TinyLMServer, start_server

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]


@pytest.fixture
async def sglang(tinylm_server: TinyLMServer) -> AsyncIterator[SGLangBackend]:
    backend = SGLangBackend(config=SGLangConfig(url=tinylm_server.url))
    yield backend
    await backend.aclose()


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 50},
        {"temperature": 0.0},
    ],
    ids=["t1", "t0.7-topp-topk", "greedy"],
)
async def test_sampled_logprobs_match_a_rescore_within_1e_5(
    sglang: SGLangBackend, params: dict[str, Any]
) -> None:
    result = await sglang.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 48, "ignore_eos": True, "sampling_seed": 11, **params},
    )
    report = await check_generation(sglang, PROMPT, result)
    assert report.n_tokens == 48
    assert report.ok, report.describe()
    assert report.max_abs_diff <= 1e-5


async def test_concurrent_sampling_keeps_fidelity(sglang: SGLangBackend) -> None:
    import asyncio

    prompts = [PROMPT[: 3 + i] for i in range(6)]
    results = await asyncio.gather(
        *[
            sglang.generate(
                input_ids=p,
                sampling_params={"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": i},
            )
            for i, p in enumerate(prompts)
        ]
    )
    reports = await asyncio.gather(
        *[check_generation(sglang, p, r) for p, r in zip(prompts, results, strict=True)]
    )
    assert all(r.ok for r in reports), [r.describe() for r in reports]


async def test_a_tampered_logprob_is_caught_at_its_position(sglang: SGLangBackend) -> None:
    result = await sglang.generate(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 10, "ignore_eos": True, "sampling_seed": 2},
    )
    assert result.token_ids is not None and result.logprobs is not None
    recorded = list(result.logprobs)
    recorded[3] += 1e-3
    report = await check_token_fidelity(
        sglang, prompt_ids=PROMPT, response_ids=result.token_ids, sampled_logprobs=recorded
    )
    assert not report.ok and report.worst_index == 3
    assert report.max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert "MISMATCH" in report.describe()


@pytest.fixture
def processed_server(tinylm_dir: Path) -> Any:
    with start_server(
        tinylm_dir, max_running_requests=2, logprob_mode=LogprobMode.PROCESSED
    ) as server:
        yield server


async def test_sglang_default_processed_logprobs_fail_fidelity_at_low_temperature(
    processed_server: TinyLMServer,
) -> None:
    """What the check exists for: SGLang's default reports tempered logprobs, prefill does not."""
    backend = SGLangBackend(config=SGLangConfig(url=processed_server.url))
    base = {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 5}
    tempered = await backend.generate(
        input_ids=PROMPT, sampling_params={**base, "temperature": 0.5}
    )
    untempered = await backend.generate(
        input_ids=PROMPT, sampling_params={**base, "temperature": 1.0}
    )
    bad = await check_generation(backend, PROMPT, tempered)
    good = await check_generation(backend, PROMPT, untempered)
    await backend.aclose()
    assert not bad.ok and bad.max_abs_diff > 1e-2
    assert good.ok, good.describe()  # at temperature 1 and top_p 1 the two modes coincide


def test_compare_logprobs_edge_cases() -> None:
    assert compare_logprobs([], []).ok
    with pytest.raises(ValueError, match="2 sampled logprobs but 1 rescored"):
        compare_logprobs([-1.0, -2.0], [-1.0])
    report = compare_logprobs([-1.0, -math.inf], [-1.0, -5.0])
    assert not report.ok and report.worst_index == 1 and math.isinf(report.max_abs_diff)
    report = compare_logprobs([-1.0, -2.0], [-1.0 + 2e-6, -2.0], tolerance=1e-5)
    assert report.ok and report.mean_abs_diff == pytest.approx(1e-6)
