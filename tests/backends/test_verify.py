"""The verification boundary (``engine.actors.verify``) against real tinylm servers: which
samples are picked, a multi-turn sample re-scored at its weight version, weights that changed
under the same version, a version change that must skip, and the worker's start check that
refuses a server returning temperature-scaled logprobs (SGLang's default)."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import httpx
import numpy as np
import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.verify import VerifyPolicy, check_servers, selected, verify_result
from engine.agents.result import UNKNOWN_VERSION, AgentResult
from engine.backends.fidelity import TemperatureScaledLogprobs
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.config.evaluators import load_evaluators
from engine.errors import ConfigError
from engine.events.redis_log import RedisEventLog
from engine.ops.processes import Processes
from engine.outcomes import TerminationReason
from tests.backends.test_tinylm_weights import perturbed_copy
from tinylm.process import spawn_server
from tinylm.sampling import LogprobMode, logprob_mode_from_env
from tinylm.server import TinyLMServer, start_server
from workers.cli import ROLLOUT

ADMIN = "verify-admin"
FLAG = "SGLANG_RETURN_ORIGINAL_LOGPROB=1"


# -- which samples ---------------------------------------------------------------------------


def test_selection_is_a_deterministic_share_of_sample_ids() -> None:
    ids = [f"r7:s{i}" for i in range(4000)]
    picked = [s for s in ids if selected(s, 0.25)]
    assert picked == [s for s in ids if selected(s, 0.25)]  # the same on every call (replay)
    assert 0.22 * len(ids) < len(picked) < 0.28 * len(ids)
    # A larger fraction keeps every sample a smaller one picked; 0 and 1 are none and all.
    assert set(picked) <= {s for s in ids if selected(s, 0.5)}
    assert not any(selected(s, 0.0) for s in ids) and all(selected(s, 1.0) for s in ids)


def test_request_knobs_override_the_worker_policy_and_bad_ones_are_refused() -> None:
    policy = VerifyPolicy(fraction=0.1, threshold=1e-3)
    assert policy.for_request({}) == policy
    assert policy.for_request({"verify_fraction": 1, "verify_threshold": 0.5}) == VerifyPolicy(
        fraction=1.0, threshold=0.5
    )
    with pytest.raises(ConfigError, match="knob verify_fraction must be in"):
        policy.for_request({"verify_fraction": 1.5})
    with pytest.raises(ConfigError, match="knob verify_threshold must be a number"):
        policy.for_request({"verify_threshold": "small"})
    with pytest.raises(ConfigError, match="verify threshold must be >= 0"):
        VerifyPolicy(threshold=-1.0)


# -- SGLANG_RETURN_ORIGINAL_LOGPROB in tinylm ------------------------------------------------


def test_tinylm_reads_sglangs_variable_with_sglangs_default() -> None:
    # SGLang 0.5.23 srt/utils/common.py get_bool_env_var: default "false"; "1"/"true" (any
    # case) are true, anything else false.
    assert logprob_mode_from_env({}) is LogprobMode.PROCESSED
    for value in ("1", "true", "TRUE"):
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": value}
        assert logprob_mode_from_env(env) is LogprobMode.ORIGINAL
    for value in ("0", "false", "yes"):
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": value}
        assert logprob_mode_from_env(env) is LogprobMode.PROCESSED


def test_a_server_launched_without_the_variable_returns_scaled_logprobs(
    tinylm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB")
    with start_server(tinylm_dir, max_running_requests=1) as server:
        info = httpx.get(server.url + "/get_model_info").json()
        assert info["logprob_mode"] == "processed"
        body = {
            "input_ids": [5, 6, 7, 8],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "sampling_seed": 1},
        }
        reply = httpx.post(server.url + "/generate", json=body, timeout=60).json()
        ids = reply["output_ids"]
        sampled = [e[0] for e in reply["meta_info"]["output_token_logprobs"]]
        rescore = httpx.post(
            server.url + "/generate",
            json={
                "input_ids": [5, 6, 7, 8, *ids],
                "return_logprob": True,
                "logprob_start_len": 3,
                "sampling_params": {"max_new_tokens": 0},
            },
            timeout=60,
        ).json()
        scored = [e[0] for e in rescore["meta_info"]["input_token_logprobs"][1:]]
        # The prefill scores raw logprobs (as SGLang's does): they differ from the sampled.
        assert max(abs(a - b) for a, b in zip(sampled, scored, strict=True)) > 1e-2


# -- a multi-turn sample, re-scored -----------------------------------------------------------


@pytest.fixture(scope="module")
def stepped_dir(tinylm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tinylm_dir, tmp_path_factory.mktemp("verify-step") / "model", seed=3)


@pytest.fixture
def versioned(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(
        tinylm_dir, max_running_requests=2, weight_version="3", admin_api_key=ADMIN
    ) as server:
        yield server


def update(server: TinyLMServer, model: Path, version: str) -> None:
    reply = httpx.post(
        server.url + "/update_weights_from_disk",
        json={"model_path": str(model), "weight_version": version},
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=120,
    )
    assert reply.status_code == 200 and reply.json()["success"], reply.text


PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]
OBSERVATION = [2, 201, 55, 56, 57, 2, 201]


async def two_turns(url: str, *, between: Any = None, temperature: float = 0.8) -> AgentResult:
    """A two-turn trajectory as an agent records it: turn 1, an observation (mask 0), turn 2
    generated on the whole series; ``between`` runs after turn 1 (e.g. a weight update)."""
    backend = SGLangBackend(config=SGLangConfig(url=url))
    try:
        params = {"max_new_tokens": 12, "temperature": temperature, "ignore_eos": True}
        first = await backend.generate(
            input_ids=PROMPT, sampling_params={**params, "sampling_seed": 1}
        )
        if between is not None:
            await asyncio.to_thread(between)
        series = [*PROMPT, *first.token_ids, *OBSERVATION]  # type: ignore[misc]
        second = await backend.generate(
            input_ids=series, sampling_params={**params, "sampling_seed": 2}
        )
    finally:
        await backend.aclose()
    assert first.token_ids and second.token_ids and first.logprobs and second.logprobs
    unknown = UNKNOWN_VERSION
    v1 = first.weight_version if first.weight_version is not None else unknown
    v2 = second.weight_version if second.weight_version is not None else unknown
    n1, n2, no = len(first.token_ids), len(second.token_ids), len(OBSERVATION)
    return AgentResult(
        prompt_token_ids=PROMPT,
        response_token_ids=[*first.token_ids, *OBSERVATION, *second.token_ids],
        response_logprobs=[*first.logprobs, *[0.0] * no, *second.logprobs],
        loss_mask=[1] * n1 + [0] * no + [1] * n2,
        response_versions=[v1] * n1 + [unknown] * no + [v2] * n2,
        termination_reason=TerminationReason.FINISH,
    )


async def verify(server: TinyLMServer, result: AgentResult, threshold: float = 1e-3) -> Any:
    pool = BackendPool(server.url)
    try:
        return await verify_result(
            pool.bind("r:s0/1"), rollout_id="r", sample_id="r:s0", attempt=1,
            result=result, threshold=threshold,
        )  # fmt: skip
    finally:
        await pool.aclose()


async def test_a_multi_turn_sample_at_its_version_passes_under_the_threshold(
    versioned: TinyLMServer,
) -> None:
    result = await two_turns(versioned.url)
    check = await verify(versioned, result)
    sampled = int(np.asarray(result.loss_mask.tolist()).sum())
    assert check.skipped == "" and check.exceeded is False
    assert check.n_tokens == sampled and check.n_other_version == 0
    assert check.weight_version == 3 and check.threshold == 1e-3
    assert 0.0 <= check.max_abs_delta <= 1e-3
    assert result.loss_mask.tolist()[check.position] == 1


async def test_weights_changed_under_the_same_version_exceed_the_threshold(
    versioned: TinyLMServer, stepped_dir: Path
) -> None:
    result = await two_turns(versioned.url)
    update(versioned, stepped_dir, "3")  # new weights, the same declared version
    check = await verify(versioned, result)
    assert check.skipped == "" and check.exceeded is True
    assert check.max_abs_delta > 1e-3 and check.weight_version == 3
    mask = result.loss_mask.tolist()
    assert mask[check.position] == 1 and check.n_tokens == sum(mask)


async def test_a_version_change_skips_what_it_cannot_compare_and_never_fails(
    versioned: TinyLMServer, stepped_dir: Path
) -> None:
    # Turn 1 at version 3, an update to 4, turn 2 at 4: only turn 2's tokens are compared.
    result = await two_turns(versioned.url, between=lambda: update(versioned, stepped_dir, "4"))
    mask = result.loss_mask.tolist()
    n1 = mask.index(0)
    check = await verify(versioned, result)
    assert check.exceeded is False and check.skipped == ""
    assert (check.n_tokens, check.n_other_version) == (sum(mask) - n1, n1)
    assert check.position is not None and check.position >= n1 + len(OBSERVATION)
    # Another update: no token of the sample is at the server's version any more.
    update(versioned, stepped_dir, "5")
    later = await verify(versioned, result)
    assert later.exceeded is False and later.n_tokens == 0
    assert later.skipped == "weight version changed since sampling"
    assert later.n_other_version == sum(mask) and later.weight_version == 5


async def test_a_sample_without_a_token_backend_is_skipped_not_failed(tinylm_dir: Path) -> None:
    result = AgentResult(
        prompt_token_ids=[1, 2],
        response_token_ids=[3],
        response_logprobs=[-1.0],
        loss_mask=[1],
        termination_reason=TerminationReason.FINISH,
    )
    check = await verify_result(
        None, rollout_id="r", sample_id="r:s1", attempt=1, result=result, threshold=1e-3
    )
    assert check.skipped.startswith("no token-level backend") and not check.exceeded
    assert math.isclose(check.max_abs_delta, 0.0)


# -- the worker's start check ------------------------------------------------------------------


@pytest.fixture(scope="module")
def specs_scripted() -> Any:
    from tests.rig import EVALUATOR_CONFIG

    return load_evaluators(EVALUATOR_CONFIG, None)


async def test_a_worker_refuses_a_server_with_temperature_scaled_logprobs(
    tinylm_dir: Path, specs_scripted: Any
) -> None:
    # SGLang's default (the variable unset): the server reports temperature-scaled logprobs.
    with spawn_server(tinylm_dir, env={"SGLANG_RETURN_ORIGINAL_LOGPROB": None}) as proc:
        pool = BackendPool(proc.url)
        log = RedisEventLog(fakeredis.FakeAsyncRedis(), producer="test", block_ms=100)
        worker = EvaluatorWorker(
            log, specs_scripted, WorkerConfig(worker_id="w", evaluator_ids=("scripted",)),
            backends=pool,
        )  # fmt: skip
        try:
            with pytest.raises(TemperatureScaledLogprobs) as refused:
                await asyncio.wait_for(worker.run(asyncio.Event()), 120)
        finally:
            await pool.aclose()
    message = str(refused.value)
    assert FLAG in message and proc.url in message and "temperature" in message


async def test_a_server_launched_as_rl_needs_passes_the_start_check(
    tinylm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's launcher serves tinylm with raw logprobs (engine.ops.tinylm.RL_SERVER_ENV)
    # where nothing in its environment says so.
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    with Processes(tmp_path, rollout=ROLLOUT) as procs:
        bare = procs.serve_tinylm("bare", tinylm_dir,
                                  env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"})
        with pytest.raises(TemperatureScaledLogprobs, match=re.escape(FLAG)):
            pool = BackendPool(bare.url)
            try:
                await check_servers(pool, threshold=1e-3)
            finally:
                await pool.aclose()
        pool = BackendPool(procs.serve_tinylm("rl", tinylm_dir).url)
        try:
            await check_servers(pool, threshold=1e-3)  # no error: raw logprobs
        finally:
            await pool.aclose()


async def test_new_weights_loaded_during_the_start_check_do_not_refuse_the_server(
    tinylm_dir: Path, tmp_path: Path
) -> None:
    # A sync may load new weights between the check's generation and its re-score: the
    # re-score then disagrees, but the server's logprobs are raw. Its version changed across
    # the check, so the check runs again instead of refusing the server.
    v1 = perturbed_copy(tinylm_dir, tmp_path / "v1" / "model", seed=11)
    with Processes(tmp_path, rollout=ROLLOUT) as procs:
        server = procs.serve_tinylm("rl", tinylm_dir, "--weight-version", "0")
        pool = BackendPool(server.url)
        backend = pool.get(server.url)
        rescore = backend.score
        loads = 0

        async def load_then_rescore(*args: Any, **kwargs: Any) -> Any:
            nonlocal loads
            if loads == 0:
                loads += 1
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                    loaded = await http.post("/update_weights_from_disk", json={
                        "model_path": str(v1), "weight_version": "1"})
                    assert loaded.json()["success"] is True
            return await rescore(*args, **kwargs)

        backend.score = load_then_rescore  # type: ignore[method-assign]
        try:
            await check_servers(pool, threshold=1e-3)  # no error: checked again at v1
        finally:
            await pool.aclose()
    assert loads == 1
