"""A DAgger rollout end to end on real processes: a real redis-server, the scheduler, an
evaluator worker serving the bundled ``dagger`` binding with its own teacher port, the
finalizer and the capture worker, a tinylm student and a tinylm teacher each in its own
server process. The request (``algorithm="dagger_k3"``, ``dagger_beta`` 1, ``t_max`` 1)
reaches ``collate`` in the mixed lane, and the archived stream replays to the same tensors.

Student and teacher share one vocabulary (one corpus, one seed: the capture force-decodes the
student's tokens on the teacher); the teacher is overfit on the math episode, the student is
untrained, so the teacher's turn is a well-formed tool call and the student's is not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.backends.sglang import load_tokenizer
from engine.client import RolloutClient, collate
from engine.events import EventLog
from engine.events.catalog import SampleCompleted
from engine.ops.processes import Processes
from engine.ops.replay import archive_rollout, decode_entries, read_archive, replay_state
from engine.ops.tinylm import init_model
from engine.projections.lanes import TEACHER_SENTINEL
from engine.projections.samples import trainer_samples
from engine.tasks import EVALUATOR_CONFIG
from tests.agents.conftest import MATH_EPISODE, MATH_QUESTION
from tests.redis_server import RedisServer
from tests.rig import events_of, launcher, start_finalizer
from tinylm.process import ServerProcess, spawn_server

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dagger-student") / "model"
    init_model(path, seed=0, dialogues=[MATH_EPISODE], train_steps=0)
    return path


@pytest.fixture(scope="module")
def teacher_dir(math_model_dir: Path) -> Path:
    return math_model_dir  # the agents' policy: overfit on MATH_EPISODE, the student's vocabulary


@pytest.fixture(scope="module")
def servers(student_dir: Path, teacher_dir: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with spawn_server(student_dir, port=0) as student, spawn_server(teacher_dir, port=0) as teacher:
        yield student, teacher


@pytest.fixture
def procs(redis_server: RedisServer, tmp_path: Path) -> Iterator[Processes]:
    with launcher(redis_server.url, tmp_path) as processes:
        yield processes


def _digest(batch: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for k, t in batch.items()
    }


async def test_a_dagger_k3_request_runs_the_dagger_agent_to_collate(
    real_log: EventLog,
    procs: Processes,
    servers: tuple[ServerProcess, ServerProcess],
    student_dir: Path,
    teacher_dir: Path,
    tmp_path: Path,
) -> None:
    student, teacher = servers
    assert load_tokenizer(student_dir).get_vocab() == load_tokenizer(teacher_dir).get_vocab()
    data = tmp_path / "math.jsonl"
    data.write_text(
        "".join(f'{{"id": "q{i}", "prompt": "{MATH_QUESTION}", "label": "42"}}\n' for i in range(2))
    )
    config = tmp_path / "rollout.yaml"
    config.write_text(
        "rollout:\n  defaults: {task_type: dagger, max_turns: 3, max_context_len: 1024,"
        " max_new_tokens: 96, timeout_s: 120}\n"
        f"  datasets:\n    math_dagger: {{path: {data}, n_samples_per_prompt: 2}}\n"
    )
    layout = '{"node-a": {"gpus": [], "cpu": 8, "memory_gb": 64}}'
    procs.start(
        "sched", "scheduler", "--rollout-config", str(config),
        "--evaluator-config", str(EVALUATOR_CONFIG), "--cluster-layout", layout,
        "--scheduler-id", "s1",
    )
    procs.start(
        "w1", "worker", "--worker-id", "w1", "--evaluator-config",
        str(EVALUATOR_CONFIG), "--evaluators", "dagger", "--sandbox", "local",
        "--sglang-url", student.url, "--model-dir", str(student_dir),
        "--teacher-url", teacher.url, "--teacher-tokenizer", str(teacher_dir), "--quiet",
    )
    start_finalizer(procs)
    procs.start(
        "cap", "capture", "--worker-id", "cap", "--teacher-url", teacher.url,
        "--teacher-tokenizer", str(teacher_dir),
    )
    client = RolloutClient(real_log)
    rid = await client.request(
        iteration=1, n_prompts=2, seed=3, algorithm="dagger_k3",
        knobs={"dagger_beta": 1.0, "t_max": 1},
    )
    try:
        ready = await client.wait_ready(rid, timeout=240)
    except BaseException:
        for name in ("sched", "w1", "fin", "cap"):
            print(f"--- {name}\n{procs.output(name)[-3000:]}")
        raise
    assert (ready.n_completed, ready.n_aborted) == (4, 0), procs.output("w1")[-3000:]
    done = await events_of(real_log, real_log.names.rollout(rid), SampleCompleted)
    for ev in done:
        # the teacher executed turn 0 (t_max 1), the student every later turn
        assert ev.metrics["dagger_teacher_0"] == 1.0 and ev.metrics["dagger_label_failures"] == 0
        teacher_mask = ev.teacher_mask.tolist()
        assert teacher_mask[0] == 1 and sum(teacher_mask) > 0
        first_student = ev.student_cut_points[0] if ev.student_cut_points else len(teacher_mask)
        assert all(teacher_mask[i] == 0 for i in range(first_student, len(teacher_mask)))
    samples = await client.load(rid)
    batch = collate(samples)
    b, t = batch["tokens"].shape
    assert b == 4
    k = batch["teacher_topk_ids"].shape[2]
    assert batch["teacher_topk_ids"].shape == (b, t, k) and k == 20
    is_teacher = batch["is_teacher_mask"].bool()
    assert is_teacher.any()
    assert batch["teacher_log_probs"][is_teacher].eq(TEACHER_SENTINEL).all()
    assert batch["teacher_log_probs"][~is_teacher].le(0).all()
    assert torch.equal(batch["loss_mask"].bool(), batch["action_mask"].bool() | is_teacher)
    assert not (batch["action_mask"].bool() & is_teacher).any()
    # the teacher's own logprob of its chosen token is the best of its top-K at student
    # positions it scored: a real force-decode, not a constant
    student_pos = batch["action_mask"].bool()
    assert batch["teacher_log_probs"][student_pos].lt(0).any()
    # replay from the archive gives the same tensors
    archive = tmp_path / "dagger.rollout"
    await archive_rollout(real_log, rid, archive)
    envs, _ = decode_entries(real_log.names.rollout(rid), read_archive(archive).entries)
    assert _digest(collate(trainer_samples(replay_state(envs)))) == _digest(batch)
