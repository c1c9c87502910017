"""The viewer's pages as HTML text. Everything that comes from the log -- prompts, responses,
tool calls, errors, ids, dataset names -- goes through :func:`html.escape`; nothing is ever
put in an attribute unquoted or in a script. The pages carry no inline script or style (the
server's Content-Security-Policy refuses both): one stylesheet and one script under
``/static``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

from engine.events.base import Envelope
from engine.events.catalog import (
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    SampleVerified,
    TeacherScored,
    TurnCompleted,
)
from engine.events.ids import id_ms
from engine.ops.inspection import status_lines
from engine.ops.view.data import RolloutData
from engine.projections.readback import Rollout
from engine.projections.rollout import SampleRecord
from engine.projections.summary import build_summary

__all__ = [
    "compare_page",
    "layout",
    "list_page",
    "rollout_page",
    "sample_body",
    "sample_page",
    "trajectory",
]


def layout(title: str, body: str, *, live: str | None = None, stamp: str = "") -> str:
    """A whole page; ``live``: the stamp URL the script polls to refresh ``<main>``."""
    live_attrs = (
        f' data-live="{escape(live)}" data-stamp="{escape(stamp)}"' if live is not None else ""
    )
    return (
        "<!doctype html><html><head><meta charset=\"utf-8\">"
        f"<title>{escape(title)}</title>"
        '<link rel="stylesheet" href="/static/view.css">'
        '<script src="/static/view.js" defer></script></head><body>'
        '<nav><a href="/">rollouts</a> <a href="/pool">pool</a>'
        '<form action="/find" method="get"><input name="sample" placeholder="sample id">'
        "<button>find</button></form></nav>"
        f"<main{live_attrs}>{body}</main></body></html>"
    )


def _href(*parts: str, **query: Any) -> str:
    path = "/" + "/".join(quote(p, safe="") for p in parts)
    q = {k: v for k, v in query.items() if v not in (None, "")}
    return escape(path + ("?" + urlencode(q) if q else ""))


def _verdict(data: RolloutData) -> str:
    state = data.state
    if state.ready is not None:
        return "READY" + (" (dummy)" if state.ready.dummy else "")
    if state.failed is not None:
        return "FAILED"
    if data.stalled is not None:
        return "STALLED"
    return "planning" if state.planned is None else "running"


def _mean(values: Sequence[float]) -> str:
    return f"{math.fsum(values) / len(values):.4g}" if values else "-"


def list_page(rollouts: Sequence[RolloutData]) -> str:
    """The rollouts, newest first: status, kind, iteration, version, progress, reward."""
    rows = []
    for data in reversed(rollouts):
        state, request = data.state, data.state.request
        done = [r for r in state.samples.values() if r.done]
        rewards = [r.reward for r in done if r.completed]
        planned = state.planned.n_samples if state.planned is not None else "?"
        rows.append(
            f'<tr data-rollout="{escape(data.rollout_id)}">'
            f'<td><a href="{_href("r", data.rollout_id)}">{escape(data.rollout_id)}</a></td>'
            f'<td class="status">{_verdict(data)}</td>'
            f"<td>{escape(request.kind.value) if request else '?'}</td>"
            f"<td>{request.iteration if request else '?'}</td>"
            f"<td>{request.policy_version if request else '?'}</td>"
            f'<td class="n" data-k="planned">{planned}</td>'
            f'<td class="n" data-k="completed">{sum(1 for r in done if r.completed)}</td>'
            f'<td class="n" data-k="aborted">{sum(1 for r in done if r.aborted)}</td>'
            f'<td class="n" data-k="reward">{_mean(rewards)}</td></tr>'
        )
    head = "".join(
        f"<th>{h}</th>"
        for h in ("rollout", "status", "kind", "iteration", "policy version", "planned",
                  "completed", "aborted", "mean reward")
    )
    return (
        f"<h1>Rollouts ({len(rollouts)})</h1>"
        f'<table class="rollouts"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
        "</tbody></table>"
    )


def _figures(summary: Mapping[str, Any]) -> str:
    """The summary's numbers, each in an element the tests read by ``data-k``."""
    cells = [("n_samples", summary["n_samples"]), ("kept", summary["kept"]),
             ("dropped", summary["dropped"])]
    cells += [(f"counts.{k}", v) for k, v in summary["counts"].items()]
    out = ['<dl class="figures">']
    for key, value in cells:
        out.append(f'<div><dt>{escape(key)}</dt><dd data-k="{escape(key)}">'
                   f"{'-' if value is None else escape(str(value))}</dd></div>")
    out.append("</dl>")
    rows = []
    for name, ds in summary["datasets"].items():
        metrics = " ".join(
            f'<span data-k="{escape(name)}.{escape(k)}">{escape(k)}={v:.6g}</span>'
            for k, v in ds["metrics"].items()
        )
        rows.append(f"<tr><td>{escape(name)}</td><td class=n data-k=\"{escape(name)}.n\">"
                    f"{ds['n']}</td><td>{metrics}</td></tr>")
    out.append("<table><thead><tr><th>dataset</th><th>n</th><th>metrics</th></tr></thead>"
               f"<tbody>{''.join(rows)}</tbody></table>")
    for section in ("staleness", "partial", "verify"):
        if section in summary:
            out.append(f"<h3>{section}</h3><pre data-k=\"{section}\">"
                       f"{escape(json.dumps(summary[section], indent=1, sort_keys=True))}</pre>")
    return "".join(out)


