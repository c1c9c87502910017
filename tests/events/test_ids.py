"""Stream ids order as integer pairs and step across sequence boundaries."""

from __future__ import annotations

from engine.events.ids import (
    EMPTY_ID,
    MAX_SEQ,
    exclusive,
    id_after,
    id_before,
    id_ms,
    later_id,
    parse_id,
)


def test_ids_order_numerically_not_as_text() -> None:
    assert parse_id("10-0") > parse_id("9-5")
    assert parse_id("7") == (7, 0)
    assert later_id("9-5", "10-0") == "10-0"
    assert later_id("10-1", "10-0") == "10-1"


def test_before_and_after_step_one_position() -> None:
    assert id_before("5-3") == "5-2"
    assert id_before("5-0") == f"4-{MAX_SEQ}"
    assert id_before(EMPTY_ID) == EMPTY_ID
    assert id_after("5-3") == "5-4"
    assert id_after(f"5-{MAX_SEQ}") == "6-0"
    for i in ("1-0", "5-3", "1700000000000-7"):
        assert parse_id(id_before(i)) < parse_id(i) < parse_id(id_after(i))


def test_ms_and_exclusive_bound() -> None:
    assert id_ms("1700000000123-4") == 1700000000123
    assert exclusive("5-3") == "(5-3"
