"""``RecordingProxy``: an OpenAI-compatible façade that records a scaffold's calls as tokens.

One proxy per task, on its own free loopback port, started and torn down by ``async with``::

    async with RecordingProxy(backend=pool.get(), tokenizer=tok) as proxy:
        run_scaffold(base_url=proxy.url + "/v1")     # the scaffold only speaks OpenAI chat
    trajectory = proxy.trajectory()                   # None unless capture stayed valid

The backend is any ``ModelBackend`` with the ``token_ids`` capability; a ``BackendPool``'s
``get()`` brings the pool's hooks. Served by uvicorn inside the caller's event loop, so it
shares the worker's pooled backend:

- ``POST /v1/chat/completions``: one ``engine.proxy.series`` step on the model server's
  token-level ``/generate``; the reply is a ``chat.completion`` (or, with ``stream: true``,
  ``chat.completion.chunk`` events ending in ``[DONE]``) with ``tool_calls`` parsed by
  ``engine.backends.toolcalls``.
- ``GET /v1/models`` (and ``/v1/models/{id}``): the model server's own answer.

Once capture is off (the append-only guard fired, the server aborted a generation, anything
unexpected failed, or the call asked for what one series cannot hold, such as ``n > 1``),
every call passes through unchanged to the model server's ``/v1/chat/completions``, inside the
backend's ``forwarded_call`` so the pool's hooks bracket it: the scaffold's run completes and
the task yields no token data. A generation in flight when the proxy stops is aborted where
the backend can abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from types import TracebackType
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.backends.base import ModelBackend
from engine.backends.toolcalls import parse_tool_calls
from engine.errors import ConfigError
from engine.proxy.series import AppendOnlyViolation, ProxyTrajectory, Recorder

__all__ = ["RecordingProxy"]

log = logging.getLogger(__name__)

# Request fields mapped onto SGLang's sampling params (the rest are the chat API's business).
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "seed": "sampling_seed",
    "ignore_eos": "ignore_eos",
}
_DEFAULT_MAX_TOKENS = 512


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the proxy lives inside a worker that owns those."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _PassThrough(Exception):
    """Capture is off for this call: forward it to the model server."""


class RecordingProxy:
    def __init__(
        self,
        *,
        backend: ModelBackend,
        tokenizer: Any,
        host: str = "127.0.0.1",
        task_id: str | None = None,
    ) -> None:
        if not backend.capabilities.token_ids:
            raise ConfigError(
                f"RecordingProxy needs a backend with the token_ids capability (a BackendPool's "
                f"get() on an SGLang server), got {backend!r}"
            )
        self.backend = backend
        self.recorder = Recorder(tokenizer)
        self.host = host
        self.task_id = task_id or uuid.uuid4().hex[:12]
        self.upstream = backend.base_url
        self.calls = 0
        self.passed_through = 0
        self._lock = asyncio.Lock()
        self._rid: str | None = None
        self._client: httpx.AsyncClient | None = None
        self._server: _Server | None = None
        self._serving: asyncio.Task[None] | None = None
        self._port = 0
        self._sock: socket.socket | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self._models, methods=["GET"]),
            ]
        )

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("RecordingProxy is not started (use `async with`)")
        return self._port

    @property
    def url(self) -> str:
        """The base URL a scaffold's OpenAI client is given (append ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def capture_valid(self) -> bool:
        return self.recorder.valid

    @property
    def invalid_reason(self) -> str | None:
        return self.recorder.invalid_reason

    def trajectory(self) -> ProxyTrajectory | None:
        """The captured series; ``None`` if capture was turned off or it is inconsistent."""
        return self.recorder.trajectory()

    async def __aenter__(self) -> RecordingProxy:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only for
        # sockets whose proto says TCP (proto 0 leaves Nagle's delay on every reply).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self._port = int(sock.getsockname()[1])
        # log_config=None: uvicorn must not reconfigure the worker's logging.
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            access_log=False,
            log_config=None,
            log_level="warning",
            timeout_keep_alive=30,
        )
        self._server = _Server(config)
        self._serving = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                sock.close()
                await self._serving  # raises what stopped it
                raise RuntimeError(f"the recording proxy on port {self._port} did not start")
            await asyncio.sleep(0.005)
        self._sock = sock
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop serving, abort a generation still in flight, release the pass-through client."""
        with contextlib.suppress(Exception):
            await self.abort()
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = self._serving = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def abort(self) -> None:
        """Abort the generation in flight, if any (its call then passes through)."""
        if self._rid is not None and self.backend.capabilities.abort:
            await self.backend.abort(self._rid)

    def _upstream(self) -> httpx.AsyncClient:
        """The client for the model server's own OpenAI routes, made on first use: most tasks
        never pass a call through, and a client loads the CA bundle when made."""
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(None))
        return self._client

    async def _models(self, request: Request) -> Response:
        reply = await self._upstream().get(request.url.path)
        return Response(
            reply.content,
            status_code=reply.status_code,
            media_type=reply.headers.get("content-type"),
        )

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            return _error(f"request body is not JSON: {exc}", 400)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error("request body must be an object with a 'messages' list", 400)
        async with self._lock:
            self.calls += 1
            if self.recorder.valid:
                try:
                    reply = await self._capture(body)
                except _PassThrough:
                    pass
                except AppendOnlyViolation as exc:
                    self.recorder.invalidate(f"append-only guard: {exc}")
                except Exception as exc:  # anything unexpected: the run goes on, uncaptured
                    log.warning("recording proxy %s: capture failed: %r", self.task_id, exc)
                    self.recorder.invalidate(f"capture failed: {type(exc).__name__}: {exc}")
                else:
                    return self._respond(body, reply, BackgroundTask(self._prepare))
            self.passed_through += 1
            return await self._pass_through(raw, bool(body.get("stream")))

    async def _capture(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if int(body.get("n") or 1) != 1:
            self.recorder.invalidate("n > 1 cannot be captured as one series")
            raise _PassThrough
        series = self.recorder.sync(body["messages"], body.get("tools"))
        params: dict[str, Any] = {
            _SAMPLING[k]: v for k, v in body.items() if k in _SAMPLING and v is not None
        }
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        params["max_new_tokens"] = int(max_tokens or _DEFAULT_MAX_TOKENS)
        self._rid = f"proxy-{self.task_id}-{len(self.recorder.turns)}"
        started = time.monotonic()
        try:
            gen = await self.backend.generate(
                input_ids=series, sampling_params=params, rid=self._rid
            )
        finally:
            self._rid = None
        if gen.aborted:
            self.recorder.invalidate("the model server aborted a generation")
            raise _PassThrough
        if gen.token_ids is None or gen.logprobs is None:
            self.recorder.invalidate(f"the backend returned no token ids ({gen.finish_reason})")
            raise _PassThrough
        if str(gen.finish_reason).startswith("error:"):
            self.recorder.invalidate(f"the model server ended with {gen.finish_reason}")
            raise _PassThrough
        text = str(self.recorder.tokenizer.decode(list(gen.token_ids), skip_special_tokens=True))
        parsed = parse_tool_calls(text, id_prefix=f"call_{len(self.recorder.turns)}_")
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        finish = (
            "tool_calls"
            if parsed.tool_calls
            else ("length" if gen.finish_reason == "length" else "stop")
        )
        content = parsed.content if (parsed.content or not parsed.tool_calls) else None
        self.recorder.generated(
            gen.token_ids,
            gen.logprobs,
            content=content or "",
            calls=calls,
            prompt_tokens=len(series),
            elapsed_s=time.monotonic() - started,
            finish_reason=str(gen.finish_reason),
        )
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.tool_calls
            ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or ""),
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            ],
            "usage": {
                "prompt_tokens": len(series),
                "completion_tokens": len(gen.token_ids),
                "total_tokens": len(series) + len(gen.token_ids),
            },
        }

    async def _prepare(self) -> None:
        """``Recorder.prepare`` once a reply is sent; a failure is left for the next ``sync``."""
        async with self._lock:
            with contextlib.suppress(Exception):
                self.recorder.prepare()

    def _respond(
        self, body: Mapping[str, Any], reply: dict[str, Any], after: BackgroundTask
    ) -> Response:
        if not body.get("stream"):
            return JSONResponse(reply, background=after)
        options = body.get("stream_options") or {}
        usage = bool(options.get("include_usage")) if isinstance(options, Mapping) else False
        return StreamingResponse(
            _sse(reply, usage), media_type="text/event-stream", background=after
        )

    async def _pass_through(self, raw: bytes, stream: bool) -> Response:
        client = self._upstream()
        headers = {"content-type": "application/json"}
        if not stream:
            async with self.backend.forwarded_call():  # a generation: the pool's hooks
                reply = await client.post("/v1/chat/completions", content=raw, headers=headers)
            return Response(
                reply.content,
                status_code=reply.status_code,
                media_type=reply.headers.get("content-type"),
            )
        turn = self.backend.forwarded_call()  # held until the stream ends
        await turn.__aenter__()
        try:
            upstream = await client.send(
                client.build_request("POST", "/v1/chat/completions", content=raw, headers=headers),
                stream=True,
            )
        except BaseException:
            await turn.__aexit__(None, None, None)
            raise

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                await turn.__aexit__(None, None, None)

        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=upstream.headers.get("content-type", "text/event-stream"),
        )


async def _sse(reply: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """The reply as ``chat.completion.chunk`` events, in the order SGLang streams them."""
    choice = reply["choices"][0]
    message = choice["message"]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"],
            "model": reply["model"]}  # fmt: skip

    def event(delta: dict[str, Any], finish: str | None) -> bytes:
        chunk = {**base, "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ]}  # fmt: skip
        return f"data: {json.dumps(chunk)}\n\n".encode()

    yield event({"role": "assistant", "content": ""}, None)
    if message.get("content"):
        yield event({"content": message["content"]}, None)
    for i, call in enumerate(message.get("tool_calls") or ()):
        yield event({"tool_calls": [{"index": i, **call}]}, None)
    yield event({}, choice["finish_reason"])
    if include_usage:
        usage = {**base, "choices": [], "usage": reply["usage"]}
        yield f"data: {json.dumps(usage)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}},
        status_code=status,
    )
