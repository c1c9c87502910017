"""SGLang ``/generate`` replies as SGLang writes them, and every way a reply can go wrong.

Where the shapes come from (sgl-project/sglang):

- ``python/sglang/srt/managers/tokenizer_manager.py``: ``convert_logprob_style`` builds
  ``meta_info["input_token_logprobs"/"output_token_logprobs"]`` with
  ``detokenize_logprob_tokens``, which returns ``(logprob, token_id, None)`` triples, or
  ``(logprob, token_id, text)`` with ``return_text_in_logprobs``; ``detokenize_top_logprobs_tokens``
  gives one list of triples per position, ``None`` where nothing was computed. An abort reply
  that carries ``prompt_tokens`` (``ABORT_REPLY``) is how older releases answered; SGLang 0.5.23's
  ``_handle_abort_req`` answers a request aborted in the waiting queue without it, which
  ``test_sglang_conformance.py`` pins.
- ``python/sglang/srt/managers/schedule_batch.py``: ``FINISH_MATCHED_TOKEN.to_json()`` is
  ``{"type": "stop", "matched": id}``, ``FINISH_LENGTH`` ``{"type": "length", "length": n}``.
- ``test/srt/test_srt_endpoint.py::test_logprob_start_len``: ``prompt_tokens ==
  logprob_start_len + len(input_token_logprobs)``; a batch (``text`` as a list) returns a list.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from engine.backends import HTTPSettings, SGLangBackend, SGLangConfig
from engine.backends.sglang_protocol import parse_batch_reply, parse_generate_reply
from engine.errors import (
    BackendHTTPError,
    BackendProtocolError,
    BackendUnavailable,
    ConfigError,
    GenerationAborted,
)

URL = "http://sglang.test:30000"

# A reply in SGLang's shape: prompt of 4 tokens, logprob_start_len=0, top_logprobs_num=2,
# return_text_in_logprobs=True, 3 output tokens ending on the eos token 2.
DOCUMENTED_REPLY: dict[str, Any] = {
    "text": " Paris.",
    "output_ids": [12, 13, 2],
    "meta_info": {
        "id": "a1b2",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "input_token_logprobs": [
            [None, 5, "The"],
            [-3.25, 6, " capital"],
            [-0.5, 7, " of"],
            [-1.0, 8, " France"],
        ],
        "output_token_logprobs": [[-0.125, 12, " Paris"], [-0.25, 13, "."], [-0.0625, 2, ""]],
        "input_top_logprobs": [
            None,
            [[-1.5, 9, " city"], [-3.25, 6, " capital"]],
            [[-0.5, 7, " of"], [-2.0, 10, " is"]],
            [[-1.0, 8, " France"], [-1.5, 11, " Spain"]],
        ],
        "output_top_logprobs": [
            [[-0.125, 12, " Paris"], [-3.0, 14, " Lyon"]],
            [[-0.25, 13, "."], [-2.5, 15, ","]],
            [[-0.0625, 2, ""], [-4.0, 16, " It"]],
        ],
        "e2e_latency": 0.1,
    },
}

ABORT_REPLY: dict[str, Any] = {
    "text": "",
    "meta_info": {
        "id": "a1b2",
        "finish_reason": {"type": "abort", "message": "Abort before prefill"},
        "prompt_tokens": 0,
        "completion_tokens": 0,
    },
}


def _copy(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def test_documented_reply_parses_exactly() -> None:
    reply = parse_generate_reply(DOCUMENTED_REPLY, url=URL, logprobs=True, top_logprobs=True)
    assert reply.output_ids == (12, 13, 2)
    assert reply.output_logprobs == (-0.125, -0.25, -0.0625)
    assert reply.input_token_logprobs == ((None, 5), (-3.25, 6), (-0.5, 7), (-1.0, 8))
    assert reply.prompt_tokens == 0 + len(reply.input_token_logprobs)
    assert reply.input_top_logprobs is not None and reply.input_top_logprobs[0] is None
    assert reply.input_top_logprobs[1] == ((-1.5, 9), (-3.25, 6))
    assert reply.output_top_logprobs is not None
    assert reply.output_top_logprobs[2] == ((-0.0625, 2), (-4.0, 16))
    assert reply.finish_type == "stop" and reply.finish_reason["matched"] == 2
    assert reply.rid == "a1b2"


def test_reply_without_output_ids_takes_ids_from_logprobs() -> None:
    # Older SGLang releases send no "output_ids"; the triples carry the ids.
    obj = _copy(DOCUMENTED_REPLY)
    del obj["output_ids"]
    for entry in obj["meta_info"]["output_token_logprobs"]:
        entry[2] = None  # return_text_in_logprobs=False
    reply = parse_generate_reply(obj, url=URL, logprobs=True)
    assert reply.output_ids == (12, 13, 2)


def test_batch_reply_is_a_list_in_order() -> None:
    second = _copy(DOCUMENTED_REPLY)
    second["meta_info"]["id"] = "second"
    replies = parse_batch_reply([DOCUMENTED_REPLY, second], url=URL, size=2, logprobs=True)
    assert [r.rid for r in replies] == ["a1b2", "second"]
    with pytest.raises(BackendProtocolError, match="batch of 3"):
        parse_batch_reply([DOCUMENTED_REPLY], url=URL, size=3, logprobs=True)


def _broken(path: str, value: Any) -> dict[str, Any]:
    obj: dict[str, Any] = _copy(DOCUMENTED_REPLY)
    *parents, last = path.split(".")
    node = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return obj


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("meta_info", _DELETE, "meta_info"),
        ("meta_info.finish_reason", None, "meta_info.finish_reason"),
        ("meta_info.finish_reason", "stop", "meta_info.finish_reason"),
        ("meta_info.prompt_tokens", "4", "meta_info.prompt_tokens"),
        ("meta_info.output_token_logprobs", _DELETE, "meta_info.output_token_logprobs"),
        ("meta_info.output_token_logprobs.1", [-0.25], "output_token_logprobs[1]"),
        ("meta_info.output_token_logprobs.1", [None, 13, "."], "output_token_logprobs[1][0]"),
        ("meta_info.output_token_logprobs.0", [-0.125, 12.0, None], "output_token_logprobs[0][1]"),
        ("meta_info.input_token_logprobs.2", {"logprob": -0.5}, "input_token_logprobs[2]"),
        ("text", 42, "text"),
        ("output_ids", [12, 13, 99], "differ from output_ids"),
        ("meta_info.completion_tokens", 7, "completion_tokens is 7"),
    ],
)
def test_malformed_reply_names_the_field(path: str, value: Any, named: str) -> None:
    with pytest.raises(BackendProtocolError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_generate_reply(_broken(path, value), url=URL, logprobs=True)


def test_non_object_reply_is_a_protocol_error() -> None:
    with pytest.raises(BackendProtocolError, match="a JSON object"):
        parse_generate_reply([DOCUMENTED_REPLY], url=URL, logprobs=True)


# -- the backend over httpx.MockTransport ---------------------------------------------------


class Recorder:
    """A MockTransport handler that records requests and replays scripted answers."""

    def __init__(self, *answers: Callable[[httpx.Request], httpx.Response]) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return answer(request)

    def bodies(self) -> list[Any]:
        return [json.loads(r.content) for r in self.requests]


def json_answer(obj: Any, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(status, json=obj)


def raising(exc: type[httpx.HTTPError]) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        raise exc("scripted failure", request=request)  # type: ignore[call-arg]

    return answer


def backend(recorder: Recorder, **http: Any) -> SGLangBackend:
    settings = HTTPSettings(retry_backoff_s=0.0, **http)
    return SGLangBackend(
        config=SGLangConfig(url=URL, http=settings), transport=httpx.MockTransport(recorder)
    )


async def test_generate_sends_the_token_in_payload_and_reads_tokens_out() -> None:
    rec = Recorder(json_answer(DOCUMENTED_REPLY))
    b = backend(rec)
    result = await b.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3})
    await b.aclose()
    assert rec.requests[0].url == URL + "/generate"
    assert rec.bodies() == [
        {
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
        }
    ]
    assert result.token_ids == (12, 13, 2)
    assert result.logprobs == (-0.125, -0.25, -0.0625)
    assert result.text == " Paris." and result.finish_reason == "stop"
    assert result.usage is not None and (
        result.usage.prompt_tokens,
        result.usage.completion_tokens,
    ) == (4, 3)


async def test_abort_reply_becomes_an_empty_aborted_result() -> None:
    b = backend(Recorder(json_answer(ABORT_REPLY)))
    result = await b.generate(input_ids=[5], sampling_params={})
    await b.aclose()
    assert result.aborted and result.token_ids == () and result.logprobs == () and result.text == ""


async def test_unknown_finish_type_is_an_error_finish_reason() -> None:
    reply = _broken("meta_info.finish_reason", {"type": "grammar_violation"})
    b = backend(Recorder(json_answer(reply)))
    result = await b.generate(input_ids=[5], sampling_params={})
    await b.aclose()
    assert result.finish_reason == "error:grammar_violation"


async def test_score_sends_the_teacher_role_b_payload() -> None:
    # prompt [5, 6], response [7, 8]: logprob_start_len = 1, so entry 0 is the last prompt token.
    reply = {
        "text": "x",
        "output_ids": [9],
        "meta_info": {
            "id": "s",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 4,
            "completion_tokens": 1,
            "input_token_logprobs": [[-2.0, 6, None], [-0.5, 7, None], [-0.25, 8, None]],
            "output_token_logprobs": [[-0.1, 9, None]],
            "input_top_logprobs": [
                [[-1.0, 3, None], [-2.0, 6, None]],
                [[-0.5, 7, None], [-1.5, 4, None]],
                [[-0.25, 8, None], [-2.5, 4, None]],
            ],
            "output_top_logprobs": [[[-0.1, 9, None], [-3.0, 4, None]]],
        },
    }
    rec = Recorder(json_answer(reply))
    b = backend(rec)
    score = await b.score([5, 6], [7, 8], top_logprobs_num=2)
    await b.aclose()
    assert rec.bodies() == [
        {
            "input_ids": [5, 6, 7, 8],
            "sampling_params": {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "no_stop_trim": True,
            },
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
        }
    ]
    assert score.token_ids == (7, 8) and score.logprobs == (-0.5, -0.25)
    assert score.top_token_ids == ((7, 4), (8, 4))
    assert score.top_logprobs == ((-0.5, -1.5), (-0.25, -2.5))


async def test_score_refuses_a_reply_for_other_tokens() -> None:
    reply = _copy(DOCUMENTED_REPLY)  # scores tokens 6, 7, 8 after prompt token 5
    b = backend(Recorder(json_answer(reply)))
    with pytest.raises(BackendProtocolError, match="scored token 7 at response position 1"):
        await b.score([4, 5], [6, 9, 8])
    await b.aclose()


async def test_aborted_score_raises() -> None:
    b = backend(Recorder(json_answer(ABORT_REPLY)))
    with pytest.raises(GenerationAborted, match="force-decode of 2 tokens was aborted"):
        await b.score([1], [2, 3])
    await b.aclose()


async def test_http_error_status_names_url_and_status() -> None:
    body = {"object": "error", "message": "The input is longer than the context", "code": 400}
    b = backend(Recorder(json_answer(body, status=400)))
    with pytest.raises(BackendHTTPError) as info:
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()
    assert info.value.status == 400 and info.value.url == URL + "/generate"
    assert "longer than the context" in str(info.value)


async def test_body_that_is_not_json_is_a_protocol_error() -> None:
    b = backend(Recorder(lambda r: httpx.Response(200, text="<html>gateway</html>")))
    with pytest.raises(BackendProtocolError, match="not JSON"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()


async def test_connect_errors_are_retried_because_nothing_was_sent() -> None:
    rec = Recorder(
        raising(httpx.ConnectError), raising(httpx.ConnectError), json_answer(DOCUMENTED_REPLY)
    )
    b = backend(rec, connect_retries=3)
    result = await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()
    assert len(rec.requests) == 3 and result.token_ids == (12, 13, 2)


async def test_persistent_connect_errors_give_backend_unavailable() -> None:
    rec = Recorder(raising(httpx.ConnectError))
    b = backend(rec, connect_retries=2)
    with pytest.raises(BackendUnavailable, match="could not connect after 3 attempt"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()
    assert len(rec.requests) == 3


@pytest.mark.parametrize("exc", [httpx.ReadTimeout, httpx.ReadError, httpx.WriteError])
async def test_failures_after_sending_are_not_retried(exc: type[httpx.HTTPError]) -> None:
    rec = Recorder(raising(exc), json_answer(DOCUMENTED_REPLY))
    b = backend(rec, connect_retries=3)
    with pytest.raises(BackendUnavailable, match="not retried"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()
    assert len(rec.requests) == 1


async def test_remote_protocol_error_is_a_protocol_error() -> None:
    b = backend(Recorder(raising(httpx.RemoteProtocolError)))
    with pytest.raises(BackendProtocolError, match="cut short"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError, match="http:// or https://"):
        SGLangConfig(url="localhost:30000")
    with pytest.raises(ConfigError, match="read_timeout_s"):
        HTTPSettings(read_timeout_s=0)
    b = SGLangBackend(config=SGLangConfig(url=URL))
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        b.tokenize("hello")


async def test_generate_needs_exactly_one_input() -> None:
    b = SGLangBackend(config=SGLangConfig(url=URL))
    with pytest.raises(ValueError, match="exactly one"):
        await b.generate(sampling_params={})
    with pytest.raises(ValueError, match="exactly one"):
        await b.generate(
            input_ids=[1], messages=[{"role": "user", "content": "x"}], sampling_params={}
        )


# -- real sockets: refused connections, silent and broken servers ----------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def raw_server() -> Iterator[Callable[[bytes | None], str]]:
    """A one-shot TCP server answering every connection with fixed bytes (None: say nothing)."""
    sockets: list[socket.socket] = []
    stop = threading.Event()

    def start(answer: bytes | None) -> str:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        sockets.append(listener)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except (TimeoutError, OSError):
                    continue
                sockets.append(conn)
                conn.recv(65536)
                if answer is not None:
                    conn.sendall(answer)
                    # Half-close, then drain: closing with unread request bytes would send a
                    # reset instead of the clean end-of-stream these cases are about.
                    conn.shutdown(socket.SHUT_WR)
                    conn.settimeout(5)
                    try:
                        while conn.recv(65536):
                            pass
                    except OSError:
                        pass
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield start
    stop.set()
    for s in sockets:
        s.close()


def _socket_backend(url: str, **http: Any) -> SGLangBackend:
    return SGLangBackend(
        config=SGLangConfig(url=url, http=HTTPSettings(retry_backoff_s=0.0, **http))
    )


async def test_connection_refused_is_backend_unavailable_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    b = _socket_backend(url, connect_retries=1)
    with pytest.raises(BackendUnavailable, match=f"{url}/generate: could not connect"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        # Content-Length promises more than arrives before the server closes.
        (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
            b'{"text": "tr',
            BackendProtocolError,
        ),
        (b"this is not http\r\n\r\n", BackendProtocolError),
        (b"", BackendProtocolError),  # accepted, then closed without a reply
        (b'HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{"text": ', BackendProtocolError),
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy", BackendHTTPError),
    ],
    ids=["truncated-body", "garbage-status-line", "closed-without-reply", "truncated-json", "503"],
)
async def test_broken_replies_over_real_sockets(
    raw_server: Callable[[bytes | None], str], answer: bytes, error: type[Exception]
) -> None:
    b = _socket_backend(raw_server(answer))
    with pytest.raises(error):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()


async def test_silent_server_hits_the_read_timeout(
    raw_server: Callable[[bytes | None], str],
) -> None:
    b = _socket_backend(raw_server(None), read_timeout_s=0.2)
    with pytest.raises(BackendUnavailable, match="ReadTimeout"):
        await b.generate(input_ids=[1], sampling_params={})
    await b.aclose()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("7", 7),  # SGLang 0.5.23 writes the version as a string
        (7, 7),
        ("0", 0),
        ("default", None),  # --weight-version's default: no integer version
        (None, None),  # a server that reports none
        ("-1", None),
        ("1.5", None),
        (True, None),
        (-3, None),
    ],
)
def test_weight_version_is_read_from_the_reply_or_unknown(
    raw: object, expected: int | None
) -> None:
    meta: dict[str, object] = {
        "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1,
        "completion_tokens": 1, "output_token_logprobs": [[-0.5, 9, None]],
    }
    if raw is not None:
        meta["weight_version"] = raw
    reply = parse_generate_reply(
        {"text": "x", "output_ids": [9], "meta_info": meta}, url="http://s", logprobs=True
    )
    assert reply.weight_version == expected
