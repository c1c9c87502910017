"""``rollout top`` shows each policy server as the workers last said it, from ``rl:control``."""

from __future__ import annotations

from rich.console import Console

from engine.events.catalog.servers import ServerDown, ServerStale, ServerUp
from engine.events.log import EventLog
from engine.ops.top import TopSource, render

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


async def test_the_last_word_on_each_server_is_shown_with_its_worker_version_and_reason(
    log: EventLog,
) -> None:
    source = TopSource(log)
    assert (await source.snapshot()).servers == []  # none reported: no table
    control = log.names.control
    await log.append(control, ServerDown(endpoint=A, worker="w1", reason="connection refused"))
    await log.append(control, ServerUp(endpoint=B, worker="w2", weight_version=3))
    await log.append(control, ServerStale(endpoint=C, worker="w1", weight_version=None,
                                          active=3, reason="restarted"))  # fmt: skip
    await log.append(control, ServerUp(endpoint=A, worker="w2", weight_version=3))
    view = await source.snapshot()
    rows = {(r.endpoint, r.state, r.worker, r.version, r.detail) for r in view.servers}
    assert rows == {
        (A, "up", "w2", "3", ""),
        (B, "up", "w2", "3", ""),
        (C, "STALE", "w1", "default", "needs a sync to 3"),
    }
    await log.append(control, ServerDown(endpoint=B, worker="w1", reason="stalled"))
    view = await source.snapshot()  # only the new tail is read
    assert [(r.endpoint, r.state, r.detail) for r in view.servers if r.endpoint == B] == [
        (B, "DOWN", "stalled")
    ]
    console = Console(width=160, record=True)
    console.print(render(view))
    text = console.export_text()
    assert "model servers" in text and "needs a sync to 3" in text and "stalled" in text
