"""``EventLog.read_raw_ranges``: the entries of several ranges of one stream, undecoded, in
one round trip (what ``RolloutClient.iter_load`` reads each chunk back with)."""

from __future__ import annotations

from engine.events.log import EventLog
from engine.events.log_base import FIELD
from tests.conftest import write_raw

STREAM = "rl:{rollout:ranges}"


async def test_each_range_gives_its_entries_in_order(log: EventLog) -> None:
    ids = []
    for i in range(10):
        ids.append(await write_raw(log, STREAM, {FIELD: f"e{i}".encode()}, f"{i + 1}-0"))
    await write_raw(log, STREAM, {"other": b"x"}, "11-0")  # no event field: empty bytes
    replies = await log.read_raw_ranges(
        STREAM, [("-", "+", 3), ("(3-0", "+", 2), ("7-0", "9-0", None), ("10-0", "+", None)]
    )
    assert replies == [
        [("1-0", b"e0"), ("2-0", b"e1"), ("3-0", b"e2")],
        [("4-0", b"e3"), ("5-0", b"e4")],
        [("7-0", b"e6"), ("8-0", b"e7"), ("9-0", b"e8")],
        [("10-0", b"e9"), ("11-0", b"")],
    ]
    assert await log.read_raw_ranges(STREAM, []) == []
    assert await log.read_raw_ranges("rl:{rollout:none}", [("-", "+", 5)]) == [[]]
