"""The HTTP plumbing of the tiny model server: Starlette on uvicorn, as SGLang serves.

SGLang 0.5.23 serves its routes with FastAPI (Starlette underneath) on uvicorn
(``srt/entrypoints/http_server.py``, ``launch_server``); the recording proxy
(``engine.proxy``) uses the same stack, so the project has one HTTP server implementation.
What this module adds around it:

- ``listen``: the listening socket, made here so its port is known before serving starts (port
  0 picks a free one) and made with ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` on accepted
  connections only for sockets whose protocol says TCP, and with Nagle on every small reply
  waits ~40 ms for the client's delayed ACK. The backlog is ``SOMAXCONN``: a rollout opens a
  connection per episode, dozens at once.
- ``UvicornThread``: uvicorn in a thread of its own with its own event loop, with no access
  log, no logging configuration and no signal handlers (the owner of the process has those).
- ``wait_outputs`` / ``follow_all`` / ``follow_tokens``: how a request handler on the event loop
  waits for the scheduler thread's ``Pending`` replies (or follows a stream's tokens) without
  blocking the loop, aborting them when the client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.responses import Response
from starlette.types import ASGIApp, Receive

from tinylm.scheduler import GenerateOutput, Pending, TokenEvent

__all__ = [
    "Progress",
    "UvicornThread",
    "error_body",
    "follow_all",
    "follow_tokens",
    "json_response",
    "listen",
    "wait_outputs",
]

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    503: "ServiceUnavailable",
}


def error_body(message: str, status: int) -> dict[str, Any]:
    """SGLang's error object (``ErrorResponse`` in ``entrypoints/openai/protocol.py``)."""
    return {
        "object": "error",
        "message": message,
        "type": _ERROR_TYPES.get(status, "InternalServerError"),
        "param": None,
        "code": status,
    }


def json_response(body: Any, status: int = 200) -> Response:
    """A JSON reply (``None``: an empty body without a content type, as SGLang's ``/health``)."""
    if body is None:
        return Response(status_code=status)
    return Response(
        json.dumps(body, separators=(",", ":")).encode(),
        status_code=status,
        media_type="application/json",
    )


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (see the module docstring for why it is made here)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ready: threading.Event) -> None:
        super().__init__(config)
        self.ready = ready
        self.loop: asyncio.AbstractEventLoop | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process owner handles SIGINT / SIGTERM (``serve``)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        self.ready.set()


class UvicornThread:
    """``app`` served by uvicorn on ``sock`` from a daemon thread."""

    def __init__(self, app: ASGIApp, sock: socket.socket, *, keepalive_timeout_s: float) -> None:
        config = uvicorn.Config(
            app,
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,  # clients connect directly; no forwarded-for rewriting
            access_log=False,  # a log line per request costs more than a tiny model's step
            log_config=None,  # leave the process's logging as its owner set it up
            timeout_keep_alive=int(max(1, keepalive_timeout_s)),
            backlog=socket.SOMAXCONN,
        )
        self._ready = threading.Event()
        self._server = _Server(config, self._ready)
        self._sock = sock
        self._thread = threading.Thread(
            target=self._run, name=f"tinylm-http-{sock.getsockname()[1]}", daemon=True
        )
        self._failure: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        except BaseException as exc:  # reported by start() or logged by the owner
            self._failure = exc
        finally:
            self._ready.set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._server.loop

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        self._ready.wait(timeout)
        if self._failure is not None or not self._server.started:
            raise RuntimeError(
                f"the tinylm HTTP server did not start: {self._failure!r}"
            ) from self._failure

    def stop(self, timeout: float) -> None:
        """Stop accepting, close idle keep-alive connections, let running replies finish."""
        self._server.config.timeout_graceful_shutdown = max(1, int(timeout))
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout + 1)
        self._sock.close()

    def connections(self) -> list[Any]:
        """uvicorn's open connections (their protocols), for inspection in tests."""
        return list(self._server.server_state.connections)


def _notifier(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run on ``loop`` when called from any thread (nothing once the loop is closed)."""

    def notify() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(fn)

    return notify


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request body must already be read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def wait_outputs(
    pendings: Sequence[Pending], receive: Receive, on_gone: Callable[[], None]
) -> list[GenerateOutput]:
    """The replies of ``pendings``; ``on_gone`` (abort them) if the client disconnects first."""
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    left = len(pendings)

    def one_done() -> None:
        nonlocal left
        left -= 1
        if left == 0 and not finished.done():
            finished.set_result(None)

    for pending in pendings:
        pending.on_done(_notifier(loop, one_done))
    if not pendings:
        return []

    # One watcher task per request: a client gone first aborts the requests, whose replies
    # then resolve ``finished`` at the scheduler's next step.
    def watch(task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        task.exception()  # retrieved: a receive that failed counts as a client gone
        if not finished.done():
            on_gone()

    gone = loop.create_task(_disconnected(receive))
    gone.add_done_callback(watch)
    try:
        await finished
    finally:
        gone.cancel()
    return [p.wait() for p in pendings]


@dataclass(frozen=True, slots=True)
class Progress:
    """News of request ``index`` of a ``follow_all``: tokens drawn since the last news, or its
    end (``output``, or ``error`` when the scheduler failed it)."""

    index: int
    tokens: list[TokenEvent]
    output: GenerateOutput | None = None
    error: str | None = None


async def follow_all(
    pendings: Sequence[Pending], on_gone: Callable[[list[Pending]], None]
) -> AsyncIterator[Progress]:
    """The tokens of ``stream`` requests as they are drawn, then each one's end, interleaved
    as they come. Closed before the end (the client left: the response's disconnect listener
    cancels the stream), the requests not finished yet go to ``on_gone`` (to abort them)."""
    loop = asyncio.get_running_loop()
    news = asyncio.Event()
    for pending in pendings:
        pending.watch(_notifier(loop, news.set))
    seen = [0] * len(pendings)
    running = set(range(len(pendings)))
    try:
        while running:
            news.clear()  # before reading: a token published after the read sets it again
            quiet = True
            for i in sorted(running):
                events, done = pendings[i].progress(seen[i], 0)
                seen[i] += len(events)
                if done:
                    quiet = False
                    running.discard(i)
                    try:
                        yield Progress(i, events, output=pendings[i].wait())
                    except RuntimeError as exc:
                        yield Progress(i, events, error=str(exc))
                elif events:
                    quiet = False
                    yield Progress(i, events)
            if quiet and running:
                await news.wait()
    finally:
        if running:
            on_gone([pendings[i] for i in sorted(running)])


async def follow_tokens(
    pending: Pending, on_gone: Callable[[], None]
) -> AsyncIterator[tuple[list[TokenEvent], GenerateOutput | None]]:
    """``follow_all`` for one request, as ``(tokens, output)``; a failed request raises."""
    async for news in follow_all([pending], lambda _: on_gone()):
        if news.error is not None:
            raise RuntimeError(f"request {pending.rid} failed: {news.error}")
        yield news.tokens, news.output
