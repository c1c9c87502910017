"""``POST /generate`` with ``"stream": true``, as SGLang 0.5.23 streams it, from a tinylm process.

Shapes, from SGLang 0.5.23's source (paths under ``python/sglang/srt/``):

- ``entrypoints/http_server.py``, ``serve_generate_request`` / ``stream_results``: a
  ``text/event-stream`` of ``data: <json>`` events, then ``data: [DONE]``; a ``ValueError`` in
  ``generate_request`` is the event ``{"error": {"message", "type": "invalid_request_error",
  "code": 400, "retryable": false}}`` after a 200. A body of the wrong type (FastAPI's request
  model) is a plain 400.
- ``managers/tokenizer_manager.py``, ``_handle_batch_output``: default ``stream_output`` chunks
  hold the output so far, ``finish_reason`` null until the last, which is the finished reply;
  with ``incremental_streaming_output`` they are disjoint (``_slice_streaming_output_meta_info``
  slices the output logprobs; ``output_token_logprobs_length`` and ``input_token_logprobs``
  stay whole). ``add_logprob_to_meta_info``: ``output_token_logprobs_length``.
  ``_stream_one_response``: ``response_sent_to_client_ts`` in the first chunk only.
  ``_stream_batch_responses``: a batch's chunks carry ``index``.
- ``managers/scheduler_components/output_streamer.py``, ``accept``: the first token at once,
  then a chunk once ``stream_interval`` tokens are unsent.
- ``managers/schedule_batch.py``, ``FINISH_ABORT.to_json``: a running request that an
  ``/abort_request`` ends finishes with ``{"type": "abort", "message": "Aborted",
  "status_code": null, "err_type": null}``.
- ``utils/weight_versions.py``: a finished reply's ``weight_versions`` spans.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.backends.test_tinylm_server import LONG, PROMPT, wait_until
from tinylm.process import ServerProcess, spawn_server

DONE = "[DONE]"
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
RUNNING_ONLY = {"e2e_latency", "response_sent_to_client_ts"}  # differ between two runs


@pytest.fixture(scope="module")
def server(tinylm_dir: Path) -> Iterator[ServerProcess]:
    with spawn_server(tinylm_dir) as proc:
        yield proc


@pytest.fixture(scope="module")
def incremental(tinylm_dir: Path) -> Iterator[ServerProcess]:
    with spawn_server(tinylm_dir, extra_args=["--incremental-streaming-output"]) as proc:
        yield proc


def events(url: str, body: dict[str, Any], *, stop_after: int | None = None) -> list[Any]:
    """The decoded ``data:`` events of a streamed ``/generate`` (``[DONE]`` as the string)."""
    out: list[Any] = []
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            out.append(data if data == DONE else json.loads(data))
            if stop_after is not None and len(out) >= stop_after:
                break
    return out


def reply(url: str, body: dict[str, Any]) -> Any:
    response = httpx.post(url + "/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def steady(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in RUNNING_ONLY}


def test_chunks_hold_the_output_so_far_and_the_last_is_the_finished_reply(
    server: ServerProcess,
) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2}
    whole = reply(server.url, {**body, "sampling_params": GREEDY})
    got = events(server.url, {**body, "sampling_params": GREEDY})
    assert got[-1] == DONE and DONE not in got[:-1]
    chunks, last = got[:-2], got[-2]
    ids, meta = whole["output_ids"], whole["meta_info"]
    assert len(ids) == 6 and chunks
    for chunk in chunks:
        k = len(chunk["output_ids"])
        m = chunk["meta_info"]
        assert chunk["output_ids"] == ids[:k] and whole["text"].startswith(chunk["text"])
        assert m["finish_reason"] is None and m["completion_tokens"] == k
        assert m["output_token_logprobs"] == meta["output_token_logprobs"][:k]
        assert m["output_token_logprobs_length"] == k
        assert m["input_token_logprobs"] == meta["input_token_logprobs"]
        assert m["output_top_logprobs"] == meta["output_top_logprobs"][:k]
        assert (m["id"], m["prompt_tokens"], m["weight_version"]) == (
            last["meta_info"]["id"],
            len(PROMPT),
            "default",
        )
        assert "weight_versions" not in m and "e2e_latency" not in m
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(set(lengths))  # stream_interval 1: every chunk adds tokens
    # The finished reply, as a non-streamed request gets it (same greedy tokens).
    assert (last["text"], last["output_ids"]) == (whole["text"], ids)
    final = {k: v for k, v in steady(last["meta_info"]).items() if k != "id"}
    assert final == {k: v for k, v in steady(meta).items() if k != "id"}
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert last["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
    # response_sent_to_client_ts: in the first chunk only
    assert "response_sent_to_client_ts" in chunks[0]["meta_info"]
    assert all("response_sent_to_client_ts" not in c["meta_info"] for c in got[1:-1])


def test_incremental_streaming_output_sends_disjoint_segments(incremental: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": GREEDY}
    whole = reply(incremental.url, body)
    got = events(incremental.url, body)
    assert got[-1] == DONE
    chunks = got[:-1]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    pieces = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert pieces == whole["meta_info"]["output_token_logprobs"]
    sent = 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        sent += len(chunk["output_ids"])
        assert len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"] == sent
        assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_stream_interval_sends_the_first_token_then_every_n(server: ServerProcess) -> None:
    params = {**GREEDY, "max_new_tokens": 10, "stream_interval": 3}
    got = events(server.url, {"input_ids": PROMPT, "sampling_params": params})
    lengths = [len(c["output_ids"]) for c in got[:-2]]
    assert lengths and lengths[0] >= 1
    # Coalescing can only merge chunks: never one that adds fewer than 3 tokens.
    assert all(b - a >= 3 for a, b in zip(lengths, lengths[1:], strict=False))
    assert len(got[-2]["output_ids"]) == 10 and got[-1] == DONE


def test_a_batch_streams_its_requests_interleaved_each_with_its_index(
    server: ServerProcess,
) -> None:
    got = events(
        server.url,
        {"input_ids": [PROMPT, PROMPT[:4]], "rid": "sb", "sampling_params": GREEDY},
    )
    assert got[-1] == DONE
    by_index: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in got[:-1]:
        by_index[chunk["index"]].append(chunk)
    for i, prompt in enumerate((PROMPT, PROMPT[:4])):
        chunks = by_index[i]
        assert {c["meta_info"]["id"] for c in chunks} == {f"sb_{i}"}
        assert all(c["meta_info"]["prompt_tokens"] == len(prompt) for c in chunks)
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    # sampling_params.n > 1 makes a single prompt a batch too (io_struct.py).
    samples = events(
        server.url, {"input_ids": PROMPT, "rid": "sn", "sampling_params": {**GREEDY, "n": 2}}
    )
    finals = [c for c in samples[:-1] if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1]


def test_a_refused_stream_is_an_error_event_after_a_200(server: ServerProcess) -> None:
    too_long = events(server.url, {"input_ids": [1] * 5000})
    assert too_long[-1] == DONE and len(too_long) == 2
    error = too_long[0]["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["retryable"] is False and "context length" in error["message"]
    bad_value = events(server.url, {"input_ids": PROMPT, "sampling_params": {"temperature": -1}})
    assert "temperature" in bad_value[0]["error"]["message"] and bad_value[1] == DONE
    # A field of the wrong type is refused before any event, as FastAPI refuses it.
    typed = httpx.post(
        server.url + "/generate", json={"input_ids": "nope", "stream": True}, timeout=30
    )
    assert typed.status_code == 400 and "input_ids" in typed.json()["message"]


def test_an_abort_ends_a_stream_with_its_partial_output(server: ServerProcess) -> None:
    body = {"input_ids": PROMPT, "rid": "abort-stream", "return_logprob": True}
    with httpx.stream(
        "POST",
        server.url + "/generate",
        json={**body, "stream": True, "sampling_params": LONG},
        timeout=60,
    ) as r:
        lines = (line[6:] for line in r.iter_lines() if line)
        first = json.loads(next(lines))
        assert first["meta_info"]["finish_reason"] is None
        abort = httpx.post(server.url + "/abort_request", json={"rid": "abort-stream"})
        assert (abort.status_code, abort.content) == (200, b"")
        rest = [d if d == DONE else json.loads(d) for d in lines]
    assert rest[-1] == DONE
    last = rest[-2]
    meta = last["meta_info"]
    assert meta["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert len(last["output_ids"]) == meta["completion_tokens"] >= 1
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(c["meta_info"]["finish_reason"] is None for c in rest[:-2])


def test_a_client_that_leaves_a_stream_aborts_its_request(server: ServerProcess) -> None:
    def running() -> list[str]:
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        return list(info["running_rids"])

    got = events(
        server.url,
        {"input_ids": PROMPT, "rid": "leaving", "sampling_params": LONG},
        stop_after=1,
    )
    assert got[0]["meta_info"]["id"] == "leaving"
    wait_until(lambda: "leaving" not in running(), "the abort of the stream whose client left")
