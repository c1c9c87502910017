"""Random rollout streams for the loading tests: every kind of entry a rollout stream holds,
in the orders crashes and redeliveries give (see ``test_loading.py``)."""

from __future__ import annotations

import random
from typing import Any

import msgpack

from engine.events import (
    AbortClass,
    BatchSealed,
    Event,
    PromptStored,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.events.codec import encode
from engine.outcomes import TerminationReason

ALGORITHMS = ("grpo", "opd", "mixed_ce_k3", "dagger_ce", "grpo_capture")


def _completed(rng: random.Random, rid: str, sid: str, attempt: int,
               prompt_key: str, prompt: list[int]) -> SampleCompleted:
    n = rng.randint(1, 6)
    teacher = [rng.randint(0, 1) for _ in range(n)] if rng.random() < 0.5 else []
    cuts = sorted(rng.sample(range(n + 1), k=min(2, n + 1))) if teacher else []
    detail = {"score": rng.random(), "fmt": 1.0} if rng.random() < 0.2 else {}
    return SampleCompleted(
        rollout_id=rid, sample_id=sid, attempt=attempt,
        prompt_ids=[] if prompt_key else prompt,
        response_ids=[rng.randint(0, 99) for _ in range(n)],
        logprobs=[-rng.random() for _ in range(n)] if rng.random() < 0.9 else [],
        loss_mask=[rng.randint(0, 1) for _ in range(n)],
        reward=rng.choice([0.0, 1.0, 0.5]), reward_detail=detail,
        termination_reason=rng.choice([None, TerminationReason.FINISH]),
        response_text=f"r{sid}.{attempt}", n_turns=rng.randint(0, 3),
        policy_version=rng.randint(0, 3),
        token_versions=[rng.randint(-1, 3) for _ in range(n)] if rng.random() < 0.5 else [],
        teacher_mask=teacher, student_cut_points=cuts, prompt_key=prompt_key,
    )


def _scored(rng: random.Random, rid: str, sid: str, attempt: int, n: int) -> TeacherScored:
    k = rng.choice([0, 2])
    return TeacherScored(
        rollout_id=rid, sample_id=sid, attempt=attempt,
        teacher_logprobs=[-rng.random() for _ in range(n)], top_k=k,
        topk_ids=[rng.randint(0, 99) for _ in range(n * k)],
        topk_logprobs=[-rng.random() for _ in range(n * k)],
        action_mask=[rng.randint(0, 1) for _ in range(n)] if rng.random() < 0.5 else [],
    )


def random_stream(seed: int, n_samples: int = 24, *, ready: str = "ok") -> list[bytes]:
    """The raw entries of one random rollout stream. ``ready``: ``ok`` (the ready event
    names terminal samples), ``missing`` (none), ``dummy``, ``unknown`` (it names a sample
    with no terminal event)."""
    rng = random.Random(seed)
    rid = f"r{seed}"
    algorithm = rng.choice(ALGORITHMS)
    knobs: dict[str, Any] = {"max_seq_len": rng.randint(4, 12)} if rng.random() < 0.3 else {}
    events: list[Event] = [
        RolloutRequested(
            rollout_id=rid, n_prompts=max(1, n_samples // 4), seed=seed, iteration=seed % 5,
            algorithm=algorithm.removesuffix("_capture"), knobs=knobs,
            teacher_capture=algorithm == "grpo_capture",
        )
    ]
    ids = [f"{rid}-s{i}" for i in range(n_samples)]
    firsts: dict[int, str] = {}
    for i, sid in enumerate(ids):
        g = i // 4
        if g in firsts and rng.random() < 0.8:
            # A group's later sample, on its first (or on an earlier joined one: a chain).
            joined = [s for s in ids[g * 4 : i]]
            events.append(TaskJoined(rollout_id=rid, sample_id=sid, index=i, group_index=g,
                                     same_as=rng.choice(joined)))
        else:
            events.append(TaskFetched(
                rollout_id=rid, sample_id=sid, index=i, group_index=g, prompt=f"q{g}",
                label=rng.choice([None, str(g), {"a": g}]), dataset="d", task_type="t",
                source_line=rng.choice([None, g + 1]), metadata={"m": i % 3},
                carried_from=rng.choice([None, None, "r-earlier"]),
            ))
            firsts.setdefault(g, sid)
        if rng.random() < 0.1:  # a redelivered plan entry
            events.append(events[-1])
    events.append(BatchSealed(rollout_id=rid, batch_id="b0", seq=0, evaluator_id="e",
                              sample_ids=ids[:2]))
    events.append(RolloutPlanned(rollout_id=rid, n_samples=n_samples, n_batches=1))
    prompts: dict[int, list[int]] = {}
    life: list[Event] = []
    terminal: dict[str, tuple[int, SampleCompleted | None]] = {}
    for i, sid in enumerate(ids):
        g = i // 4
        attempts = rng.choice([1, 1, 1, 2, 3])
        for attempt in range(attempts):
            life.append(SampleStarted(rollout_id=rid, sample_id=sid, attempt=attempt))
            for turn in range(rng.randint(0, 3)):
                life.append(TurnCompleted(rollout_id=rid, sample_id=sid, attempt=attempt,
                                          turn=turn))
        attempt = attempts - 1
        if rng.random() < 0.15:
            continue  # never terminal
        if rng.random() < 0.25:
            life.append(SampleAborted(
                rollout_id=rid, sample_id=sid, attempt=attempt,
                abort_class=rng.choice(list(AbortClass)),
                agent_reason=rng.choice([None, TerminationReason.LENGTH]),
            ))
            terminal[sid] = (attempt, None)
        else:
            key = f"p{g}" if rng.random() < 0.5 else ""
            prompt = prompts.setdefault(g, [rng.randint(0, 99) for _ in range(3)])
            if key:
                life.append(PromptStored(rollout_id=rid, prompt_key=key, prompt_ids=prompt))
            done = _completed(rng, rid, sid, attempt, key, prompt)
            life.append(done)
            terminal[sid] = (attempt, done)
            if algorithm != "dagger_ce" and rng.random() < 0.6:  # the CE lane scores none
                n = len(done.response_ids)
                life.append(_scored(rng, rid, sid, attempt + rng.choice([0, 0, 1, -1]), n))
                life.append(_scored(rng, rid, sid, attempt, n))
        if rng.random() < 0.2:  # a late terminal of another attempt loses
            life.append(_completed(rng, rid, sid, attempt + 5, "", [7]))
    rng.shuffle(life)
    # A terminal (and its teacher) must follow the sample's PromptStored: a PromptStored
    # is written before the first completion that refers to it, so move every one first.
    life.sort(key=lambda e: not isinstance(e, PromptStored))
    events.extend(life)
    ended = [sid for sid in ids if sid in terminal]
    rng.shuffle(ended)
    kept = ended[: max(1, len(ended) - rng.randint(0, 3))]
    if ready == "unknown":
        kept = [*kept, next((s for s in ids if s not in terminal), f"{rid}-ghost")]
    if ready != "missing":
        # The samples still running when it became ready: a tail, aborted or carried over.
        tail = [sid for sid in ids if sid not in terminal]
        events.append(RolloutReady(rollout_id=rid, sample_ids=sorted(kept) if rng.random() < 0.5
                                   else kept, dummy=ready == "dummy", tail_sample_ids=tail,
                                   tail_carried=bool(tail) and rng.random() < 0.5))
        events.append(RolloutReady(rollout_id=rid, sample_ids=kept[:1]))  # a copy loses
    raw = [encode(e) for e in events]
    # Entries the log's readers skip, and entries in another (valid) key order.
    for at in sorted(rng.sample(range(len(raw)), k=3), reverse=True):
        raw.insert(at, rng.choice([b"\x93\x01\x02\x03", b"", msgpack.packb(
            {"type": "SampleCompleted", "sample_id": ids[0], "v": 3})]))
    for at in rng.sample(range(len(raw)), k=len(raw) // 5):
        try:
            obj = msgpack.unpackb(raw[at], raw=False)
        except ValueError:
            continue  # one of the garbage entries
        if isinstance(obj, dict) and "type" in obj:
            obj["type"] = obj.pop("type")  # "type" last: not the canonical form
            raw[at] = msgpack.packb(obj, use_bin_type=True)
    return raw
