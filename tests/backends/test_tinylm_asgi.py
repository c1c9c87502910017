"""tinylm's HTTP stack (Starlette on uvicorn, ``tinylm/asgi.py``): what the move onto ASGI must
keep or add, over real sockets. The routes' behaviour is ``test_tinylm_server.py``'s and
``test_sglang_conformance.py``'s."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from tinylm.server import TinyLMServer

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]
LONG = {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 1.0}


def wait_until(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    """Poll ``condition`` (not a timing assertion: the limit only turns a hang into a failure)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


def test_accepted_connections_have_nagle_off(tinylm_server: TinyLMServer) -> None:
    # With Nagle on, a reply split over two writes waits ~40 ms for the client's delayed ACK
    # (the recording proxy had exactly that bug): every accepted socket must set TCP_NODELAY.
    with httpx.Client(base_url=tinylm_server.url) as client:
        assert client.get("/health").status_code == 200
        transports = tinylm_server.connections()
        assert transports
        for transport in transports:
            sock = transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_a_known_route_with_another_method_is_a_json_405(tinylm_server: TinyLMServer) -> None:
    # As SGLang's FastAPI app answers it (405), in tinylm's error shape.
    reply = httpx.get(tinylm_server.url + "/generate")
    assert reply.status_code == 405
    error = reply.json()
    assert error["object"] == "error" and error["code"] == 405
    assert "/generate" in error["message"] and "GET" in error["message"]


def test_a_chunked_request_body_is_read(tinylm_server: TinyLMServer) -> None:
    # uvicorn reads Transfer-Encoding: chunked bodies, as SGLang's server does.
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}).encode()
    reply = httpx.post(
        tinylm_server.url + "/generate",
        content=iter([body[:10], body[10:]]),
        headers={"Content-Type": "application/json"},
    )
    assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 2


def test_a_streamed_chat_whose_client_leaves_is_aborted(tinylm_server: TinyLMServer) -> None:
    body = {
        "messages": [{"role": "user", "content": "count"}],
        "stream": True,
        "max_tokens": 100_000,
        "ignore_eos": True,
        "rid": "leaving-stream",
    }
    with httpx.Client(base_url=tinylm_server.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            lines = reply.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            wait_until(
                lambda: "leaving-stream" in tinylm_server.scheduler.running_rids(),
                "the stream to generate",
            )
    # The connection is closed mid-stream: the server must stop generating for nobody.
    wait_until(lambda: "leaving-stream" not in tinylm_server.scheduler.running_rids(), "the abort")


def test_requests_waiting_out_a_pause_leave_the_server_responsive(
    tinylm_server: TinyLMServer,
) -> None:
    # A /generate arriving while generation is paused waits (SGLang's is_pause_cond); it must
    # wait off the event loop, or /continue_generation could never be served. More waiters than
    # a default thread pool holds (40), so a pool limit would deadlock here.
    url = tinylm_server.url
    assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    try:
        with ThreadPoolExecutor(48) as pool:
            futures = [
                pool.submit(httpx.post, url + "/generate", json=body, timeout=120)
                for _ in range(48)
            ]
            wait_until(lambda: tinylm_server.weights.waiting() >= 48, "the requests to wait")
            assert not any(f.done() for f in futures)
            # The loop still answers. A paused SGLang is not ready (http_server.py, ready):
            # its health check would wait for generation to resume (health.py).
            assert httpx.get(url + "/ready").status_code == 503
            assert httpx.get(url + "/get_model_info").status_code == 200
            assert httpx.post(url + "/continue_generation", json={}).status_code == 200
            assert [f.result().status_code for f in futures] == [200] * 48
    finally:
        httpx.post(url + "/continue_generation", json={})
