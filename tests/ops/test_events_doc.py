"""docs/events.md is what the catalog generates: editing an event without regenerating the
reference fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.events import catalog
from engine.events.base import registered_types
from engine.ops import cli
from engine.ops.events_doc import ROUTES, render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "events.md"


def test_docs_events_md_is_up_to_date() -> None:
    assert DOC.read_text() == render_markdown(), (
        "docs/events.md is stale: run `rollout events --markdown --out docs/events.md`"
    )


def test_every_event_and_field_is_in_the_reference() -> None:
    text = render_markdown()
    engine_events = {n: c for n, c in registered_types().items()
                     if c.__module__.startswith("engine.")}
    assert set(ROUTES) == set(engine_events)
    for name, cls in engine_events.items():
        assert f"\n## {name}\n" in text
        section = text.split(f"\n## {name}\n")[1].split("\n## ")[0]
        for field in cls.model_fields:
            if field not in ("type", "producer", "causation"):
                assert f"| `{field}` |" in section, (name, field)
    assert "### TokenGrant" in text and "### NodeDecl" in text  # nested records
    assert "Older versions read through upcasters: v1." in text.split("## TaskFetched")[1]


def test_a_new_event_without_a_route_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(ROUTES, "SampleStarted")
    with pytest.raises(ValueError, match=r"no route for \['SampleStarted'\]"):
        render_markdown()
    assert catalog.SampleStarted  # still registered: only the route is missing


def test_rollout_events_writes_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "events.md"
    assert cli.main(["events", "--markdown", "--out", str(out)]) == 0
    assert out.read_text() == render_markdown()
    assert cli.main(["events", "--markdown", "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("up to date")