def _versions(records: Iterable[SampleRecord]) -> str:
    totals: dict[int, int] = {}
    for r in records:
        for version, n in r.versions:
            totals[version] = totals.get(version, 0) + n
    if not totals:
        return '<p class="none">no sampled tokens yet</p>'
    return "<p>sampled tokens per weight version: " + ", ".join(
        f"v{v}: {n}" for v, n in sorted(totals.items())
    ) + "</p>"


def _matches(r: SampleRecord, query: Mapping[str, str]) -> bool:
    q = query.get("q", "")
    if q and q not in r.sample_id:
        return False
    if query.get("dataset") and r.dataset != query["dataset"]:
        return False
    if query.get("term") and query["term"] not in (
        r.failure_class.value, r.reason.value if r.reason else "", r.status.value
    ):
        return False
    for key, keep in (("reward_min", r.reward.__ge__), ("reward_max", r.reward.__le__)):
        if query.get(key):
            try:
                if not keep(float(query[key])):
                    return False
            except ValueError:
                return False
    return True


def _search(data: RolloutData, query: Mapping[str, str], limit: int = 200) -> str:
    found = [r for r in data.state.ordered() if _matches(r, query)]
    form = (
        f'<form class="search" method="get" action="{_href("r", data.rollout_id)}">'
        + "".join(
            f'<input name="{k}" placeholder="{p}" value="{escape(query.get(k, ""))}">'
            for k, p in (("q", "sample id"), ("dataset", "dataset"),
                         ("term", "termination / class"), ("reward_min", "reward >="),
                         ("reward_max", "reward <="))
        )
        + "<button>search</button></form>"
    )
    rows = "".join(
        f'<tr><td><a href="{_href("r", data.rollout_id, "s", r.sample_id)}">'
        f"{escape(r.sample_id)}</a></td><td>{escape(r.dataset)}</td><td>{r.group_index}</td>"
        f"<td>{escape(r.status.value)}</td><td>{escape(r.failure_class.value)}</td>"
        f"<td class=n>{r.reward:g}</td><td class=n>{r.attempt}</td><td class=n>{r.turns}</td>"
        f"<td class=n>{r.response_length}</td><td>{escape(r.node)}</td></tr>"
        for r in found[:limit]
    )
    more = f"<p>{len(found) - limit} more not shown</p>" if len(found) > limit else ""
    return (
        f'{form}<p data-k="found">{len(found)}</p><table class="samples"><thead><tr>'
        "<th>sample</th><th>dataset</th><th>group</th><th>status</th><th>class</th>"
        "<th>reward</th><th>attempt</th><th>turns</th><th>length</th><th>node</th></tr>"
        f"</thead><tbody>{rows}</tbody></table>{more}"
    )


