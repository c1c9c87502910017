"""``rollout tinylm serve``: an SGLang-compatible HTTP server for a tinylm model, on CPU.

Routes (JSON over HTTP/1.1 with keep-alive, stdlib ``ThreadingHTTPServer``):

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
the message names the field), 404, 411, 500 or 503 (shutting down). A request whose client
disconnects is aborted. ``close()`` aborts everything in flight, lets those replies go out,
then closes every connection.

Port 0 binds a free port; ``TinyLMServer.url`` (and the ready line ``serve`` prints,
``tinylm ready on http://HOST:PORT ...``) says which. Tests start a server in-process with
``start_server`` or as a subprocess with ``spawn_server`` (``process.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import select
import signal
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tinylm.auth import allowed
from tinylm.chat import ChatError, chat_completion
from tinylm.errors import ConfigError
from tinylm.runtime import TinyLMRuntime
from tinylm.sampling import LogprobMode, SamplingParams
from tinylm.scheduler import (
    GenerateOutput,
    GenerateRequest,
    GenerationScheduler,
    Pending,
    SchedulerClosed,
    TokenEvent,
)
from tinylm.weights import UpdateFromDisk, WeightControl, WeightRequestError

__all__ = ["READY_PREFIX", "ServerConfig", "TinyLMServer", "serve", "start_server"]

log = logging.getLogger(__name__)

READY_PREFIX = "tinylm ready on "
_POLL_S = 0.05


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Settings of one tinylm server."""

    model_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    max_running_requests: int = 16
    max_context: int | None = None
    logprob_mode: LogprobMode = LogprobMode.ORIGINAL
    served_model_name: str | None = None
    keepalive_timeout_s: float = 120.0
    api_key: str | None = field(default=None, repr=False)
    admin_api_key: str | None = field(default=None, repr=False)
    weight_version: str = "default"

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ConfigError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        try:
            object.__setattr__(self, "logprob_mode", LogprobMode(self.logprob_mode))
        except ValueError as exc:
            raise ConfigError(
                f"logprob_mode must be one of {[m.value for m in LogprobMode]}, "
                f"got {self.logprob_mode!r}"
            ) from exc


Follow = Iterator[tuple[list[TokenEvent], GenerateOutput | None]]


@dataclass(frozen=True)
class EventStream:
    """A ``text/event-stream`` reply: the SSE events, each written as an HTTP chunk as soon as
    it is produced (an iterator may still be generating)."""

    events: Iterable[str]


