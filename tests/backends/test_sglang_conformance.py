"""What a real SGLang server sends, reproduced by tinylm and read by ``SGLangBackend``.

Every shape here is read from SGLang 0.5.23's source (``pip download sglang==0.5.23``), paths
under ``python/sglang/srt/``:

- ``managers/tokenizer_manager.py``, ``TokenizerManager._handle_abort_req``: a request aborted
  while in the scheduler's waiting queue is answered with ``meta_info = {"id", "finish_reason":
  {"type": "abort", "message": "Abort in waiting queue"}, "weight_version", "e2e_latency",
  "completion_tokens"}``: no ``prompt_tokens``.
- ``managers/scheduler.py``, ``Scheduler.abort_request``: a request is aborted when
  ``req.rid.startswith(recv_req.rid)``, so aborting ``x_1`` also aborts ``x_10``.
- ``managers/io_struct.py``, ``GenerateReqInput._normalize_rid``: a batch given one string rid
  names its items ``f"{rid}_{i}"``; ``_handle_parallel_sampling``: ``sampling_params.n > 1``
  turns a single prompt into a batch, answered as a list (``TokenizerManager.
  _handle_batch_request``: the ``n`` samples of each prompt one after the other).
- ``managers/scheduler_components/logprob_result_processor.py``,
  ``_process_input_token_logprobs``: ``input_token_logprobs_val = [None] +
  input_token_logprobs[:-1]``: the entry at ``logprob_start_len`` has no logprob, whatever the
  start; ``_process_input_top_logprobs`` starts ``input_top_logprobs`` with ``None`` likewise.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends import SGLangBackend, SGLangConfig
from engine.backends.sglang_protocol import parse_generate_reply
from engine.errors import BackendProtocolError
from tests.backends.test_tinylm_server import PROMPT, generate, wait_until
from tinylm.server import TinyLMServer, start_server

# TokenizerManager._handle_abort_req's reply for a request that never left the waiting queue
# (return_logprob set: add_logprob_to_meta_info adds the empty lists).
QUEUED_ABORT: dict[str, Any] = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": "9f2c",
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default",
        "e2e_latency": 0.01,
        "input_token_logprobs": [],
        "output_token_logprobs": [],
        "completion_tokens": 0,
    },
}


def test_a_queued_abort_without_prompt_tokens_parses_as_an_abort() -> None:
    reply = parse_generate_reply(QUEUED_ABORT, url="http://sglang", logprobs=True)
    assert reply.finish_type == "abort" and reply.prompt_tokens is None
    assert reply.output_ids == () and reply.completion_tokens == 0
    no_logprobs = {"text": "", "meta_info": dict(QUEUED_ABORT["meta_info"])}
    for key in ("input_token_logprobs", "output_token_logprobs"):
        del no_logprobs["meta_info"][key]
    bare = parse_generate_reply(no_logprobs, url="http://sglang", logprobs=True)
    assert bare.finish_type == "abort" and bare.prompt_tokens is None
    assert bare.output_logprobs is None
    # Any other reply still has to say how long its prompt was.
    finished = {"text": "", "meta_info": {"finish_reason": {"type": "length", "length": 0}}}
    with pytest.raises(BackendProtocolError, match="meta_info.prompt_tokens"):
        parse_generate_reply(finished, url="http://sglang", logprobs=False)


class Gate:
    """Holds the scheduler inside its next forward until ``open()``: what is queued stays
    queued, deterministically."""

    def __init__(self, server: TinyLMServer) -> None:
        self.runtime = server.scheduler._runtime
        self.forward = self.runtime.forward
        self.entered = threading.Event()
        self.released = threading.Event()

    def __enter__(self) -> Gate:
        def held(chunks: Any) -> Any:
            self.entered.set()
            self.released.wait(60)
            return self.forward(chunks)

        self.runtime.forward = held  # type: ignore[method-assign]
        return self

    def open(self) -> None:
        self.released.set()

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.runtime.forward = self.forward  # type: ignore[method-assign]


@pytest.fixture
def one_slot_server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tinylm_dir, max_running_requests=1) as server:
        yield server


LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 1.0}


async def test_an_abort_in_the_waiting_queue_comes_back_as_sglang_sends_it(
    one_slot_server: TinyLMServer,
) -> None:
    server = one_slot_server
    backend = SGLangBackend(config=SGLangConfig(url=server.url))
    with Gate(server) as gate, ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="run", sampling_params=LONG)
        assert gate.entered.wait(60)  # "run" holds the only slot, inside a forward
        queued = pool.submit(
            generate, server, input_ids=PROMPT, rid="wait", return_logprob=True,
            sampling_params=LONG,
        )  # fmt: skip
        wait_until(lambda: "wait" in server.scheduler.running_rids(), "the request to queue")
        httpx.post(server.url + "/abort_request", json={"rid": "wait"}).raise_for_status()
        httpx.post(server.url + "/abort_request", json={"rid": "run"}).raise_for_status()
        gate.open()
        reply, first = queued.result(60), running.result(60)
    meta = reply["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert "prompt_tokens" not in meta and meta["completion_tokens"] == 0
    assert reply["output_ids"] == [] and meta["output_token_logprobs"] == []
    # The running one was aborted mid-decode: SGLang's full meta_info, prompt_tokens included.
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    assert first["meta_info"]["prompt_tokens"] == len(PROMPT)
    # And the client reads the queued abort as an abort, counting the prompt it sent.
    parsed = parse_generate_reply(reply, url=server.url, logprobs=True)
    result = backend._result(parsed, len(PROMPT))
    await backend.aclose()
    assert result.aborted and result.usage is not None
    assert result.usage.prompt_tokens == len(PROMPT)


def test_abort_request_matches_rids_by_prefix(tinylm_server: TinyLMServer) -> None:
    server = tinylm_server
    prompts = [PROMPT] * 11
    with Gate(server) as gate, ThreadPoolExecutor(1) as pool:
        batch = pool.submit(
            generate, server, input_ids=prompts, rid="x",
            sampling_params={"max_new_tokens": 3, "temperature": 0},
        )  # fmt: skip
        names = {f"x_{i}" for i in range(11)}
        wait_until(lambda: names <= set(server.scheduler.running_rids()), "the batch to queue")
        httpx.post(server.url + "/abort_request", json={"rid": "x_1"}).raise_for_status()
        gate.open()
        replies = batch.result(60)
    aborted = {
        r["meta_info"]["id"] for r in replies if r["meta_info"]["finish_reason"]["type"] == "abort"
    }
    assert [r["meta_info"]["id"] for r in replies] == [f"x_{i}" for i in range(11)]
    assert aborted == {"x_1", "x_10"}


def test_the_first_input_logprob_is_null_at_logprob_start_len(
    tinylm_server: TinyLMServer,
) -> None:
    for start in (0, 4, len(PROMPT) - 1):
        reply = generate(
            tinylm_server,
            input_ids=PROMPT,
            return_logprob=True,
            logprob_start_len=start,
            top_logprobs_num=2,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
        )
        meta = reply["meta_info"]
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == PROMPT[start:]
        assert entries[0][0] is None and all(e[0] is not None for e in entries[1:])
        assert meta["input_top_logprobs"][0] is None
        assert all(top is not None for top in meta["input_top_logprobs"][1:])
        assert meta["prompt_tokens"] == start + len(entries)


async def test_a_force_decode_score_reads_past_the_null_entry(tinylm_server: TinyLMServer) -> None:
    backend = SGLangBackend(config=SGLangConfig(url=tinylm_server.url))
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    sampled = await backend.generate(input_ids=PROMPT, sampling_params=greedy)
    assert sampled.token_ids is not None and sampled.logprobs is not None
    score = await backend.score(PROMPT, list(sampled.token_ids))
    await backend.aclose()
    assert score.token_ids == sampled.token_ids
    assert score.logprobs == pytest.approx(sampled.logprobs, abs=1e-4)


async def test_n_samples_come_back_as_a_list_and_the_client_reads_them(
    tinylm_server: TinyLMServer,
) -> None:
    replies = generate(
        tinylm_server, input_ids=PROMPT, rid="par", sampling_params={"n": 3, "max_new_tokens": 4}
    )
    assert isinstance(replies, list) and len(replies) == 3
    assert [r["meta_info"]["id"] for r in replies] == ["par_0", "par_1", "par_2"]
    two_prompts = generate(
        tinylm_server,
        input_ids=[PROMPT, PROMPT[:4]],
        sampling_params={"n": 2, "max_new_tokens": 2},
    )
    assert [r["meta_info"]["prompt_tokens"] for r in two_prompts] == [11, 11, 4, 4]
    backend = SGLangBackend(config=SGLangConfig(url=tinylm_server.url))
    results = await backend.generate_samples(
        input_ids=PROMPT, sampling_params={"n": 3, "max_new_tokens": 4, "temperature": 1.0}
    )
    assert len(results) == 3 and all(len(r.token_ids or ()) == 4 for r in results)
    with pytest.raises(ValueError, match="generate_samples"):
        await backend.generate(input_ids=PROMPT, sampling_params={"n": 2})
    await backend.aclose()


def test_ids_the_tokenizer_cannot_decode_are_never_sampled(
    tinylm_server: TinyLMServer, tinylm_dir: Path
) -> None:
    from transformers import AutoTokenizer

    decodable = len(AutoTokenizer.from_pretrained(tinylm_dir, local_files_only=True))
    vocab = tinylm_server.scheduler._runtime.shape.vocab_size
    assert decodable < vocab  # the model's rows are padded past the tokenizer (960 vs 919)
    assert tinylm_server.scheduler.decodable == decodable
    reply = generate(
        tinylm_server,
        input_ids=PROMPT,
        return_logprob=True,
        top_logprobs_num=vocab,
        sampling_params={"max_new_tokens": 2, "temperature": 1.0, "sampling_seed": 1},
    )
    # The whole distribution a token is drawn from: decodable ids only, and it sums to one.
    for top in reply["meta_info"]["output_top_logprobs"]:
        ids = [tid for _, tid in (e[:2] for e in top)]
        assert len(ids) == decodable and max(ids) == decodable - 1
    # Even when the padding rows would win every draw.
    runtime = tinylm_server.scheduler._runtime
    head = runtime._head
    saved = head[decodable:].clone()
    try:
        head[decodable:] = head[:decodable].abs().max() * 50
        out = generate(
            tinylm_server, input_ids=PROMPT, sampling_params={"max_new_tokens": 16, "top_k": 5}
        )
    finally:
        head[decodable:] = saved
    assert all(t < decodable for t in out["output_ids"])
