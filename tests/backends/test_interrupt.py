"""A turn interrupted by a weight sync, on a real tinylm server: what SGLang answers an aborted
request, and how the worker's pool continues the turn on the new weights.

Shapes read from SGLang 0.5.23's source (paths under ``python/sglang/srt/``):

- ``managers/scheduler.py``, ``Scheduler.abort_request``: a *running* request whose rid
  matches is not dropped but finished with ``req.to_finish = FINISH_ABORT()`` (abort method
  3 of ``managers/tokenizer_manager.py``'s table at its end: "http, running, type 3, del in
  _handle_batch_output"), so its reply goes out through ``_handle_batch_output`` as any
  finished request's: ``text``, ``output_ids`` and, with ``return_logprob``,
  ``output_token_logprobs`` of the tokens sampled before the abort, ``completion_tokens``
  counting them, ``weight_version`` of the weights that sampled them.
- ``managers/schedule_batch.py``, ``FINISH_ABORT.to_json()``: ``{"type": "abort", "message":
  "Aborted", "status_code": None, "err_type": None}``; with no ``status_code``,
  ``TokenizerManager._handle_abort_finish_reason`` returns None: the reply is the normal
  200 reply, not an HTTP error.
- ``managers/tokenizer_manager.py``, ``pause_generation``: mode ``abort`` sends
  ``abort_request(abort_all=True)`` until no request holds ``model_update_lock``: every
  running request answers as above.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends import SGLangBackend, SGLangConfig
from engine.backends.base import FinishReason, GenerationResult
from engine.backends.pool import BackendPool
from engine.backends.sglang import load_tokenizer
from engine.backends.sglang_protocol import parse_generate_reply
from engine.backends.weight_admin import ServerAdmin
from engine.events.catalog import RolloutRequested
from tests.backends.test_tinylm_server import PROMPT, generate, wait_until
from tests.backends.test_tinylm_weights import perturbed_copy
from tinylm.server import TinyLMServer, start_server

LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 1.0}
TURN = 300  # tokens of the interrupted turn
GREEDY = {"max_new_tokens": TURN, "ignore_eos": True, "temperature": 0.0}


def steps_later(server: TinyLMServer, steps: int) -> None:
    """Wait until the scheduler ran ``steps`` more forwards: a running request then has at
    least ``steps - 1`` output tokens (the first forward is its prefill)."""
    start = server.scheduler.steps
    wait_until(lambda: server.scheduler.steps >= start + steps, f"{steps} forwards")


def running(server: TinyLMServer, rid: str) -> Callable[[], bool]:
    return lambda: rid in server.scheduler.running_rids()


def test_a_running_request_aborted_answers_its_partial_output(
    tinylm_server: TinyLMServer, tinylm_dir: Path
) -> None:
    server = tinylm_server
    tokenizer = load_tokenizer(tinylm_dir)
    for how in ("abort_request", "pause_generation"):
        rid = f"cut-{how}"
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(
                generate, server, input_ids=PROMPT, rid=rid, return_logprob=True,
                sampling_params=LONG,
            )  # fmt: skip
            wait_until(running(server, rid), "the request to run")
            steps_later(server, 6)
            if how == "abort_request":
                httpx.post(server.url + "/abort_request", json={"rid": rid})
            else:
                httpx.post(server.url + "/pause_generation", json={"mode": "abort"}, timeout=60)
            reply = future.result(timeout=60)
        if how == "pause_generation":
            httpx.post(server.url + "/continue_generation", json={}, timeout=60)
        meta = reply["meta_info"]
        assert meta["finish_reason"] == {
            "type": "abort", "message": "Aborted", "status_code": None, "err_type": None,
        }  # fmt: skip
        ids = reply["output_ids"]
        assert len(ids) >= 5 and meta["completion_tokens"] == len(ids)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
        assert reply["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        assert meta["prompt_tokens"] == len(PROMPT) and meta["weight_version"] == "default"
        # The client keeps the partial output, logprobs as sampled.
        parsed = parse_generate_reply(reply, url=server.url, logprobs=True)
        result = SGLangBackend._result(parsed, len(PROMPT))
        assert result.aborted and list(result.token_ids or ()) == ids
        assert list(result.logprobs or ()) == [lp for lp, _, _ in meta["output_token_logprobs"]]


@pytest.fixture(scope="module")
def v1_dir(tinylm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tinylm_dir, tmp_path_factory.mktemp("v1") / "model", seed=11)


@pytest.fixture
def server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tinylm_dir, max_running_requests=2, weight_version="0") as srv:
        yield srv


class Seen:
    """A pool hook: every generate result, in order (the parts of a continued turn)."""

    def __init__(self) -> None:
        self.results: list[GenerationResult] = []

    async def before(self, call: Any) -> None:
        return None

    def after(self, call: Any, result: GenerationResult | None, error: Any) -> None:
        if result is not None:
            self.results.append(result)


async def interrupt_and_swap(
    pool: BackendPool, server: TinyLMServer, weights: Path, active: list[int]
) -> None:
    """What a worker and the syncer do for an interrupting sync: close the gate, abort the
    turns in flight, load the new weights once none is, activate them, open the gate."""
    await asyncio.to_thread(steps_later, server, 20)
    pool.gate.close("sync to version 1")
    pool.gate.interrupt()
    await asyncio.wait_for(pool.gate.drained(), 30)
    admin = ServerAdmin(server.url)
    await admin.load(str(weights), 1)
    await admin.aclose()
    active[0] = 1
    pool.gate.open()


async def test_an_interrupted_turn_continues_on_the_new_weights(
    server: TinyLMServer, v1_dir: Path
) -> None:
    direct = SGLangBackend(config=SGLangConfig(url=server.url))
    before = await direct.generate(input_ids=PROMPT, sampling_params=GREEDY)  # version 0's turn
    seen = Seen()
    pool = BackendPool(server.url, hooks=(seen,))
    active = [0]
    pool.health.expected = lambda: active[0]
    view = pool.bind("s1/a1")
    turn = asyncio.ensure_future(view.get().generate(input_ids=PROMPT, sampling_params=GREEDY))
    await interrupt_and_swap(pool, server, v1_dir, active)
    result = await asyncio.wait_for(turn, 60)

    partial, rest = seen.results
    assert partial.aborted and rest.finish_reason == FinishReason.LENGTH
    n = len(partial.token_ids or ())
    assert 0 < n < TURN and pool.gate.interrupted == 1
    # Nothing repeated, nothing lost: the partial tokens, then the continuation, TURN in all.
    ids = list(result.token_ids or ())
    assert ids == [*(partial.token_ids or ()), *(rest.token_ids or ())] and len(ids) == TURN
    assert result.finish_reason == FinishReason.LENGTH and not result.aborted
    assert result.usage is not None and result.usage.completion_tokens == TURN
    assert result.usage.prompt_tokens == len(PROMPT)
    # Each token carries the version that sampled it: split at the swap.
    assert result.versions() == (0,) * n + (1,) * (TURN - n) and result.weight_version == 1
    # The partial tokens are version 0's greedy tokens, logprobs as sampled ...
    assert ids[:n] == list(before.token_ids or ())[:n]
    assert list(result.logprobs or ())[:n] == list(partial.logprobs or ())
    assert list(result.logprobs or ())[:n] == pytest.approx(list(before.logprobs or ())[:n],
                                                            abs=1e-5)
    # ... and the continuation's logprobs are what the new weights give those tokens.
    scored = await direct.score([*PROMPT, *ids[:n]], ids[n:])
    assert scored.weight_version == 1
    assert list(result.logprobs or ())[n:] == pytest.approx(list(scored.logprobs), abs=1e-4)
    assert list(before.logprobs or ())[n:] != pytest.approx(list(scored.logprobs), abs=1e-3)
    await direct.aclose()
    await pool.aclose()


async def test_the_version_span_cap_ends_a_trajectory_instead_of_continuing_it(
    server: TinyLMServer, v1_dir: Path
) -> None:
    seen = Seen()
    pool = BackendPool(server.url, hooks=(seen,))
    active = [0]
    pool.health.expected = lambda: active[0]
    view = pool.bind("s1/a1", max_version_span=1)
    backend = view.get()
    turn = asyncio.ensure_future(backend.generate(input_ids=PROMPT, sampling_params=GREEDY))
    await interrupt_and_swap(pool, server, v1_dir, active)
    result = await asyncio.wait_for(turn, 60)
    (partial,) = seen.results  # nothing was generated on version 1
    n = len(partial.token_ids or ())
    assert 0 < n < TURN
    assert result.finish_reason == FinishReason.VERSION_SPAN and not result.aborted
    assert result.token_ids == partial.token_ids and result.logprobs == partial.logprobs
    assert result.versions() == (0,) * n
    # The next turn of that trajectory is not generated either; another trajectory's is.
    after = await backend.generate(input_ids=[*PROMPT, *(result.token_ids or ())],
                                   sampling_params={"max_new_tokens": 4})
    assert after.finish_reason == FinishReason.VERSION_SPAN and after.token_ids == ()
    assert len(seen.results) == 1
    fresh = await pool.bind("s2/a1", max_version_span=1).get().generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 4}
    )
    assert fresh.finish_reason == FinishReason.LENGTH and fresh.versions() == (1,) * 4
    await pool.aclose()


def test_a_cap_below_one_is_refused_when_the_rollout_is_requested() -> None:
    with pytest.raises(ValueError, match="max_version_span"):
        RolloutRequested(rollout_id="r", n_prompts=1, max_version_span=0)
    with pytest.raises(ValueError, match="max_version_span"):
        BackendPool("http://127.0.0.1:1").bind("k", max_version_span=0)
    assert RolloutRequested(rollout_id="r", n_prompts=1).max_version_span is None


async def test_a_server_that_refuses_the_abort_has_its_turn_waited_for(
    tinylm_dir: Path,
) -> None:
    # An admin key keeps /abort_request for its holder; workers hold none (docs/security.md).
    with start_server(tinylm_dir, weight_version="0", admin_api_key="admin-key") as keyed:
        seen = Seen()
        pool = BackendPool(keyed.url, hooks=(seen,))
        active = [0]
        pool.health.expected = lambda: active[0]
        view = pool.bind("s1/a1")
        turn = asyncio.ensure_future(view.get().generate(input_ids=PROMPT,
                                                         sampling_params=GREEDY))
        await asyncio.to_thread(steps_later, keyed, 20)
        pool.gate.close("sync to version 1")
        pool.gate.interrupt()
        await asyncio.wait_for(pool.gate.drained(), 60)  # the turn ran to its end
        result = await turn
        assert pool.gate.interrupted == 0 and len(seen.results) == 1
        assert len(result.token_ids or ()) == TURN and result.versions() == (0,) * TURN
        assert result.finish_reason == FinishReason.LENGTH
        pool.gate.open()
        await pool.aclose()