def rollout_page(
    data: RolloutData,
    *,
    timeline_svg: str,
    pool_svg: str,
    pool_events: Sequence[str],
    query: Mapping[str, str],
    histograms: str,
) -> str:
    """A rollout: status and stall diagnostics, figures, timeline, pool, distributions,
    staleness, verification, sample search."""
    state = data.state
    summary = build_summary(Rollout(state, {}))
    lanes = query.get("lanes", "node")
    other = "worker" if lanes == "node" else "node"
    pool_links = " ".join(
        f'<a href="{_href("pool", at=at)}">{escape(at)}</a>' for at in pool_events[-40:]
    )
    return (
        f'<h1>Rollout <span data-k="rollout_id">{escape(data.rollout_id)}</span> '
        f'<span class="status">{_verdict(data)}</span></h1>'
        f'<pre class="status-lines">{escape(chr(10).join(status_lines(state, data.stalled)))}'
        "</pre>"
        f"{_figures(summary)}"
        f'<h2>Timeline (lanes per {lanes}; <a href="{_href("r", data.rollout_id, lanes=other)}">'
        f"per {other}</a>)</h2>"
        '<p class="legend"><span class="ok">completed</span> <span class="ab">aborted</span> '
        '<span class="retry">retried attempt</span> <span class="run">running</span> '
        '<span class="band-quiesce">quiesce</span> <span class="band-version">version '
        'activated</span> server: <span class="server-up">up</span> <span class="server-down">'
        'down</span> <span class="server-stale">stale</span></p>'
        f'<div class="scroll">{timeline_svg}</div>'
        f"<h2>Pool occupancy</h2>{pool_svg}"
        f'<p class="pool-at">pool at an event: {pool_links or "none"}</p>'
        f"<h2>Distributions</h2>{histograms}"
        f"<h2>Staleness</h2>{_versions(state.samples.values())}"
        f"<h2>Samples</h2>{_search(data, query)}"
    )


def _json(value: Any) -> str:
    return escape(json.dumps(value, indent=1, sort_keys=True, default=str))


def _bucket(logprob: float) -> int:
    return min(9, max(0, int(math.exp(min(0.0, logprob)) * 10)))


def trajectory(
    done: SampleCompleted, teacher: TeacherScored | None, texts: Sequence[str] | None = None
) -> str:
    """The response tokens coloured by probability; observation tokens (loss mask 0) grey;
    each token's index, id, logprob, version and teacher figures in its tooltip. Each token
    shows its text (``texts``, from the tokenizer) or else its id."""
    ids = done.response_ids.tolist()
    logprobs = done.logprobs.tolist()
    mask = done.loss_mask.tolist()
    versions = done.token_versions.tolist() if len(done.token_versions) else []
    t_lp = teacher.teacher_logprobs.tolist() if teacher is not None else []
    k = teacher.top_k if teacher is not None else 0
    top_ids = teacher.topk_ids.tolist() if teacher is not None and k else []
    top_lp = teacher.topk_logprobs.tolist() if teacher is not None and k else []
    taught = done.teacher_mask.tolist() if len(done.teacher_mask) else []
    out = []
    for i, tok in enumerate(ids):
        lp = logprobs[i] if i < len(logprobs) else 0.0
        sampled = i < len(mask) and mask[i]
        tip = f"#{i} id={tok} lp={lp:.4f}"
        if versions and i < len(versions):
            tip += f" v={versions[i]}"
        if i < len(t_lp):
            tip += f" teacher={t_lp[i]:.4f}"
        if k and (i + 1) * k <= len(top_ids):
            tip += " top: " + ", ".join(
                f"{top_ids[i * k + j]}:{top_lp[i * k + j]:.3f}" for j in range(k)
            )
        cls = f"p{_bucket(lp)}" if sampled else "o"
        if taught and i < len(taught) and taught[i]:
            cls += " tm"
        label = escape(texts[i]).replace("\n", "\u21b5") if texts is not None else tok
        out.append(f'<span class="{cls}" title="{escape(tip)}">{label}</span>')
    return (
        '<p class="legend">probability: <span class="p0">low</span> <span class="p5">mid'
        '</span> <span class="p9">high</span> <span class="o">observation (loss mask 0)'
        '</span> <span class="tm">teacher token</span></p>'
        f'<div class="tokens" data-n="{len(ids)}">{" ".join(out)}</div>'
    )


