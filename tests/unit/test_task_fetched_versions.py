"""TaskFetched v2 carries typed, resolved settings; a v1 entry (e64f068) is upcast on read."""

from __future__ import annotations

from typing import Any

import msgpack

from engine.domain import SamplingParams, StoppingCriteria
from engine.events import TaskFetched, decode, encode
from engine.events.fastpath import decode_fast
from engine.projections.samples import task_of


def _v1(**changes: Any) -> bytes:
    payload: dict[str, Any] = {
        "type": "TaskFetched",
        "producer": "scheduler:s0",
        "causation": None,
        "rollout_id": "r1",
        "sample_id": "r1:s0",
        "index": 0,
        "group_index": 0,
        "prompt": "2+2?",
        "label": "4",
        "dataset": "gsm",
        "task_type": "math",
        "dataset_cfg": {"name": "gsm", "path": "gsm.jsonl", "task_type": "math", "kind": "train"},
        "metadata": {"row": 3, "_source_line": 7},
        "knobs": {"dagger_beta": 0.5},
        "stopping": {"max_turns": 4, "timeout_s": 30.0},
        "sampling_params": {"temperature": 0.5, "stop": ["\n"]},
        **changes,
        "v": 1,
    }
    out: bytes = msgpack.packb(payload, use_bin_type=True)
    return out


def test_a_v1_entry_is_upcast_to_typed_settings() -> None:
    raw = _v1()
    assert decode_fast(raw) is None  # not the current version: the reference path upcasts
    ev = decode(raw)
    assert isinstance(ev, TaskFetched)
    assert ev.stopping == StoppingCriteria(max_turns=4, timeout_s=30.0)
    assert ev.sampling_params == SamplingParams(temperature=0.5, stop=("\n",))
    assert ev.source_line == 7 and ev.metadata == {"row": 3}
    assert (ev.producer, ev.dataset, ev.task_type) == ("scheduler:s0", "gsm", "math")
    task = task_of(ev)
    assert (task.dataset_name, task.task_type, task.source_line) == ("gsm", "math", 7)


def test_a_v1_entry_without_a_source_line_keeps_its_metadata() -> None:
    ev = decode(_v1(metadata={"row": 3}))
    assert isinstance(ev, TaskFetched)
    assert ev.source_line is None and ev.metadata == {"row": 3}
    assert task_of(ev).source_line == 1


def test_a_v2_event_takes_the_fast_path_and_shares_its_settings() -> None:
    stopping = StoppingCriteria(max_turns=4, max_context_len=1024)
    sampling = SamplingParams(temperature=0.7, top_p=0.9)
    events = [
        TaskFetched(rollout_id="r1", sample_id=f"r1:s{i}", index=i, group_index=i, prompt="p",
                    dataset="gsm", task_type="math", source_line=i + 1, stopping=stopping,
                    sampling_params=sampling)
        for i in range(3)
    ]
    decoded = [decode_fast(encode(ev)) for ev in events]
    assert decoded == events
    first = decoded[0]
    assert isinstance(first, TaskFetched)
    # the same settings bytes decode to one validated (immutable) record
    assert all(isinstance(d, TaskFetched) and d.stopping is first.stopping for d in decoded)


def test_a_v1_line_that_is_not_a_line_number_stays_in_the_metadata() -> None:
    ev = decode(_v1(metadata={"_source_line": "seven", "row": 3}))
    assert isinstance(ev, TaskFetched)
    assert ev.source_line is None and ev.metadata == {"_source_line": "seven", "row": 3}
    assert task_of(ev).source_line == 1