@dataclass(frozen=True)
class PlainText:
    """A ``text/plain`` reply (SGLang's ``/flush_cache`` answers text, not JSON)."""

    text: str


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
    """Model, scheduler and HTTP front end of one tinylm server."""

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
        # pipeline clients get from AutoTokenizer, and safe to share across handler threads
        # (only the transformers wrapper mutates it, when asked to pad or truncate).
        self.tokenizer = self.hf_tokenizer.backend_tokenizer
        runtime = TinyLMRuntime.load(
            root, max_slots=config.max_running_requests, max_len=config.max_context
        )
        self.scheduler = GenerationScheduler(
            runtime,
            self.tokenizer,
            eos_token_ids=_eos_ids(root, self.hf_tokenizer),
            logprob_mode=config.logprob_mode,
            weight_version=config.weight_version,
        )
        self.weights = WeightControl(self.scheduler, model_path=root)
        self.model_name = config.served_model_name or root.name
        self._httpd = _HTTPServer((config.host, config.port), self)
        self._serving: threading.Thread | None = None
        self._closed = threading.Event()
        self._active = 0
        self._active_cv = threading.Condition()

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self) -> TinyLMServer:
        """Serve in a background thread; returns self."""
        self._serving = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"tinylm-http-{self.port}",
            daemon=True,
        )
        self._serving.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Abort in-flight requests, send their replies, close every connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.weights.close()
        if self._serving is not None:
            self._httpd.shutdown()
        self.scheduler.close(timeout)
        deadline = time.monotonic() + timeout
        with self._active_cv:
            while self._active and time.monotonic() < deadline:
                self._active_cv.wait(deadline - time.monotonic())
        self._httpd.close_connections()
        self._httpd.server_close()
        if self._serving is not None:
            self._serving.join(timeout)

    def __enter__(self) -> TinyLMServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request handling (called on handler threads) ---------------------------------------

    def track(self, delta: int) -> None:
        """Count requests being handled, reply included, so ``close`` can wait for them."""
        with self._active_cv:
            self._active += delta
            self._active_cv.notify_all()

    def handle(
        self, method: str, path: str, body: Any, client_gone: Callable[[], bool]
    ) -> tuple[int, Any]:
        """Route one request; returns (status, JSON-able body or None)."""
        route = (method, path.split("?", 1)[0].rstrip("/") or "/")
        if self._closed.is_set():
            raise BadRequest("tinylm server is shutting down", 503)
        if route in (("GET", "/health"), ("GET", "/health_generate")):
            return 200, None
        if route == ("GET", "/get_model_info"):
            return 200, self._model_info()
        if route == ("GET", "/get_server_info"):
            return 200, {
                **self._model_info(),
                "running_rids": self.scheduler.running_rids(),
                "forward_steps": self.scheduler.steps,
            }
        if route == ("GET", "/v1/models"):
            return 200, {"object": "list", "data": [self._model_card()]}
        if route[0] == "GET" and route[1].startswith("/v1/models/"):
            model_id = urllib.parse.unquote(route[1][len("/v1/models/") :])
            if model_id != self.model_name:
                raise BadRequest(f"the model {model_id!r} does not exist", 404)
            return 200, self._model_card()
        if route == ("POST", "/generate"):
            return 200, self._generate(_object(body), client_gone)
        if route == ("POST", "/v1/chat/completions"):
            return 200, self._chat(_object(body), client_gone)
        if route == ("POST", "/abort_request"):
            return self._abort(_object(body))
        try:
            return self._weight_route(route, body)
        except WeightRequestError as exc:
            raise BadRequest(str(exc)) from exc
        except SchedulerClosed as exc:  # closed while an update or a pause waited
            raise BadRequest(str(exc), 503) from exc

    def _weight_route(self, route: tuple[str, str], body: Any) -> tuple[int, Any]:
        """The routes of ``weights.py`` (see its docstring for their SGLang sources)."""
        if route == ("POST", "/update_weights_from_disk"):
            ok, message = self.weights.update_from_disk(UpdateFromDisk.from_json(_object(body)))
            reply = {"success": ok, "message": message, "num_paused_requests": 0}
            return (200 if ok else 400), reply
        if route == ("GET", "/get_weight_version"):
            return 200, {"weight_version": self.scheduler.weight_version}
        if route == ("POST", "/pause_generation"):
            self.weights.pause(_object(body if body is not None else {}))
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if route == ("POST", "/continue_generation"):
            self.weights.resume()
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if route in (("GET", "/flush_cache"), ("POST", "/flush_cache")):
            ok, text = self.weights.flush()
            return (200 if ok else 400), PlainText(text)
        method, path = route
        raise BadRequest(f"no route for {method} {path}", 404)

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

    def _abort(self, body: dict[str, Any]) -> tuple[int, None]:
        if body.get("abort_all") is True:
            self.scheduler.abort(None)
        elif isinstance(body.get("rid"), str) and body["rid"]:
            self.scheduler.abort(body["rid"])
        else:
            raise BadRequest("abort_request needs a string 'rid' or 'abort_all': true")
        return 200, None

    def _generate(self, body: dict[str, Any], client_gone: Callable[[], bool]) -> Any:
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
        outputs = self._run(requests, client_gone)
        replies = [o.to_json() for o in outputs]
        return replies if batch or n > 1 else replies[0]

    def _expand(
        self, requests: list[GenerateRequest], n: int, rid: Any
    ) -> list[GenerateRequest]:
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

    def _run(
        self, requests: Sequence[GenerateRequest], client_gone: Callable[[], bool]
    ) -> list[GenerateOutput]:
        pendings: list[Pending] = []
        try:
            for req in requests:
                pendings.append(self._submit(req))
        except SchedulerClosed as exc:
            self._abort_all(pendings)
            raise BadRequest(str(exc), 503) from exc
        except ValueError as exc:
            self._abort_all(pendings)
            raise BadRequest(str(exc)) from exc
        aborted = False
        for pending in pendings:
            while not pending.wait_done(_POLL_S):
                if not aborted and client_gone():
                    aborted = True
                    self._abort_all(pendings, "client disconnected")
        return [p.wait() for p in pendings]

    def _follow(self, req: GenerateRequest, client_gone: Callable[[], bool]) -> Follow:
        """Submit a ``stream`` request now (so a bad one is refused before any reply is sent);
        the returned iterator yields its tokens as they are drawn, then the output."""
        try:
            pending = self._submit(req)
        except SchedulerClosed as exc:
            raise BadRequest(str(exc), 503) from exc
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        return self._progress(pending, client_gone)

    def _submit(self, req: GenerateRequest) -> Pending:
        """Submit ``req`` once generation is not paused and no weight update is waiting; it
        holds the model-update lock's reader side until it finishes (``weights.py``)."""
        self.weights.enter()
        try:
            pending = self.scheduler.submit(req)
        except BaseException:
            self.weights.leave()
            raise
        pending.on_done(self.weights.leave)
        return pending

    def _progress(self, pending: Pending, client_gone: Callable[[], bool]) -> Follow:
        seen, finished = 0, False
        try:
            while True:
                events, done = pending.progress(seen, _POLL_S)
                seen += len(events)
                if done:
                    finished = True
                    yield events, pending.wait()
                    return
                if events:
                    yield events, None
                elif client_gone():
                    return
        finally:
            if not finished:  # the client left, or the reply could not be written
                self.scheduler.abort(pending.rid, message="client disconnected")

    def _abort_all(self, pendings: Sequence[Pending], message: str = "batch refused") -> None:
        for p in pendings:
            self.scheduler.abort(p.rid, message=message)

    def _chat(self, body: dict[str, Any], client_gone: Callable[[], bool]) -> Any:
        try:
            reply = chat_completion(
                body,
                tokenizer=self.hf_tokenizer,
                encode=lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids,
                decode=lambda ids: self.tokenizer.decode(list(ids), skip_special_tokens=False),
                decode_text=lambda ids, skip: self.tokenizer.decode(
                    list(ids), skip_special_tokens=skip
                ),
                new_rid=self.scheduler.new_rid,
                run=lambda reqs: self._run(reqs, client_gone),
                follow=lambda req: self._follow(req, client_gone),
                model_name=self.model_name,
            )
        except ChatError as exc:
            raise BadRequest(str(exc)) from exc
        return reply.body if reply.events is None else EventStream(reply.events)


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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    wbufsize = 1 << 16  # headers and body leave in one write
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        # Bounds how long an idle keep-alive connection holds its thread.
        self.connection.settimeout(self.server.app.config.keepalive_timeout_s)
        self.server.track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, add=False)

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _dispatch(self) -> None:
        self.server.app.track(+1)
        try:
            self._respond()
        finally:
            self.server.app.track(-1)

    def _respond(self) -> None:
        try:
            body: Any = None
            if self.command == "POST":
                length = self.headers.get("Content-Length")
                if length is None:
                    raise BadRequest("a POST needs a Content-Length header", 411)
                raw = self.rfile.read(int(length))
                try:
                    body = json.loads(raw) if raw else None
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise BadRequest(f"request body is not valid JSON: {exc}") from exc
            config = self.server.app.config
            if not allowed(
                self.command,
                self.path,
                self.headers.get("Authorization"),
                api_key=config.api_key,
                admin_api_key=config.admin_api_key,
            ):
                raise BadRequest(f"{self.path} needs a valid 'Authorization: Bearer' key", 401)
            status, reply = self.server.app.handle(self.command, self.path, body, self._client_gone)
        except BadRequest as exc:
            status, reply = exc.status, _error(str(exc), exc.status)
        except Exception as exc:
            log.exception("tinylm: %s %s failed", self.command, self.path)
            status, reply = 500, _error(f"internal error: {exc!r}", 500)
        if isinstance(reply, EventStream):
            self._send_events(status, reply)
            return
        if isinstance(reply, PlainText):
            payload, kind = reply.text.encode(), "text/plain; charset=utf-8"
        else:
            payload = b"" if reply is None else json.dumps(reply).encode()
            kind = "application/json"
        try:
            self.send_response(status)
            if reply is not None:
                self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            self.wfile.flush()  # before ``close`` may count this request as answered
        except OSError:
            self.close_connection = True  # the client went away; nobody to tell

    def _send_events(self, status: int, reply: EventStream) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in reply.events:
                data = event.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True  # the client went away: stop generating for it
        except Exception as exc:  # headers are out: end the stream with SGLang's error event
            log.exception("tinylm: streaming %s failed", self.path)
            error = json.dumps(_error(f"internal error: {exc!r}", 500))
            try:
                for event in (f"data: {error}\n\n", "data: [DONE]\n\n"):
                    data = event.encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                self.close_connection = True
        finally:
            close = getattr(reply.events, "close", None)
            if close is not None:
                close()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def _error(message: str, status: int) -> dict[str, Any]:
    kinds = {
        400: "BadRequestError",
        401: "Unauthorized",
        404: "NotFoundError",
        411: "LengthRequired",
        503: "ServiceUnavailable",
    }
    return {
        "object": "error",
        "message": message,
        "type": kinds.get(status, "InternalServerError"),
        "param": None,
        "code": status,
    }


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # idle keep-alive threads must not hold up close()
    # socketserver's listen backlog is 5: a rollout opening a connection per episode (dozens
    # at once) overflowed it and the kernel reset the excess connections, which the agents
    # saw as ReadError and aborted as infra_conn.
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: tuple[str, int], app: TinyLMServer) -> None:
        self.app = app
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def track(self, conn: socket.socket, *, add: bool) -> None:
        with self._conn_lock:
            (self._connections.add if add else self._connections.discard)(conn)

    def close_connections(self) -> None:
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


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
