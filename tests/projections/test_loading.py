"""The trainer's loading paths give the samples of the in-memory path on random streams.

The in-memory path is replay's: every entry decoded and folded by the rollout fold, the
samples built from the entries its records name (``trainer_samples``). The client's
``load`` (the entries samples are built from, folded and kept as read, the rest not
decoded) and ``iter_load`` (the records first, then each chunk's entries read back by id,
in a few ranges) must give exactly those samples -- on random rollout streams:
multi-turn samples, retried attempts, aborted samples, late duplicate terminals,
redelivered plan entries, ``TaskJoined`` groups (and chains), prompts stored once, teacher
scorings of the right and wrong attempts, every lane (CE included), undecodable entries
and entries in a non-canonical key order -- and the same errors where it raises."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence
from unittest.mock import patch

import pytest

from engine.client import RolloutClient
from engine.errors import DecodeError, RolloutError
from engine.events import Envelope, TaskJoined
from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.events.base import Event
from engine.events.codec import decode, encode
from engine.events.ids import parse_id
from engine.events.log import EventLog
from engine.events.redis_log import FIELD
from engine.outcomes import SampleStatus
from engine.projections import samples as samples_module
from engine.projections.base import fold, start
from engine.projections.lanes import CE_ALGORITHMS, Lane, request_lane
from engine.projections.readback import Rollout, in_memory, ranges, wanted
from engine.projections.rollout import RolloutProjection
from engine.projections.samples import samples_named, trainer_samples
from engine.runtime.readback import StreamLoad, type_name
from engine.sample import Sample
from tests.conftest import write_raw
from tests.projections.rollout_streams import random_stream

STREAM = "rl:{rollout:t}"


def _ids(raw: Sequence[bytes]) -> list[tuple[str, bytes]]:
    return [(f"{i + 1}-0", r) for i, r in enumerate(raw)]


def reference(raw: Sequence[bytes]) -> list[Sample] | tuple[str, str]:
    """The samples of the in-memory path, built by the validating constructor, or the
    error it raises (type, message)."""
    with patch.object(samples_module, "_sample", lambda **fields: Sample(**fields)):
        return _reference(raw)


def _reference(raw: Sequence[bytes]) -> list[Sample] | tuple[str, str]:
    envs = []
    for entry_id, r in _ids(raw):
        try:
            envs.append(Envelope(STREAM, entry_id, decode(r)))
        except DecodeError:
            continue  # the log's readers skip it
    p = RolloutProjection()
    try:
        return trainer_samples(in_memory(fold(p, start(p), envs).state, envs))
    except Exception as exc:  # noqa: BLE001 - compared with the other path's
        return type(exc).__name__, str(exc)


def by_load(raw: Sequence[bytes]) -> list[Sample] | tuple[str, str]:
    try:
        load = StreamLoad(STREAM, keep=True)
        load.feed(_ids(raw))
        return trainer_samples(load.rollout())
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


def by_read_back(raw: Sequence[bytes], chunk: int) -> list[Sample] | tuple[str, str]:
    """Both passes of ``iter_load``, with the stream in memory: the second reads back each
    chunk's entries through the fold's ranges (every entry of a range, as XRANGE gives)."""
    entries = _ids(raw)
    try:
        load = StreamLoad(STREAM, keep=False)
        load.feed(entries)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    state = load.state
    assert not load.entries and state.ready is not None and not state.ready.dummy
    lane = request_lane(state.request)
    assert lane is not Lane.CE
    ids = state.ready.sample_ids
    out: list[Sample] = []
    for at in range(0, len(ids), chunk):
        part = ids[at : at + chunk]
        want = wanted(state, part)
        read: dict[str, Event] = {}
        for first, last in ranges(state, want):
            for entry_id, r in entries:
                if parse_id(first) <= parse_id(entry_id) <= parse_id(last) and entry_id in want:
                    read[entry_id] = decode(r)
        assert set(read) == set(want)  # the ranges hold every entry wanted
        try:
            out.extend(samples_named(Rollout(state, read), part, lane))
        except Exception as exc:  # noqa: BLE001
            return type(exc).__name__, str(exc)
    return out


def _same(a: list[Sample] | tuple[str, str], b: list[Sample] | tuple[str, str]) -> None:
    """Equal samples, byte for byte, with the same fields set (or the same error)."""
    assert _dumps(a) == _dumps(b)
    assert a == b
    if isinstance(a, list) and isinstance(b, list):
        assert [s.model_fields_set for s in a] == [s.model_fields_set for s in b]
        assert [list(s.__dict__) for s in a] == [list(s.__dict__) for s in b]


def _dumps(samples: list[Sample] | tuple[str, str]) -> list[str] | tuple[str, str]:
    if isinstance(samples, tuple):
        return samples
    return [s.model_dump_json() for s in samples]


@pytest.mark.parametrize("seed", range(60))
def test_load_gives_the_in_memory_samples(seed: int) -> None:
    ready = ("ok", "ok", "ok", "dummy", "missing", "unknown")[seed % 6]
    raw = random_stream(seed, n_samples=4 + seed % 29, ready=ready)
    expected = reference(raw)
    got = by_load(raw)
    _same(got, expected)
    if ready == "ok":
        assert isinstance(expected, list) and expected


@pytest.mark.parametrize("seed", range(60))
def test_read_back_gives_the_in_memory_samples_chunk_by_chunk(seed: int) -> None:
    raw = random_stream(seed, n_samples=4 + seed % 29, ready=("ok", "unknown")[seed % 5 == 4])
    expected = reference(raw)
    load = StreamLoad(STREAM, keep=False)
    load.feed(_ids(raw))
    if request_lane(load.state.request) is Lane.CE:
        pytest.skip("the CE lane is planned over the whole rollout (tested through the client)")
    for chunk in (1, 3, 1000):
        got = by_read_back(raw, chunk)
        if isinstance(expected, tuple) and chunk < 1000:
            # A chunk names the sample with no terminal: the same error, possibly after
            # earlier chunks were yielded.
            assert isinstance(got, tuple) and got == expected
            continue
        _same(got, expected)


def test_errors_of_the_writer_are_named_as_the_in_memory_path_names_them() -> None:
    joined = TaskJoined(rollout_id="t", sample_id="s1", index=1, group_index=0, same_as="s0")
    raw = random_stream(3, n_samples=8)
    for bad in ([encode(joined), *raw], _without_prompts(raw)):
        expected = reference(bad)
        assert isinstance(expected, tuple) and expected[0] == "RolloutError"
        assert by_load(bad) == expected
        assert by_read_back(bad, 4) == expected


def test_an_entry_that_is_not_the_one_folded_is_named() -> None:
    raw = random_stream(1, n_samples=8)
    load = StreamLoad(STREAM, keep=True)
    load.feed(_ids(raw))
    state = load.state
    assert state.ready is not None
    sid = state.ready.sample_ids[0]
    at = state.samples[sid].terminal_at
    assert at is not None
    entries = {k: v for k, v in load.entries.items() if k != at}  # gone (trimmed, say)
    with pytest.raises(RolloutError, match=f"entry {at} of the stream is not the"):
        trainer_samples(Rollout(state, entries))
    other = next(k for k, v in load.entries.items() if type(v).__name__ == "TaskFetched")
    with pytest.raises(RolloutError, match=f"entry {at} of the stream"):
        trainer_samples(Rollout(state, {**load.entries, at: load.entries[other]}))


def _without_prompts(raw: Sequence[bytes]) -> list[bytes]:
    kept = [r for r in raw if type_name(r) != b"PromptStored"]
    assert len(kept) < len(raw)
    return kept


def _fields(**over: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "index": 3, "group_index": 1, "sample_id": "s3", "prompt": "q", "response": "r",
        "label": "7", "tokens": TokenIds.from_values([1, 2, 3]), "response_length": 2,
        "loss_mask": Mask.from_values([1, 0]), "rollout_log_probs": LogProbs.from_values(
            [-0.5, -0.25]), "reward": 1.0, "status": SampleStatus.COMPLETED,
        "termination_reason": None, "policy_version": 2, "token_versions": None,
        "metadata": {"task_type": "t", "attempt": 0},
    }
    fields.update(over)
    return fields


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"reward": {"score": 0.5, "fmt": 1.0}},
        {"label": {"a": [1, 2]}, "metadata": {"nested": {"x": 1}}},  # not flat: validated
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"index": True},  # a bool is not an index: the constructor refuses it
        {"index": -1},
        {"policy_version": -3},
        {"reward": float("nan")},
        {"metadata": {"x": float("inf")}},
        {"prompt": []},
        {"response_length": 5},  # the invariants
        {"loss_mask": Mask.from_values([1])},
        {"token_versions": TokenIds.from_values([1])},
    ],
)
def test_the_cheap_sample_is_the_validated_one(over: dict[str, object]) -> None:
    fields = _fields(**over)
    try:
        expected: Sample | tuple[str, str] = Sample(**fields)
    except Exception as exc:  # noqa: BLE001
        expected = (type(exc).__name__, str(exc))
    try:
        got: Sample | tuple[str, str] = samples_module._sample(**fields)
    except Exception as exc:  # noqa: BLE001
        got = (type(exc).__name__, str(exc))
    if isinstance(expected, tuple):
        assert got == expected
        return
    assert isinstance(got, Sample)
    assert got == expected and got.model_dump_json() == expected.model_dump_json()
    assert got.model_fields_set == expected.model_fields_set
    assert list(got.__dict__) == list(expected.__dict__)


def test_type_name_reads_the_canonical_head_only() -> None:
    raw = random_stream(1, n_samples=4)[0]
    assert type_name(raw) == b"RolloutRequested"
    assert type_name(b"") is None and type_name(b"\x93\x01\x02\x03") is None
    assert type_name(b"\x81\xa1v\x01") is None  # a map whose first key is not "type"


# ---------------------------------------------------------------- through the client


async def _write(log: EventLog, rollout_id: str, raw: Sequence[bytes]) -> None:
    stream = log.names.rollout(rollout_id)
    for entry_id, r in _ids(raw):
        await write_raw(log, stream, {FIELD: r}, entry_id)


@pytest.mark.parametrize("seed", [0, 5, 7, 11, 12, 13, 17, 22])
async def test_load_and_iter_load_give_the_reference_samples(
    log: EventLog, seed: int
) -> None:
    raw = random_stream(seed, n_samples=30)
    rollout_id = f"r{seed}"
    await _write(log, rollout_id, raw)
    expected = reference(raw)
    assert isinstance(expected, list) and expected
    client = RolloutClient(log)
    assert _dumps(await client.load(rollout_id)) == _dumps(expected)
    for chunk_size in (1, 4, 1000):
        chunks = [c async for c in client.iter_load(rollout_id, chunk_size)]
        assert [len(c) for c in chunks[:-1]] == [chunk_size] * (len(chunks) - 1)
        assert _dumps([s for c in chunks for s in c]) == _dumps(expected)


async def test_the_lanes_are_all_covered(log: EventLog) -> None:
    """The seeds above hold every lane (so the client's CE path is exercised too)."""
    lanes = set()
    for seed in [0, 5, 7, 11, 12, 13, 17, 22]:
        load = StreamLoad(STREAM, keep=False)
        load.feed(_ids(random_stream(seed, n_samples=30)))
        lanes.add(request_lane(load.state.request))
    assert lanes == set(Lane)


_CE_SEEDS = [0, 9, 11, 12, 24, 25, 27, 38, 40, 41, 44, 50]


@pytest.mark.parametrize("seed", _CE_SEEDS)
async def test_iter_load_streams_the_ce_lane_in_loads_order(
    log: EventLog, seed: int
) -> None:
    """The CE lane's sub-samples (planned across the whole rollout, shuffled, over-long
    trajectories dropped: seed 12 sets ``max_seq_len``) come in ``load``'s order, whatever
    the chunk size; a sub-samples' parent split over chunks is read back once per chunk."""
    raw = random_stream(seed, n_samples=30)
    load = StreamLoad(STREAM, keep=False)
    load.feed(_ids(raw))
    assert request_lane(load.state.request) is Lane.CE
    rollout_id = f"ce{seed}"
    await _write(log, rollout_id, raw)
    expected = reference(raw)
    assert isinstance(expected, list) and len(expected) > 4
    assert any(s.metadata["ce_chunk"] for s in expected)  # a trajectory gave several
    client = RolloutClient(log)
    for chunk_size in (1, 3, 1000):
        chunks = [c async for c in client.iter_load(rollout_id, chunk_size)]
        assert [len(c) for c in chunks[:-1]] == [chunk_size] * (len(chunks) - 1)
        got = [s for c in chunks for s in c]
        _same(got, expected)


async def test_iter_load_of_the_ce_lane_names_a_missing_terminal_first(
    log: EventLog,
) -> None:
    """A ready event naming a sample with no terminal: the error ``load`` raises, before any
    chunk."""
    raw = random_stream(0, n_samples=30, ready="unknown")
    await _write(log, "ce-missing", raw)
    expected = reference(raw)
    assert isinstance(expected, tuple) and expected[0] == "RolloutError"
    got: list[list[Sample]] = []
    with pytest.raises(RolloutError) as caught:
        async for chunk in RolloutClient(log).iter_load("ce-missing", 1):
            got.append(chunk)
    assert got == [] and (type(caught.value).__name__, str(caught.value)) == expected


async def test_iter_load_holds_one_chunk_not_the_rollout(log: EventLog) -> None:
    """Peak memory while iterating in chunks of 50 stays well under a whole ``load``'s: the
    whole load holds every sample (and the page being folded); the chunked one holds the
    fold's records, one page of raw entries and one chunk."""
    n, load_peak, iter_peak = await _peaks(log, _big_plain_stream(3000))
    assert n == 3000
    assert iter_peak < load_peak / 10, (iter_peak, load_peak)


async def test_iter_load_of_the_ce_lane_holds_the_plan_and_one_chunk(
    log: EventLog,
) -> None:
    """The CE lane streams too (its plan, then one chunk's parents at a time)."""
    raw = _big_plain_stream(2000, algorithm=sorted(CE_ALGORITHMS)[0])
    n, load_peak, iter_peak = await _peaks(log, raw)
    assert n == 2 * 2000  # two sub-samples a trajectory
    assert iter_peak < load_peak / 10, (iter_peak, load_peak)


async def _peaks(log: EventLog, raw: Sequence[bytes]) -> tuple[int, int, int]:
    """The rollout ``raw`` written, loaded whole and then iterated in chunks of 50: how
    many samples each gave (they must agree), ``load``'s traced peak, and ``iter_load``'s
    peak above what was traced before it."""
    await _write(log, "big", raw)
    client = RolloutClient(log)
    tracemalloc.start()
    try:
        whole = await client.load("big")
        _, load_peak = tracemalloc.get_traced_memory()
        n_whole = len(whole)
        del whole
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        n = 0
        async for chunk in client.iter_load("big", 50):
            n += len(chunk)
            del chunk
        _, iter_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == n_whole
    return n, load_peak, iter_peak - base


def _big_plain_stream(n: int, algorithm: str = "grpo") -> list[bytes]:
    """A rollout of ``n`` samples with long responses (so a sample outweighs its index
    entry, as in real rollouts); for the CE lane each response has two teacher segments
    (a student turn between them), so each trajectory gives two sub-samples."""
    from engine.events import (
        RolloutReady,
        RolloutRequested,
        SampleCompleted,
        SampleStarted,
        TaskFetched,
    )

    events: list[Event] = [
        RolloutRequested(rollout_id="big", n_prompts=n // 8, algorithm=algorithm)
    ]
    teacher = [1] * 128 + [0] * 128 + [1] * 256  # teacher, student turn, teacher
    for i in range(n):
        sid = f"big-{i}"
        events.append(TaskFetched(rollout_id="big", sample_id=sid, index=i, group_index=i // 8,
                                  prompt=f"q{i // 8}", dataset="d", task_type="t"))
    for i in range(n):
        sid = f"big-{i}"
        events.append(SampleStarted(rollout_id="big", sample_id=sid))
        events.append(SampleCompleted(
            rollout_id="big", sample_id=sid, prompt_ids=list(range(64)),
            response_ids=[i % 100] * 512, logprobs=[-0.5] * 512, loss_mask=[1] * 512,
            reward=1.0, response_text="x" * 256,
            teacher_mask=teacher if algorithm != "grpo" else [],
            student_cut_points=[128, 256] if algorithm != "grpo" else [],
        ))
    events.append(RolloutReady(rollout_id="big", sample_ids=[f"big-{i}" for i in range(n)]))
    return [encode(e) for e in events]


async def test_reading_back_more_entries_than_a_round_trip_holds_reads_them_all(
    log: EventLog,
) -> None:
    """Every sample's entries of a rollout larger than one read-back round trip (the
    finalizer's artifacts read them all) come back, each the entry the fold recorded."""
    from engine.runtime.readback import _READ_BATCH, read_back

    raw = _big_plain_stream(_READ_BATCH // 2 + 100)  # a task and a terminal a sample
    await _write(log, "many", raw)
    load = StreamLoad(STREAM, keep=True)
    load.feed(_ids(raw))
    state = load.state
    assert len(wanted(state, state.samples)) > _READ_BATCH
    rollout = await read_back(log, log.names.rollout("many"), state, state.samples)
    assert rollout.entries == load.entries
    assert _dumps(trainer_samples(rollout)) == _dumps(trainer_samples(load.rollout()))
