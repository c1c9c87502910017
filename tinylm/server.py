"""``rollout tinylm serve``: an SGLang-compatible HTTP server for a tinylm model, on CPU.

Routes (JSON over HTTP/1.1 with keep-alive; Starlette on uvicorn, as SGLang's FastAPI app,
with the plumbing in ``asgi.py``):

- ``POST /generate``: SGLang's native endpoint (the body: ``generate_input.py``). The reply is
  ``{"text", "output_ids", "meta_info"}`` as SGLang writes it (``replies.py``), a list for a
  batch; ``"stream": true`` answers server-sent events (``generate_stream.py``), from the same
  scheduler batch as every other request.
- ``POST /v1/chat/completions``: OpenAI chat (``chat.py``), tool calls and ``stream`` included.
- ``POST /abort_request`` (``TokenizerManager.abort_request``, SGLang's ``AbortReq``): 200 with
  an empty body, whatever it reached. ``{"abort_all": true}`` aborts everything. ``{"rid": R}``
  reaches the scheduler only when a request submitted under exactly ``R`` is still running or
  queued (with one tokenizer worker, SGLang's default, an unknown ``R`` is ignored); the
  scheduler then aborts every request whose rid *starts with* ``R``. With
  ``tokenizer_worker_num > 1`` every rid goes to the scheduler's prefix match, as SGLang does
  when it cannot know which worker holds the rid. ``{}`` is ignored. The aborted request's own
  reply is a normal 200 whose ``finish_reason`` is ``{"type": "abort", ...}`` with its partial
  output (``replies.py``).
- ``POST /update_weights_from_disk``, ``POST /update_weight_version``,
  ``GET /get_weight_version``, ``POST /pause_generation``, ``POST /continue_generation``,
  ``GET|POST /flush_cache``: SGLang's weight-sync routes (``weights.py``, which says what
  happens to requests in flight during an update). Every ``/generate`` ``meta_info`` and
  ``/get_model_info`` carry the current ``weight_version`` (``--weight-version``, default
  ``default`` as SGLang's ``ServerArgs.weight_version``, until an update names another);
  ``/get_server_info`` reports the server's arguments, ``weight_version`` as started.
- ``GET /health``, ``/health_generate``, ``/ready`` (``health.py``), ``/get_model_info``,
  ``/get_server_info``, ``/v1/models``, ``/v1/models/{id}``.

Access: the server binds ``127.0.0.1`` unless ``host`` says otherwise. ``api_key`` and
``admin_api_key`` work as SGLang's ``--api-key`` / ``--admin-api-key`` (``auth.py``): with an
admin key, only its holder may call the admin routes (``/abort_request`` and the weight,
pause and cache routes); a request without the right ``Authorization: Bearer`` key gets 401.

Errors are JSON ``{"object": "error", "message", "type", "code"}`` with status 400 (bad request:
the message names the field), 401, 404, 405 (a known route, another method), 500 or 503
(shutting down; the health routes then answer an empty 503, as SGLang's). A request whose
client disconnects is aborted. ``close()`` aborts everything in flight, lets those replies go
out, then closes every connection.

Request handlers run on uvicorn's event loop and never block it: generation is submitted to
the scheduler thread and awaited (``asgi.wait_outputs`` / ``follow_tokens``); calls that may
wait (a request arriving while generation is paused or an update waits, the update itself, a
pause that drains) run in worker threads.

Port 0 binds a free port; ``TinyLMServer.url`` (and the ready line ``serve`` prints,
``tinylm ready on http://HOST:PORT ...``) says which. Tests start a server in-process with
``start_server`` or as a subprocess with ``spawn_server`` (``process.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tinylm.asgi import (
    UvicornThread,
    error_body,
    follow_all,
    follow_tokens,
    json_response,
    listen,
    wait_outputs,
)
from tinylm.auth import allowed
from tinylm.chat import ChatError, Follow, chat_completion
from tinylm.errors import ConfigError
from tinylm.generate_input import BadRequest, GenerateInput, SchemaError
from tinylm.generate_stream import DONE, ChunkSettings, StreamChunks, error_event, event
from tinylm.health import HealthSettings, health_generate, health_rid
from tinylm.runtime import TinyLMRuntime
from tinylm.sampling import LogprobMode, SamplingParams, logprob_mode_from_env
from tinylm.scheduler import (
    GenerateOutput,
    GenerateRequest,
    GenerationScheduler,
    Pending,
    SchedulerClosed,
)
from tinylm.sglang_server_args import SGLANG_VERSION
from tinylm.weights import UpdateFromDisk, WeightControl, WeightRequestError

__all__ = ["READY_PREFIX", "ServerConfig", "TinyLMServer", "serve", "start_server"]

log = logging.getLogger(__name__)

T = TypeVar("T")

READY_PREFIX = "tinylm ready on "


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Settings of one tinylm server."""

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    max_running_requests: int = 16
    max_context: int | None = None
    # None: as SGLang, from SGLANG_RETURN_ORIGINAL_LOGPROB (unset: temperature-scaled logprobs).
    logprob_mode: LogprobMode | None = None
    served_model_name: str | None = None
    keepalive_timeout_s: float = 120.0
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    weight_version: str = "default"  # SGLang's ServerArgs.weight_version default
    # >1: an /abort_request for a rid no request holds still reaches the scheduler (SGLang
    # with several tokenizer workers); tinylm has one either way.
    tokenizer_worker_num: int = 1
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    # None: from SGLang's variables (health.py)
    health: HealthSettings | None = None

    @property
    def mode(self) -> LogprobMode:
        """``logprob_mode`` as resolved (never None after construction)."""
        assert self.logprob_mode is not None
        return self.logprob_mode

    @property
    def health_settings(self) -> HealthSettings:
        assert self.health is not None
        return self.health

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.tokenizer_worker_num < 1 or self.stream_interval < 1:
            raise ConfigError(
                "tokenizer_worker_num and stream_interval must be >= 1, got "
                f"{self.tokenizer_worker_num} and {self.stream_interval}"
            )
        if self.health is None:
            object.__setattr__(self, "health", HealthSettings.from_env())
        mode: Any = self.logprob_mode
        if mode is None:
            mode = logprob_mode_from_env()
        try:
            object.__setattr__(self, "logprob_mode", LogprobMode(mode))
        except ValueError as exc:
            raise ConfigError(
                f"logprob_mode must be one of {[m.value for m in LogprobMode]}, "
                f"got {self.logprob_mode!r}"
            ) from exc