def _event_row(env: Envelope) -> str:
    ev, at = env.event, env.id
    if isinstance(ev, SampleStarted):
        what = f"started on node {ev.node} by {ev.worker}, batch {ev.batch_id}"
    elif isinstance(ev, TurnCompleted):
        what = (f"turn {ev.turn}: {ev.prompt_tokens}+{ev.response_tokens} tokens, node "
                f"{ev.node}, gpu {ev.gpu}, version {ev.weight_version}, "
                f"{ev.elapsed_s:.3f} s; tool calls: {json.dumps(ev.tool_calls)}")
    elif isinstance(ev, SampleAborted):
        what = (f"ABORTED {ev.abort_class.value} in {ev.phase} after {ev.turns} turns: "
                f"{ev.error}" + (f" (agent: {ev.agent_reason.value})" if ev.agent_reason else ""))
    elif isinstance(ev, SampleCompleted):
        what = (f"completed: reward {ev.reward:g}, "
                f"{ev.termination_reason.value if ev.termination_reason else '-'}, "
                f"{len(ev.response_ids)} response tokens, {ev.elapsed_s:.3f} s")
    elif isinstance(ev, SampleVerified):
        what = (f"verified {ev.n_tokens} tokens: max |delta| {ev.max_abs_delta:.4g} at "
                f"{ev.position} (threshold {ev.threshold:g})"
                + (" EXCEEDED" if ev.exceeded else "") + (f" skipped: {ev.skipped}"
                                                          if ev.skipped else ""))
    else:
        what = ev.type
    attempt = getattr(ev, "attempt", "")
    return (f'<tr class="{ev.type}"><td>{escape(at)}</td><td class=n>{id_ms(at)}</td>'
            f"<td class=n>{attempt}</td><td>{escape(what)}</td></tr>")


Decode = Callable[[list[int]], list[str] | None]
"""Each token's text (None: no tokenizer)."""


def sample_body(
    data: RolloutData,
    r: SampleRecord,
    rollout: Rollout,
    attempts: Sequence[Envelope],
    decode: Decode | None = None,
) -> str:
    """A sample: outcome, task, every attempt's events, the trajectory."""
    task = rollout.task(r)
    terminal = rollout.terminal(r)
    teacher = rollout.teacher(r)
    head = (
        f'<h2>Sample <span data-k="sample_id">{escape(r.sample_id)}</span></h2>'
        f'<p>rollout <a href="{_href("r", data.rollout_id)}">{escape(data.rollout_id)}</a>, '
        f"dataset {escape(r.dataset)}, group {r.group_index}, index {r.index}, "
        f'status <b data-k="status">{escape(r.status.value)}</b>, class '
        f'<b data-k="class">{escape(r.failure_class.value)}</b>, reward '
        f'<b data-k="reward">{r.reward:g}</b>, termination '
        f"{escape(r.reason.value if r.reason else '-')}, attempt {r.attempt}, "
        f"versions {escape(str(list(r.versions)))}</p>"
        f'<p><a href="{_href("compare", a=f"{data.rollout_id}/{r.sample_id}", across=1)}">'
        "this prompt across rollouts</a></p>"
        f"<details><summary>task</summary><pre>{_json(task.prompt)}</pre>"
        f"<pre>label: {_json(task.label)}</pre><pre>{_json(task.metadata)}</pre></details>"
        '<h3>Attempts</h3><table class="events"><thead><tr><th>entry</th><th>ms</th>'
        "<th>attempt</th><th>what</th></tr></thead><tbody>"
        + "".join(_event_row(env) for env in attempts)
        + "</tbody></table>"
    )
    if isinstance(terminal, SampleCompleted):
        texts = decode(terminal.response_ids.tolist()) if decode is not None else None
        prompt = decode(terminal.prompt_ids.tolist()) if decode is not None else None
        if prompt is not None:
            head += f'<details><summary>prompt text</summary><pre>{escape("".join(prompt))}' \
                    "</pre></details>"
        head += (
            f"<h3>Response</h3><pre class=\"response\">{escape(terminal.response_text)}</pre>"
            f"<details><summary>reward detail and metrics</summary>"
            f"<pre>{_json(terminal.reward_detail)}</pre><pre>{_json(terminal.metrics)}</pre>"
            f"</details><h3>Tokens ({len(terminal.prompt_ids)} prompt, "
            f"{len(terminal.response_ids)} response)</h3>"
            + trajectory(terminal, teacher, texts)
        )
    elif isinstance(terminal, SampleAborted):
        head += f'<h3>Aborted</h3><pre class="error">{escape(terminal.error)}</pre>'
    return head


def sample_page(
    data: RolloutData,
    r: SampleRecord,
    rollout: Rollout,
    attempts: Sequence[Envelope],
    decode: Decode | None = None,
) -> str:
    return f'<div class="sample">{sample_body(data, r, rollout, attempts, decode)}</div>'


def compare_page(columns: Sequence[str], title: str) -> str:
    """Samples side by side, one column each."""
    cells = "".join(f'<div class="col">{c}</div>' for c in columns)
    return f"<h1>{escape(title)}</h1><div class=\"compare\">{cells}</div>"
