"""``rollout tinylm serve``: an SGLang-compatible HTTP server for a tinylm model, on CPU.

Routes (JSON over HTTP/1.1 with keep-alive; Starlette on uvicorn, as SGLang's FastAPI app,
with the plumbing in ``asgi.py``):

- ``POST /generate``: SGLang's native endpoint. ``input_ids`` or ``text`` (a list of either is a
  batch and returns a list), ``sampling_params`` (see ``sampling.py``), ``rid``,
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``.
  The reply is ``{"text", "output_ids", "meta_info"}`` as SGLang writes it (``scheduler.py``).
  As in SGLang 0.5.23 (``managers/io_struct.py``, ``GenerateReqInput``): a batch given one
  string ``rid`` names its requests ``{rid}_{i}`` (``_normalize_rid``), and
  ``sampling_params.n > 1`` turns even a single prompt into a batch (``_handle_parallel_sampling``)
  whose reply is a list of ``batch * n`` results, the ``n`` samples of each prompt together
  (``TokenizerManager._handle_batch_request``). SGLang gives each parallel sample a fresh uuid;
  here they are ``{rid}_{i}`` too, so ``/abort_request`` with ``rid`` still reaches them.
- ``POST /v1/chat/completions``: OpenAI chat (``chat.py``), tool calls and ``stream`` included.
- ``POST /abort_request``: ``{"rid": ...}`` aborts every request whose rid starts with it (SGLang's
  prefix match), ``{"abort_all": true}`` all of them; the aborted request's own reply is a
  normal 200 whose ``finish_reason`` has ``type: "abort"``.
- ``POST /update_weights_from_disk``, ``GET /get_weight_version``, ``POST /pause_generation``,
  ``POST /continue_generation``, ``GET|POST /flush_cache``: SGLang's weight-sync routes
  (``weights.py``, which says what happens to requests in flight during an update). Every
  ``/generate`` ``meta_info`` and ``/get_model_info`` carry ``weight_version`` (``default``
  until an update names one, as SGLang's ``--weight-version``).
- ``GET /health``, ``/health_generate``, ``/get_model_info``, ``/get_server_info``, ``/v1/models``,
  ``/v1/models/{id}``.

Access: the server binds ``127.0.0.1`` unless ``host`` says otherwise. ``api_key`` and
``admin_api_key`` work as SGLang's ``--api-key`` / ``--admin-api-key`` (``auth.py``): with an
admin key, only its holder may call the admin routes (``/abort_request`` and the weight,
pause and cache routes); a request without the right ``Authorization: Bearer`` key gets 401.

Errors are JSON ``{"object": "error", "message", "type", "code"}`` with status 400 (bad request:
the message names the field), 401, 404, 405 (a known route, another method), 500 or 503
(shutting down). A request whose client disconnects is aborted. ``close()`` aborts everything
in flight, lets those replies go out, then closes every connection.

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
    follow_tokens,
    json_response,
    listen,
    wait_outputs,
)
from tinylm.auth import allowed
from tinylm.chat import ChatError, Follow, chat_completion
from tinylm.errors import ConfigError
from tinylm.runtime import TinyLMRuntime
from tinylm.sampling import LogprobMode, SamplingParams, logprob_mode_from_env
from tinylm.scheduler import (
    GenerateOutput,
    GenerateRequest,
    GenerationScheduler,
    Pending,
    SchedulerClosed,
)
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
    weight_version: str = "default"

    @property
    def mode(self) -> LogprobMode:
        """``logprob_mode`` as resolved (never None after construction)."""
        assert self.logprob_mode is not None
        return self.logprob_mode

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
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


class BadRequest(ValueError):
    """A client error; the message is sent back with the status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _field(body: dict[str, Any], key: str, index: int, batch: int | None, default: Any) -> Any:
    """``body[key]`` for item ``index``: per-item when a batch gave a list, else shared."""
    value = body.get(key, default)
    if batch is not None and isinstance(value, list):
        if len(value) != batch:
            raise BadRequest(f"{key} has {len(value)} entries for a batch of {batch}")
        return value[index]
    return value


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
            Route("/get_model_info", _endpoint(self._get_model_info), methods=get),
            Route("/get_server_info", _endpoint(self._get_server_info), methods=get),
            Route("/v1/models", _endpoint(self._models), methods=get),
            Route("/v1/models/{model_id:path}", _endpoint(self._model), methods=get),
            Route("/update_weights_from_disk", _endpoint(self._update), methods=post),
            Route("/get_weight_version", _endpoint(self._weight_version), methods=get),
            Route("/pause_generation", _endpoint(self._pause), methods=post),
            Route("/continue_generation", _endpoint(self._continue), methods=post),
            Route("/flush_cache", _endpoint(self._flush), methods=["GET", "POST"]),
        ]

    # -- info routes ---------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return json_response(None)

    async def _get_model_info(self, request: Request) -> Response:
        return json_response(self._model_info())

    async def _get_server_info(self, request: Request) -> Response:
        return json_response(
            {
                **self._model_info(),
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
            "weight_version": self.scheduler.weight_version,
            "max_context_length": self.scheduler.max_context,
            "max_running_requests": self.config.max_running_requests,
            "logprob_mode": str(self.config.logprob_mode),
        }

    # -- admin routes (``weights.py`` says what they do and where SGLang does it) --------------

    async def _abort(self, request: Request) -> Response:
        body = _object(await _json(request))
        if body.get("abort_all") is True:
            self.scheduler.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            self.scheduler.abort(body["rid"])
        else:
            raise BadRequest("abort_request needs a string 'rid' or 'abort_all': true")
        return json_response(None)

    async def _update(self, request: Request) -> Response:
        update = _weights_call(UpdateFromDisk.from_json, _object(await _json(request)))
        ok, message = await self._admin(self.weights.update_from_disk, update)
        reply = {"success": ok, "message": message, "num_paused_requests": 0}
        return json_response(reply, 200 if ok else 400)

    async def _weight_version(self, request: Request) -> Response:
        return json_response({"weight_version": self.scheduler.weight_version})

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
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by tinylm")
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise BadRequest("give exactly one of 'input_ids' and 'text'")
        prompts: list[list[int]]
        if has_ids:
            ids = body["input_ids"]
            batch = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
            prompts = ids if batch else [ids]
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p
                ):
                    raise BadRequest(f"input_ids{f'[{i}]' if batch else ''} must be a list of ints")
        else:
            text = body["text"]
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings")
            prompts = [self.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
        n = _parallel_samples(body.get("sampling_params"))
        size = len(prompts) if batch else None
        requests = [self._request(body, i, size, p) for i, p in enumerate(prompts)]
        if n > 1:
            requests = self._expand(requests, n, body.get("rid"))
        outputs = await self._run(requests, request.receive)
        replies = [o.to_json() for o in outputs]
        return json_response(replies if batch or n > 1 else replies[0])

    def _expand(self, requests: list[GenerateRequest], n: int, rid: Any) -> list[GenerateRequest]:
        """``n`` samples of each request, prompt-major, named ``{rid}_{j}`` (module docstring)."""
        out: list[GenerateRequest] = []
        for req in requests:
            for _ in range(n):
                j = len(out)
                if isinstance(rid, list):
                    name = f"{req.rid}_{j % n}"
                elif isinstance(rid, str):
                    name = f"{rid}_{j}"
                else:
                    name = self.scheduler.new_rid()
                out.append(dataclasses.replace(req, rid=name))
        return out

    def _request(
        self, body: dict[str, Any], i: int, batch: int | None, ids: list[int]
    ) -> GenerateRequest:
        where = (
            f"sampling_params[{i}]"
            if batch is not None and isinstance(body.get("sampling_params"), list)
            else "sampling_params"
        )
        raw_sampling = _field(body, "sampling_params", i, batch, None)
        if isinstance(raw_sampling, dict) and "n" in raw_sampling:
            raw_sampling = {k: v for k, v in raw_sampling.items() if k != "n"}  # see _expand
        try:
            sampling = SamplingParams.from_json(raw_sampling, where=where)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid = _field(body, "rid", i, batch, None)
        if rid is None:
            rid = self.scheduler.new_rid()
        elif not isinstance(rid, str) or not rid:
            raise BadRequest(f"rid must be a non-empty string, got {rid!r}")
        elif batch is not None and not isinstance(body.get("rid"), list):
            rid = f"{rid}_{i}"  # SGLang's GenerateReqInput._normalize_rid
        return_logprob = _field(body, "return_logprob", i, batch, False)
        start = _field(body, "logprob_start_len", i, batch, -1)
        top_k = _field(body, "top_logprobs_num", i, batch, 0)
        text_in = body.get("return_text_in_logprobs", False)
        for key, value, kind in (
            ("return_logprob", return_logprob, bool),
            ("return_text_in_logprobs", text_in, bool),
            ("logprob_start_len", start, int),
            ("top_logprobs_num", top_k, int),
        ):
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise BadRequest(f"{key} must be {kind.__name__}, got {value!r}")
        if start < -1 or top_k < 0:
            raise BadRequest(
                f"logprob_start_len must be >= -1 and top_logprobs_num >= 0, "
                f"got {start} and {top_k}"
            )
        if start == -1:
            # SGLang's default: logprobs for the output tokens (and the last prompt token).
            start = len(ids) - 1
        return GenerateRequest(
            rid=rid,
            input_ids=tuple(ids),
            sampling=sampling,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_k,
            return_text_in_logprobs=text_in,
        )

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
        return await wait_outputs(
            pendings, receive, lambda: self._abort_all(pendings, "client disconnected")
        )

    async def _follow(self, req: GenerateRequest) -> Follow:
        """Submit a ``stream`` request now (so a bad one is refused before any reply is sent);
        the returned iterator yields its tokens as they are drawn, then the output."""
        pending = await self._submit(req)
        return follow_tokens(
            pending, lambda: self.scheduler.abort(pending.rid, message="client disconnected")
        )

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

    def _abort_all(self, pendings: Sequence[Pending], message: str = "batch refused") -> None:
        for p in pendings:
            self.scheduler.abort(p.rid, message=message)

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


def _parallel_samples(raw: Any) -> int:
    """``sampling_params.n`` (the same in every item of a list, as SGLang requires)."""
    items = raw if isinstance(raw, list) else [raw]
    values = {item.get("n", 1) if isinstance(item, dict) else 1 for item in items}
    if len(values) > 1:
        raise BadRequest(
            "sampling_params.n must be the same for every item of a batch, got "
            f"{sorted(map(repr, values))}"
        )
    n = values.pop() if values else 1
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"sampling_params.n must be an integer >= 1, got {n!r}")
    return n


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
