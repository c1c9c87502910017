"""The viewer's HTTP app (Starlette, the engine's HTTP stack) and its server.

Routes, all ``GET``, all read-only:

* ``/``: the rollouts; ``/r/{rollout}``: one rollout (``?lanes=worker``, search fields
  ``q``, ``dataset``, ``term``, ``reward_min``, ``reward_max``); ``/r/{rollout}/s/{sample}``:
  one sample; ``/compare?a=R/S&b=R/S``: two samples side by side, ``?a=R/S&across=1``: the
  same prompt in every rollout; ``/pool?at=ID``: the pool as ``rollout pool --at`` shows it;
  ``/find?sample=ID``: the rollout that holds a sample;
* ``/api/stamp?r=ROLLOUT``: what the page script polls; a new stamp makes it fetch the page
  again and swap its ``<main>``, so pages follow a running rollout without a reload;
* ``/static/view.css``, ``/static/view.js``.

Every response forbids inline script and style (Content-Security-Policy), a second wall
behind the escaping of every trajectory text.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable, Sequence
from html import escape
from importlib import resources
from urllib.parse import quote, urlencode

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from engine.events.log_base import gc_paused
from engine.ops.view import pages, svg
from engine.ops.view.data import RolloutData, ViewData
from engine.projections.placement import render_pool
from engine.runtime.readback import read_tasks
from engine.runtime.rebuild import pool_at

__all__ = ["create_app", "serve"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_STREAM_ID = re.compile(r"\d+(-\d+)?")
_STATIC = {"view.css": "text/css", "view.js": "text/javascript"}


def _html(text: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(text, status, headers={
        "content-security-policy": CSP, "x-content-type-options": "nosniff",
        "cache-control": "no-store",
    })


def _missing(what: str) -> HTMLResponse:
    return _html(pages.layout("not found", f"<h1>{escape(what)}</h1>"), 404)


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(p, safe=":") for p in parts)


class _Handlers:
    """The routes' handlers on one :class:`ViewData`."""

    def __init__(self, data: ViewData) -> None:
        self.data = data

    async def index(self, request: Request) -> Response:
        data = self.data
        shown = [d for d in [await data.rollout(r) for r in await data.rollout_ids()] if d]
        return _html(pages.layout("rollouts", pages.list_page(shown), live="/api/stamp",
                                  stamp=await data.stamp(None)))

    async def rollout(self, request: Request) -> Response:
        data, rid = self.data, request.path_params["rollout"]
        d = await data.rollout(rid)
        if d is None:
            return _missing(f"no rollout {rid}")
        q = dict(request.query_params)
        lanes = "worker" if q.get("lanes") == "worker" else "node"
        t0, t1 = d.first_ms or 0, d.last_ms or 0
        series = data.pool_series(rid)
        with gc_paused():
            body = pages.rollout_page(
                d,
                timeline_svg=svg.timeline(d, data.open_bands(), lanes=lanes,
                                          servers=data.servers),
                pool_svg=svg.step_chart(series, t0, max([t1, *(ms for ms, _ in series)])),
                pool_events=data.pool_events(rid),
                query=q,
                histograms=_histograms(d),
            )
        return _html(pages.layout(f"rollout {rid}", body, live=_stamp_url(rid),
                                  stamp=await data.stamp(rid)))

    async def _sample_html(self, rid: str, sid: str) -> str | None:
        d = await self.data.rollout(rid)
        r = None if d is None else d.state.samples.get(sid)
        if d is None or r is None:
            return None
        rb, attempts = await self.data.sample(d, sid)
        return pages.sample_page(d, r, rb, attempts, self.data.pieces)

    async def sample(self, request: Request) -> Response:
        rid, sid = request.path_params["rollout"], request.path_params["sample"]
        body = await self._sample_html(rid, sid)
        if body is None:
            return _missing(f"no sample {sid} in rollout {rid}")
        return _html(pages.layout(f"sample {sid}", body, live=_stamp_url(rid),
                                  stamp=await self.data.stamp(rid)))

    async def compare(self, request: Request) -> Response:
        refs = [request.query_params.get(k, "") for k in ("a", "b")]
        if request.query_params.get("across"):
            refs = await _same_prompt(self.data, refs[0])
        columns = []
        for ref in filter(None, refs):
            rid, _, sid = ref.partition("/")
            body = await self._sample_html(rid, sid)
            columns.append(body or f"<p>no sample {escape(ref)}</p>")
        return _html(pages.layout("compare", pages.compare_page(columns, "compare")))

    async def pool(self, request: Request) -> Response:
        at = request.query_params.get("at") or None
        if at is not None and not _STREAM_ID.fullmatch(at):
            return _html(pages.layout("pool", f"<h1>{escape(at)} is not a stream id: expected "
                                      "&lt;ms&gt;-&lt;seq&gt;</h1>"), 400)
        folded = await pool_at(self.data.log, until=at)
        body = (
            '<h1>Pool</h1><form method="get"><input name="at" placeholder="rl:pool event id" '
            f'value="{escape(at or "")}"><button>show</button></form>'
            f'<pre class="pool-table">{escape(render_pool(folded))}</pre>'
        )
        return _html(pages.layout("pool", body))

    async def find(self, request: Request) -> Response:
        sid = request.query_params.get("sample", "")
        for rid in reversed(await self.data.rollout_ids()):
            d = await self.data.rollout(rid)
            if d is not None and sid in d.state.samples:
                return RedirectResponse(_path("r", rid, "s", sid), 303)
        return _missing(f"no rollout holds sample {sid}")

    async def stamp(self, request: Request) -> Response:
        stamp = await self.data.stamp(request.query_params.get("r"))
        return JSONResponse({"stamp": stamp}, headers={"cache-control": "no-store"})

    async def static(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in _STATIC:
            return Response(status_code=404)
        text = resources.files("engine.ops.view").joinpath("static", name).read_text()
        return Response(text, media_type=_STATIC[name],
                        headers={"x-content-type-options": "nosniff"})


def _stamp_url(rollout_id: str) -> str:
    return "/api/stamp?" + urlencode({"r": rollout_id})


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


def create_app(data: ViewData, *, allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The viewer on ``data`` (see the module docstring). ``allowed_hosts``: the ``Host``
    names it answers (others get 400: a page elsewhere that rebinds its name to loopback
    cannot read the viewer); None answers any."""
    h = _Handlers(data)
    middleware = [] if allowed_hosts is None else [
        Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    ]
    return Starlette(middleware=middleware, routes=[
        Route("/", h.index), Route("/r/{rollout}", h.rollout),
        Route("/r/{rollout}/s/{sample}", h.sample), Route("/compare", h.compare),
        Route("/pool", h.pool), Route("/find", h.find), Route("/api/stamp", h.stamp),
        Route("/static/{name}", h.static),
    ])


def _histograms(d: RolloutData) -> str:
    by_dataset: dict[str, list[tuple[float, int]]] = {}
    for r in d.state.samples.values():
        if r.completed:
            by_dataset.setdefault(r.dataset, []).append((r.reward, r.response_length))
    return "".join(
        f'<div class="dataset"><h3>{escape(name)}</h3>'
        + svg.histogram([v[0] for v in values], label="reward")
        + svg.histogram([float(v[1]) for v in values], label="response tokens")
        + "</div>"
        for name, values in sorted(by_dataset.items())
    ) or '<p class="none">no completed samples yet</p>'


async def _same_prompt(data: ViewData, ref: str) -> list[str]:
    """``ref`` (``rollout/sample``) and, in every other rollout, the samples whose task has
    the same prompt, oldest rollout first."""
    rid, _, sid = ref.partition("/")
    d = await data.rollout(rid)
    if d is None or sid not in d.state.samples:
        return [ref]
    prompt = (await read_tasks(data.log, d.stream, d.state, [sid]))[sid].prompt
    out = []
    for other in await data.rollout_ids():
        o = await data.rollout(other)
        if o is None:
            continue
        if other == rid:
            out.append(ref)
            continue
        dataset = d.state.samples[sid].dataset
        ids = [s for s, r in o.state.samples.items() if r.dataset == dataset]
        tasks = await read_tasks(data.log, o.stream, o.state, ids)
        out.extend(f"{other}/{s}" for s in ids if tasks[s].prompt == prompt)
    return out


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield  # Ctrl-C ends the command through asyncio.run


async def serve(data: ViewData, *, host: str = "127.0.0.1", port: int = 8765,
                ready: Callable[[str], None] | None = None) -> None:
    """Serve the viewer until cancelled; ``ready`` gets its URL once it listens. On a
    loopback address it answers only loopback ``Host`` names."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    loopback = host in LOOPBACK_NAMES
    app = create_app(data, allowed_hosts=LOOPBACK_NAMES if loopback else None)
    server = _Server(uvicorn.Config(
        app, log_config=None, log_level="warning", access_log=False,
        lifespan="off", http="h11", timeout_graceful_shutdown=1,
    ))
    bound = sock.getsockname()[1]
    if ready is not None:
        ready(f"http://{host if ':' not in host else f'[{host}]'}:{bound}/")
    await server.serve(sockets=[sock])