class TinyLMServer:
    """Model, scheduler and HTTP front end (Starlette on uvicorn) of one tinylm server."""

    def __init__(self, config: ServerConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        root = Path(config.model_dir)
        if not (root / "config.json").is_file():
            raise ConfigError(
                f"{root}: not a tinylm model folder (no config.json); run "
                f"`rollout tinylm init {root}` first"
            )
        self.hf_tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        # Encode and decode with the Rust tokenizer inside the transformers one: the same
        # pipeline clients get from AutoTokenizer, and safe to share with the scheduler thread
        # (only the transformers wrapper mutates it, when asked to pad or truncate).
        self.tokenizer = self.hf_tokenizer.backend_tokenizer
        runtime = TinyLMRuntime.load(
            root, max_slots=config.max_running_requests, max_len=config.max_context
        )
        self.scheduler = GenerationScheduler(
            runtime,
            self.tokenizer,
            eos_token_ids=_eos_ids(root, self.hf_tokenizer),
            logprob_mode=config.mode,
            weight_version=config.weight_version,
        )
        self.weights = WeightControl(self.scheduler, model_path=root)
        self.model_name = config.served_model_name or root.name
        self._input = GenerateInput(
            lambda text: list(self.tokenizer.encode(text, add_special_tokens=False).ids),
            self.scheduler.new_rid,
        )
        self._healthy = True  # False after a failed health check, until one succeeds
        self._chunks = ChunkSettings(
            incremental=config.incremental_streaming_output,
            interval=config.stream_interval,
            decode=lambda ids, skip: str(
                self.tokenizer.decode(list(ids), skip_special_tokens=skip)
            ),
            token_text=self.scheduler.token_text,
            weight_version=lambda: self.weights.version,
        )
        self._closed = threading.Event()
        self._active = 0
        self._active_cv = threading.Condition()
        # Blocking calls leave the event loop for threads: requests waiting out a pause or
        # an update (as many as arrive) apart from the admin calls, so those always get one.
        self._waiting_threads = anyio.CapacityLimiter(4096)
        self._admin_threads = anyio.CapacityLimiter(8)
        self.app = Starlette(
            routes=self._routes(),
            exception_handlers={HTTPException: self._http_exception},
        )
        self._sock = listen(config.host, config.port)
        host, port = self._sock.getsockname()[:2]
        self._address = (str(host), int(port))
        self._http = UvicornThread(
            self._asgi, self._sock, keepalive_timeout_s=config.keepalive_timeout_s
        )
        self._started = False

    @property
    def port(self) -> int:
        return self._address[1]

    @property
    def address(self) -> tuple[str, int]:
        """The address the server listens on (host, port)."""
        return self._address

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self) -> TinyLMServer:
        """Serve in a background thread (its own event loop); returns self once listening."""
        try:
            self._http.start()
        except BaseException:
            self.close()
            raise
        self._started = True
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Abort in-flight requests, send their replies, close every connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.weights.close()
        self.scheduler.close(timeout)
        deadline = time.monotonic() + timeout
        with self._active_cv:
            while self._active and time.monotonic() < deadline:
                self._active_cv.wait(deadline - time.monotonic())
        if self._started:
            self._http.stop(max(1.0, deadline - time.monotonic()))
        else:
            self._sock.close()

    def __enter__(self) -> TinyLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connections(self) -> list[Any]:
        """The open HTTP connections' transports (for tests: e.g. their socket options)."""
        return [c.transport for c in self._http.connections()]

    # -- ASGI: auth, shutdown, counting --------------------------------------------------------

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self._track(+1)
        try:
            config = self.config
            method, path = scope["method"], scope["path"]
            if (config.api_key or config.admin_api_key) and not allowed(
                method,
                path,
                _header(scope, b"authorization"),
                api_key=config.api_key,
                admin_api_key=config.admin_api_key,
            ):
                message = f"{path} needs a valid 'Authorization: Bearer' key"
                response = json_response(error_body(message, 401), 401)
            elif self._closed.is_set() and path.startswith("/health"):
                response = Response(status_code=503)  # SGLang's gracefully_exit answer
            elif self._closed.is_set():
                message = "tinylm server is shutting down"
                response = json_response(error_body(message, 503), 503)
            else:
                await self.app(scope, receive, send)
                return
            await response(scope, receive, send)
        finally:
            self._track(-1)

    def _track(self, delta: int) -> None:
        """Count requests being handled, reply included, so ``close`` can wait for them."""
        with self._active_cv:
            self._active += delta
            if not self._active:
                self._active_cv.notify_all()

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        else:
            message = str(exc.detail)
        return json_response(error_body(message, exc.status_code), exc.status_code)

    def _routes(self) -> list[Route]:
        post, get = ["POST"], ["GET"]
        return [
            Route("/generate", _endpoint(self._generate), methods=post),
            Route("/v1/chat/completions", _endpoint(self._chat), methods=post),
            Route("/abort_request", _endpoint(self._abort), methods=post),
            Route("/health", _endpoint(self._health), methods=get),
            Route("/health_generate", _endpoint(self._health), methods=get),
            Route("/ready", _endpoint(self._ready), methods=get),
            Route("/get_model_info", _endpoint(self._get_model_info), methods=get),
            Route("/get_server_info", _endpoint(self._get_server_info), methods=get),
            Route("/v1/models", _endpoint(self._models), methods=get),
            Route("/v1/models/{model_id:path}", _endpoint(self._model), methods=get),
            Route("/update_weights_from_disk", _endpoint(self._update), methods=post),
            Route("/get_weight_version", _endpoint(self._weight_version), methods=get),
            Route("/update_weight_version", _endpoint(self._set_version), methods=post),
            Route("/pause_generation", _endpoint(self._pause), methods=post),
            Route("/continue_generation", _endpoint(self._continue), methods=post),
            Route("/flush_cache", _endpoint(self._flush), methods=["GET", "POST"]),
        ]

    # -- info routes ---------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        settings = self.config.health_settings
        if request.url.path == "/health" and not settings.generate_on_health:
            return Response(status_code=200)
        self._healthy = await health_generate(
            settings,
            try_submit=self._submit_health_check,
            last_output_at=lambda: self.scheduler.last_output_at,
        )
        return Response(status_code=200 if self._healthy else 503)

    def _submit_health_check(self) -> bool:
        """The health check's one-token request, if it can start now (``health.py``)."""
        try:
            if not self.weights.try_enter():
                return False
        except SchedulerClosed:
            return False
        request = GenerateRequest(
            rid=health_rid(),
            input_ids=(0,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            if self.scheduler.running_rids():
                # SGLang's scheduler skips the check when busy: its requests carry the news.
                self.weights.leave()
            else:
                self.scheduler.submit(request).on_done(self.weights.leave)
        except (SchedulerClosed, ValueError):
            self.weights.leave()
        return True

    async def _ready(self, request: Request) -> Response:
        ready = self._healthy and not self.weights.paused and not self._closed.is_set()
        return Response(status_code=200 if ready else 503)

    async def _get_model_info(self, request: Request) -> Response:
        return json_response(self._model_info())

    async def _get_server_info(self, request: Request) -> Response:
        # SGLang: the server's arguments as resolved at start (``ServerArgs.resolved_dict``;
        # a later weight version is in /get_model_info), then live scheduler state. tinylm
        # lists the arguments it has, never its keys.
        config = self.config
        return json_response(
            {
                "model_path": str(config.model_dir),
                "tokenizer_path": str(config.model_dir),
                "host": config.host,
                "port": self.port,
                "served_model_name": self.model_name,
                "weight_version": config.weight_version,
                "context_length": self.scheduler.max_context,
                "max_running_requests": config.max_running_requests,
                "tokenizer_worker_num": config.tokenizer_worker_num,
                "stream_interval": config.stream_interval,
                "incremental_streaming_output": config.incremental_streaming_output,
                "logprob_mode": str(config.logprob_mode),
                "version": SGLANG_VERSION,
                "frontend": "tinylm",
                "running_rids": self.scheduler.running_rids(),
                "forward_steps": self.scheduler.steps,
            }
        )

    async def _models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            raise BadRequest(f"the model {model_id!r} does not exist", 404)
        return json_response(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        # SGLang's ModelCard (entrypoints/openai/protocol.py): id, object, created, owned_by, root
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tinylm",
            "root": self.model_name,
            "max_model_len": self.scheduler.max_context,
        }

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.weights.model_path,
            "tokenizer_path": str(self.config.model_dir),
            "served_model_name": self.model_name,
            "is_generation": True,
            "weight_version": self.weights.version,
            "max_context_length": self.scheduler.max_context,
            "max_running_requests": self.config.max_running_requests,
            "logprob_mode": str(self.config.logprob_mode),
        }

    # -- admin routes (``weights.py`` says what they do and where SGLang does it) --------------

    async def _abort(self, request: Request) -> Response:
        body = await _json(request)
        body = _object({} if body is None else body)
        rid, abort_all = body.get("rid"), body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}")
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_all must be a boolean, got {abort_all!r}")
        if abort_all:
            self.scheduler.abort(None)
        elif rid and (self.config.tokenizer_worker_num > 1 or self.scheduler.is_live(rid)):
            self.scheduler.abort(rid)
        return Response(status_code=200)

    async def _update(self, request: Request) -> Response:
        update = _weights_call(UpdateFromDisk.from_json, _object(await _json(request)))
        ok, message = await self._admin(self.weights.update_from_disk, update)
        reply = {"success": ok, "message": message, "num_paused_requests": 0}
        return json_response(reply, 200 if ok else 400)

    async def _weight_version(self, request: Request) -> Response:
        return json_response({"weight_version": self.weights.version})

    async def _set_version(self, request: Request) -> Response:
        """SGLang's ``/update_weight_version`` (``UpdateWeightVersionReqInput``): ``new_version``,
        ``abort_all_requests`` (default true) first aborts everything in flight."""
        body = _object(await _json(request))
        version, abort = body.get("new_version"), body.get("abort_all_requests", True)
        if not isinstance(version, str):
            raise BadRequest(f"new_version must be a string, got {version!r}")
        if not isinstance(abort, bool):
            raise BadRequest(f"abort_all_requests must be a boolean, got {abort!r}")
        if abort:
            self.scheduler.abort(None)
        await self._admin(self.scheduler.set_weight_version, version)
        self.weights.version = version
        return json_response(
            {
                "success": True,
                "message": f"Weight version updated to {version}",
                "new_version": version,
            }
        )

    async def _pause(self, request: Request) -> Response:
        body = await _json(request)
        await self._admin(self.weights.pause, _object(body if body is not None else {}))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: Request) -> Response:
        self.weights.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush(self, request: Request) -> Response:
        ok, text = self.weights.flush()
        return Response(text, status_code=200 if ok else 400, media_type="text/plain")

    async def _admin(self, fn: Callable[[Any], T], arg: Any) -> T:
        """Run a blocking weight call in a thread (it may wait for requests to finish)."""
        return await anyio.to_thread.run_sync(_weights_call, fn, arg, limiter=self._admin_threads)

    # -- generation ----------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Response:
        body = _object(await _json(request))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise SchemaError(f"stream must be a boolean, got {stream!r}")
        try:
            requests, batch = self._input.parse(body)
        except SchemaError:
            raise
        except BadRequest as exc:
            if not stream:
                raise
            # SGLang raises it inside the stream (TokenizerManager.generate_request)
            return _event_stream(_refused(exc))
        if stream:
            streamed = [dataclasses.replace(r, stream=True) for r in requests]
            return _event_stream(self._stream(streamed, batch))
        outputs = await self._run(requests, request.receive)
        replies = [o.to_json() for o in outputs]
        return json_response(replies if batch else replies[0])

    async def _run(
        self, requests: Sequence[GenerateRequest], receive: Receive
    ) -> list[GenerateOutput]:
        pendings: list[Pending] = []
        try:
            for req in requests:
                pendings.append(await self._submit(req))
        except BaseException:
            self._abort_all(pendings)
            raise
        return await wait_outputs(pendings, receive, lambda: self._abort_all(pendings))

    async def _stream(
        self, requests: Sequence[GenerateRequest], batch: bool
    ) -> AsyncIterator[bytes]:
        """The SSE body of a streamed ``/generate`` (``generate_stream.py``). Requests are
        submitted here, after the headers, so a refused one is an error event, as SGLang's."""
        chunks: list[StreamChunks] = []
        try:
            for i, req in enumerate(requests):
                pending = await self._submit(req)
                chunks.append(StreamChunks(req, pending, self._chunks, i if batch else None))
        except BadRequest as exc:
            self._abort_all([c.pending for c in chunks])
            yield error_event(str(exc), exc.status)
            yield DONE
            return
        except BaseException:  # the client left while the batch was being submitted
            self._abort_all([c.pending for c in chunks])
            raise
        async for news in follow_all([c.pending for c in chunks], self._abort_all):
            stream = chunks[news.index]
            if news.output is not None:
                yield event(stream.final(news.output))
            elif news.error is not None:  # the scheduler failed it (a tinylm bug)
                yield error_event(f"internal error: {news.error}", 500)
            elif (chunk := stream.step(news.tokens)) is not None:
                yield event(chunk)
        yield DONE

    async def _follow(self, req: GenerateRequest) -> Follow:
        """Submit a ``stream`` request now (so a bad one is refused before any reply is sent);
        the returned iterator yields its tokens as they are drawn, then the output."""
        pending = await self._submit(req)
        return follow_tokens(pending, lambda: self.scheduler.abort(pending.rid))

    async def _submit(self, req: GenerateRequest) -> Pending:
        """Submit ``req`` once generation is not paused and no weight update is waiting; it
        holds the model-update lock's reader side until it finishes (``weights.py``)."""
        try:
            if not self.weights.try_enter():
                await anyio.to_thread.run_sync(self.weights.enter, limiter=self._waiting_threads)
        except SchedulerClosed as exc:
            raise BadRequest(str(exc), 503) from exc
        try:
            pending = self.scheduler.submit(req)
        except BaseException as exc:
            self.weights.leave()
            if isinstance(exc, SchedulerClosed):
                raise BadRequest(str(exc), 503) from exc
            if isinstance(exc, ValueError):
                raise BadRequest(str(exc)) from exc
            raise
        pending.on_done(self.weights.leave)
        return pending

    def _abort_all(self, pendings: Sequence[Pending]) -> None:
        for p in pendings:
            self.scheduler.abort(p.rid)

    async def _chat(self, request: Request) -> Response:
        body = _object(await _json(request))
        try:
            reply = await chat_completion(
                body,
                tokenizer=self.hf_tokenizer,
                encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids,
                decode=lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False),
                decode_text=lambda ids, skip: self.tokenizer.decode(
                    list(ids), skip_special_tokens=skip
                ),
                new_rid=self.scheduler.new_rid,
                run=lambda reqs: self._run(reqs, request.receive),
                follow=self._follow,
                model_name=self.model_name,
            )
        except ChatError as exc:
            raise BadRequest(str(exc)) from exc
        if reply.events is None:
            return json_response(reply.body)
        return StreamingResponse(
            _sse(reply.events, request.url.path),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _eos_ids(root: Path, tokenizer: Any) -> list[int]:
    path = root / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and eos:
            return [int(e) for e in eos]
    return [int(tokenizer.eos_token_id)]


def _endpoint(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` with tinylm's errors as JSON replies: ``BadRequest`` with its status, and
    anything unexpected as a 500 naming the exception (logged with its traceback)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except BadRequest as exc:
            return json_response(error_body(str(exc), exc.status), exc.status)
        except Exception as exc:
            log.exception("tinylm: %s %s failed", request.method, request.url.path)
            return json_response(error_body(f"internal error: {exc!r}", 500), 500)

    return endpoint


async def _json(request: Request) -> Any:
    """The request's JSON body (``None`` when empty)."""
    raw = await request.body()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _weights_call(fn: Callable[[Any], T], arg: Any) -> T:
    try:
        return fn(arg)
    except WeightRequestError as exc:
        raise BadRequest(str(exc)) from exc
    except SchedulerClosed as exc:  # closed while an update or a pause waited
        raise BadRequest(str(exc), 503) from exc


def _event_stream(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _refused(exc: BadRequest) -> AsyncIterator[bytes]:
    yield error_event(str(exc), exc.status)
    yield DONE


async def _sse(events: Iterable[str] | AsyncIterator[str], path: str) -> AsyncIterator[bytes]:
    """The SSE events as body chunks; an error after the headers went out ends the stream with
    SGLang's error event and ``[DONE]``."""
    try:
        if isinstance(events, AsyncIterator):
            async for event in events:
                yield event.encode()
        else:
            for event in events:
                yield event.encode()
    except Exception as exc:
        log.exception("tinylm: streaming %s failed", path)
        error = json.dumps(error_body(f"internal error: {exc!r}", 500))
        yield f"data: {error}\n\ndata: [DONE]\n\n".encode()


def start_server(
    model_dir: str | Path, *, host: str = "127.0.0.1", port: int = 0, **options: Any
) -> TinyLMServer:
    """Load ``model_dir`` and serve it from a background thread (for tests and demos).

    ``options`` are further ``ServerConfig`` fields. Use as a context manager, or call
    ``close()``.
    """
    config = ServerConfig(model_dir=Path(model_dir), host=host, port=port, **options)
    return TinyLMServer(config).start()


def serve(config: ServerConfig, *, out: Callable[[str], None] = print) -> int:
    """Serve until SIGINT/SIGTERM; prints the ready line (with the bound port) first."""
    server = TinyLMServer(config).start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("tinylm: signal %d, shutting down", signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    out(
        f"{READY_PREFIX}{server.url} (model {config.model_dir}, "
        f"{config.max_running_requests} slots, logprobs {config.logprob_mode})"
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
