"""``rollout view`` over HTTP, without a browser: the figures equal ``summary.json``, the
timeline holds every sample, log text is escaped, pages follow appends, and the command binds
loopback. The browser checks are in ``test_view_browser.py``."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from html import escape
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.view import HOSTILE, synthetic_rollout
from engine.backends.sglang import load_tokenizer
from engine.events.catalog import SampleCompleted, TeacherScored
from engine.events.catalog.diagnostics import RolloutStalled
from engine.events.codec import encode
from engine.events.log_base import FIELD
from engine.events.memory_log import MemoryEventLog
from engine.ops.cli import build_parser
from engine.ops.replay import decode_entries, read_archive, replay_state
from engine.ops.view import ViewData, archive_log, create_app
from engine.ops.view.app import LOOPBACK_NAMES
from engine.ops.view.svg import Span, _rows
from engine.projections.summary import build_summary
from engine.settings import Settings

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "e64f068"


def _client(log: MemoryEventLog) -> httpx.AsyncClient:
    app = create_app(ViewData(log))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://view")


def _figures(html: str) -> dict[str, str]:
    return dict(re.findall(r'data-k="([^"]+)">([^<]*)<', html))


def write_timed(log: MemoryEventLog, events: list[tuple[str, object, int]]) -> None:
    """Store the events at ids of their times (ms), in order, as a live log would."""
    seq: dict[int, int] = {}
    for stream, ev, ms in events:
        n = seq[ms] = seq.get(ms, -1) + 1
        log.append_fields(stream, {FIELD: encode(ev)}, f"{ms}-{n}")  # type: ignore[arg-type]


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[MemoryEventLog, httpx.AsyncClient]]:
    log = MemoryEventLog()
    write_timed(log, synthetic_rollout("h1", 40, hostile=True))
    async with _client(log) as client:
        yield log, client


async def test_an_archive_shows_the_figures_of_its_summary_json_and_every_sample() -> None:
    archive = read_archive(FIXTURE / "train.rollout")
    expected = json.loads((FIXTURE / "train" / "summary.json").read_text())
    async with _client(archive_log(archive)) as client:
        listing = await client.get("/")
        page = await client.get(f"/r/{archive.rollout_id}")
    assert listing.status_code == page.status_code == 200
    assert archive.rollout_id in listing.text
    shown = _figures(page.text)
    assert shown["n_samples"] == str(expected["n_samples"])
    assert shown["kept"] == str(expected["kept"])
    for name, count in expected["counts"].items():
        assert shown[f"counts.{name}"] == str(count)
    for name, ds in expected["datasets"].items():
        assert shown[f"{name}.n"] == str(ds["n"])
        for key, value in ds["metrics"].items():
            assert shown[f"{name}.{key}"] == f"{key}={value:.6g}"
    spans = set(re.findall(r'<rect class="(?:ok|ab|retry|run)"[^>]* data-s="([^"]+)"', page.text))
    assert spans == {t["sample_id"] for t in expected["tasks"]}


async def test_every_log_text_is_escaped_and_no_inline_script_is_allowed(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    _, client = hostile
    pages = [await client.get(f"/r/h1/s/h1:s{i}") for i in range(3)]
    pages.append(await client.get("/r/h1/s/h1:s7"))  # aborted, its error is the markup
    pages.append(await client.get("/compare", params={"a": "h1/h1:s0", "b": "h1/h1:s2"}))
    for page in pages:
        assert page.status_code == 200
        assert "<script>window" not in page.text and "<img src=x" not in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
    # Each of the response, the prompt, the tool call and the error is shown, as text.
    assert escape(HOSTILE) in pages[0].text  # the response
    assert escape(json.dumps(HOSTILE)) in pages[1].text  # the prompt, a JSON string
    assert escape(json.dumps([HOSTILE])) in pages[2].text  # the tool call
    assert escape(HOSTILE) in pages[3].text  # the abort's error
    assert pages[4].text.count('class="col"') == 2


async def test_a_sample_shows_every_attempt_and_the_tokens_with_their_figures(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    _, client = hostile
    page = (await client.get("/r/h1/s/h1:s3")).text  # retried: two starts
    assert page.count('<tr class="SampleStarted">') == 2
    assert page.count('<tr class="TurnCompleted">') == 1
    tokens = re.findall(r'<span class="(p\d|o)" title="#(\d+) id=(\d+) lp=([-\d.]+) v=(-?\d+)',
                        page)
    assert len(tokens) == 24
    assert {c for c, *_ in tokens if int(_[0]) % 9 == 8} == {"o"}  # loss mask 0
    assert {v for *_, v in tokens} == {"2", "-1"}


async def test_search_filters_by_id_dataset_reward_and_termination(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    entries = await log.read_raw(log.names.rollout("h1"))
    state = replay_state(decode_entries(log.names.rollout("h1"), entries)[0]).state

    async def found(**query: str) -> int:
        page = (await client.get("/r/h1", params=query)).text
        return int(re.search(r'data-k="found">(\d+)<', page).group(1))  # type: ignore[union-attr]

    records = list(state.samples.values())
    assert await found() == 40
    assert await found(q="h1:s1") == sum(1 for r in records if "h1:s1" in r.sample_id)
    assert await found(dataset="math_train") == sum(r.dataset == "math_train" for r in records)
    assert await found(reward_min="1") == sum(r.reward >= 1 for r in records)
    assert await found(term="infra_sandbox") == sum(r.aborted for r in records) == 2
    found_redirect = await client.get("/find", params={"sample": "h1:s5"})
    assert found_redirect.status_code == 303
    assert found_redirect.headers["location"] == "/r/h1/s/h1:s5"
    assert (await client.get("/r/h1/s/nope")).status_code == 404
    assert (await client.get("/r/nope")).status_code == 404


async def test_the_rollout_page_has_the_pool_bands_and_the_pool_at_an_event(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    page = (await client.get("/r/h1")).text
    assert 'class="band-quiesce"' in page and 'class="band-version"' in page
    assert 'class="pool-line"' in page
    at = re.findall(r'href="/pool\?at=([^"]+)"', page)
    assert len(at) == 10  # a grant and a release per batch of 8
    pool = (await client.get("/pool", params={"at": at[0]})).text
    assert f"pool at {at[0]}" in pool and "1 batch holding 1 token" in pool
    refused = await client.get("/pool", params={"at": "<b>1"})
    assert refused.status_code == 400 and "&lt;b&gt;1 is not a stream id" in refused.text


async def test_the_stamp_changes_when_the_rollout_moves_and_the_summary_follows(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    events = synthetic_rollout("h2", 16, ready=False, t0_ms=1_700_000_100_000)
    half = next(i for i in range(len(events) // 2, len(events))
                if events[i][2] != events[i - 1][2])  # two writes at distinct times
    write_timed(log, events[:half])
    page = (await client.get("/r/h2")).text
    running = re.findall(r'<rect class="run"[^>]* data-s="([^"]+)"', page)
    assert running, "the first half starts samples"
    assert (await client.get(f"/r/h2/s/{running[0]}")).status_code == 200  # no end yet
    before = (await client.get("/api/stamp", params={"r": "h2"})).json()["stamp"]
    listing = (await client.get("/api/stamp")).json()["stamp"]
    write_timed(log, events[half:])
    assert (await client.get("/api/stamp", params={"r": "h2"})).json()["stamp"] != before
    assert (await client.get("/api/stamp")).json()["stamp"] != listing
    stream = log.names.rollout("h2")
    envelopes, _ = decode_entries(stream, await log.read_raw(stream))
    expected = build_summary(replay_state(envelopes))
    shown = _figures((await client.get("/r/h2")).text)
    assert shown["n_samples"] == str(expected["n_samples"])
    assert shown["counts.success"] == str(expected["counts"]["success"])


def test_the_view_command_binds_loopback_unless_told() -> None:
    args = build_parser(Settings()).parse_args(["view", "--from", "x.rollout"])
    assert args.host == "127.0.0.1" and args.source == Path("x.rollout")


async def test_a_stalled_rollout_shows_what_it_waits_for(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    events = synthetic_rollout("h4", 8, ready=False, t0_ms=1_700_000_200_000)
    last = max(ms for _, _, ms in events)
    stall = RolloutStalled(rollout_id="h4", idle_s=120, waiting_for=[f"batch {HOSTILE}"])
    write_timed(log, [*events, (log.names.rollout("h4"), stall, last + 120_000)])
    page = (await client.get("/r/h4")).text
    assert '<span class="status">STALLED</span>' in page
    assert f"stalled: no progress for 120 s; waiting for:\n  - batch {escape(HOSTILE)}" in page
    listing = (await client.get("/")).text
    assert re.search(r'data-rollout="h4"><td>.*?</td><td class="status">STALLED<', listing)


async def test_the_timeline_has_a_lane_per_model_server_with_its_states(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    _, client = hostile
    page = (await client.get("/r/h1")).text
    assert ">http://10.0.0.1:30000</text>" in page
    states = re.findall(r'<rect class="server-(up|down|stale)"', page)
    assert states == ["up", "down", "up"]


async def test_one_prompt_is_followed_across_rollouts(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    write_timed(log, synthetic_rollout("h5", 8, t0_ms=1_700_000_300_000))
    page = (await client.get("/compare", params={"a": "h1/h1:s4", "across": "1"})).text
    shown = re.findall(r'<h2>Sample <span data-k="sample_id">([^<]+)</span>', page)
    assert shown == ["h1:s4", "h5:s4", "h5:s5", "h5:s6", "h5:s7"]  # the prompt of group 1


async def test_teacher_logprobs_and_top_k_show_per_token(
    hostile: tuple[MemoryEventLog, httpx.AsyncClient],
) -> None:
    log, client = hostile
    scored = TeacherScored(
        rollout_id="h1", sample_id="h1:s4", teacher_logprobs=[-0.5] * 24, top_k=2,
        topk_ids=[11, 12] * 24, topk_logprobs=[-0.1, -2.0] * 24,
    )
    write_timed(log, [(log.names.rollout("h1"), scored, 1_700_000_099_000)])
    page = (await client.get("/r/h1/s/h1:s4")).text
    assert page.count("teacher=-0.5000 top: 11:-0.100, 12:-2.000") == 24


async def test_a_loopback_viewer_answers_only_loopback_host_names() -> None:
    app = create_app(ViewData(MemoryEventLog()), allowed_hosts=LOOPBACK_NAMES)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8765") as ok:
        assert (await ok.get("/")).status_code == 200
    async with httpx.AsyncClient(transport=transport, base_url="http://evil.example") as bad:
        assert (await bad.get("/")).status_code == 400


async def test_with_a_tokenizer_each_token_shows_its_text_escaped(tinylm_dir: Path) -> None:
    tokenizer = load_tokenizer(tinylm_dir)
    ids = tokenizer.encode("<b>bold</b> 42", add_special_tokens=False)
    log = MemoryEventLog()
    rid = "tok"
    events = [e for e in synthetic_rollout(rid, 4) if e[1].type != "SampleCompleted"]
    done = SampleCompleted(rollout_id=rid, sample_id=f"{rid}:s0", prompt_ids=ids,
                           response_ids=ids, logprobs=[-0.1] * len(ids),
                           loss_mask=[1] * len(ids), reward=1.0)
    write_timed(log, [*events, (log.names.rollout(rid), done, events[-1][2] + 1)])
    app = create_app(ViewData(log, tokenizer=tokenizer))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://view") as client:
        page = (await client.get(f"/r/{rid}/s/{rid}:s0")).text
    texts = tokenizer.batch_decode([[t] for t in ids])
    shown = re.findall(r'<span class="p\d" title="[^"]*">([^<]*)</span>', page)
    assert shown == [escape(t) for t in texts]
    assert "<b>" not in page and escape("<b>bold</b> 42") in page  # the prompt text


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 300)), max_size=60))
def test_timeline_rows_never_overlap_and_are_as_few_as_the_busiest_moment(
    bounds: list[tuple[int, int]],
) -> None:
    spans = [Span(f"s{i}", 0, "n", a, a + d, "ok") for i, (a, d) in enumerate(bounds)]
    rows = _rows(spans)
    for i, a in enumerate(spans):
        for j, b in enumerate(spans[:i]):
            if rows[i] == rows[j]:
                assert a.end_ms <= b.start_ms or b.end_ms <= a.start_ms
    # a span ending at t leaves its row free for one starting at t
    busiest = max((sum(s.start_ms <= t < s.end_ms for s in spans) for t in range(1301)),
                  default=0)
    assert len(set(rows)) == busiest
