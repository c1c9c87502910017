"""The reference trainer (``trainer``): each lane's loss on hand-built batches with the fixed
tensor names, and one whole iteration against the real stack (redis-server, tinylm servers,
scheduler, worker, finalizer, capture worker as processes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import torch

from engine.agents.tools import PythonTool
from engine.client import RolloutClient, collate
from engine.errors import ConfigError
from engine.events.catalog import RolloutReady
from engine.events.catalog.servers import ServerRegistered
from engine.losses import Correction, token_log_probs
from engine.ops.tinylm import init_model
from engine.projections.control import ControlState
from engine.projections.lanes import TEACHER_SENTINEL
from engine.sample import Sample
from engine.tasks.evaluators import MATH_SYSTEM_PROMPT
from tinylm.corpus import Dialogue
from tinylm.model import ModelSize, TrainSettings
from trainer.cli import build_parser, loop_config, train_on_stack
from trainer.loop import LoopConfig, lane_loss, train
from trainer.policy import Policy, load_model, tokenizer_vocab_size
from trainer.stack import start_stack


def hand_batch() -> dict[str, torch.Tensor]:
    """Two rows of 4 positions: prompt at 0, response at 1..3; row 1 is a removed dummy."""
    return {
        "tokens": torch.tensor([[5, 6, 7, 8], [0, 0, 0, 0]]),
        "loss_mask": torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]),
        "rollout_log_probs": torch.zeros(2, 4),
        "rewards": torch.tensor([1.0, 0.0]),
        "remove_sample": torch.tensor([False, True]),
        # position 1: a teacher token (sentinel), 2: tool output, 3: a student token
        "teacher_log_probs": torch.tensor([[0.0, 1.0, 0.0, math.log(0.25)], [0.0] * 4]),
        "action_mask": torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]),
        "is_teacher_mask": torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    }


def test_mixed_lane_trains_teacher_tokens_with_ce_and_student_tokens_with_k3() -> None:
    batch = hand_batch()
    s = torch.log(torch.full((2, 4), 0.5)).requires_grad_(True)
    out = lane_loss("mixed", s, batch, groups=torch.tensor([0, 1]))
    # row 0: CE at 1 (-log 1/2), K3 at 3 (teacher 1/4, student 1/2); tool output and the
    # removed row take no part
    k3_3 = 0.5 - math.log(0.5) - 1
    assert out.loss.item() == pytest.approx((math.log(2) + k3_3) / 2, rel=1e-5)
    assert (out.metrics["ce_tokens"], out.metrics["k3_tokens"]) == (1.0, 1.0)


def test_opd_lane_reads_the_action_mask_and_skips_removed_rows() -> None:
    batch = hand_batch()
    s = torch.log(torch.full((2, 4), 0.5))
    out = lane_loss("opd", s, batch, groups=torch.tensor([0, 1]))
    # only row 0 position 3 (the sentinel at 1 is off the action mask)
    assert out.loss.item() == pytest.approx(0.5 - math.log(0.5) - 1, rel=1e-5)
    without_action = {k: v for k, v in batch.items() if k != "action_mask"}
    without_action["teacher_log_probs"] = torch.tensor([[0.0, -1.0, 0.0, -1.0], [0.0] * 4])
    out = lane_loss("opd", s, without_action, groups=torch.tensor([0, 1]))
    # falls back to loss_mask (positions 1 and 3 of row 0)
    per = math.exp(-1 - math.log(0.5)) - (-1 - math.log(0.5)) - 1
    assert out.loss.item() == pytest.approx(per, rel=1e-5)


def test_grpo_lane_normalizes_rewards_within_groups_of_kept_rows() -> None:
    batch = hand_batch()
    batch["rewards"] = torch.tensor([1.0, 0.0])
    batch["remove_sample"] = torch.tensor([False, False])
    s = torch.zeros(2, 4, requires_grad=True)
    out = lane_loss("grpo", s, batch, groups=torch.tensor([3, 3]),
                    reference_log_probs=torch.zeros(2, 4))
    # advantages +1 / -1 (mean 0.5, std 0.5); ratio 1: -(1 * 2 tokens - 1 * 3 tokens) / 5
    assert out.loss.item() == pytest.approx(1 / 5, rel=1e-5)
    assert out.metrics["kl"] == pytest.approx(0.0)
    assert out.metrics["signal_groups"] == 1.0
    same = lane_loss("grpo", s, {**batch, "rewards": torch.tensor([1.0, 1.0])},
                     groups=torch.tensor([3, 3]))
    assert same.metrics["signal_groups"] == 0.0 and same.loss.item() == 0.0


def test_a_lane_without_its_tensors_names_what_is_missing() -> None:
    batch = {k: v for k, v in hand_batch().items()
             if k not in ("is_teacher_mask", "action_mask")}
    with pytest.raises(ConfigError, match="action_mask, is_teacher_mask"):
        lane_loss("mixed", torch.zeros(2, 4), batch, groups=torch.tensor([0, 1]))


def test_a_wait_ends_with_the_error_of_a_stack_process_that_died() -> None:
    from engine.errors import EngineError
    from trainer.loop import watched

    async def scenario() -> tuple[bool, int]:
        never = asyncio.get_running_loop().create_future()
        checks = []

        def check_alive() -> None:
            checks.append(1)
            if len(checks) == 2:
                raise EngineError("worker-0 exited with status 2")

        with pytest.raises(EngineError, match="worker-0 exited"):
            await watched(never, check_alive, every_s=0.01)
        return never.cancelled(), len(checks)

    cancelled, checks = asyncio.run(scenario())
    assert cancelled and checks == 2  # the wait was cancelled, not left running
    assert asyncio.run(watched(asyncio.sleep(0, result=7), lambda: None)) == 7


class ReadyRollouts:
    """A rollout source that hands out the same samples for every request (the loop's
    ``Rollouts``), recording what was asked."""

    def __init__(self, samples: list[Sample]) -> None:
        self.samples = samples
        self.requests: list[dict[str, object]] = []

    async def request(self, **params: object) -> str:
        self.requests.append(params)
        return f"r{len(self.requests)}"

    async def wait_load(
        self, rollout_id: str, timeout: float | None = None
    ) -> tuple[RolloutReady, list[Sample]]:
        ids = [f"{rollout_id}-{s.index}" for s in self.samples]
        return RolloutReady(rollout_id=rollout_id, sample_ids=ids), self.samples


class Published:
    def __init__(self) -> None:
        self.versions: list[int] = []

    async def publish(self, version: int, weights_uri: str) -> None:
        self.versions.append(version)


@pytest.fixture(scope="module")
def tiny_student(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("corrections") / "student"
    init_model(model, seed=0, train_steps=0)
    return model


# Per response token: the sampler's logprob is the trainer's minus log of these ratios
# (trainer / sampler), and the version that sampled it (0: the trainer's, -1: unknown).
RATIOS = (1.0, 3.0, 8.0, 0.25)
VERSIONS = (0, -1, -1, 0)


@pytest.fixture(scope="module")
def off_policy_samples(tiny_student: Path) -> list[Sample]:
    """Two groups of two samples of 3 prompt + 4 response tokens whose rollout logprobs put
    the trainer's ratios at ``RATIOS``: 3 and 8 over the cap 2, 8 and 1/4 outside ICEPOP's
    band [0.5, 5]."""
    def sample(i: int, **arrays: object) -> Sample:
        return Sample(index=i, group_index=i // 2, tokens=[5, 6, 7, 10 + i, 20 + i, 30, 40],
                      response_length=4, loss_mask=[1, 1, 1, 1], reward=float(i % 2),
                      **arrays)  # type: ignore[arg-type]

    with torch.no_grad():
        bare = collate([sample(i) for i in range(4)])
        trainer = Policy(tiny_student, lr=1e-3, seed=0).log_probs(bare)
    return [sample(i, rollout_log_probs=[float(trainer[i, 3 + t]) - math.log(RATIOS[t])
                                         for t in range(4)],
                   token_versions=list(VERSIONS)) for i in range(4)]


@pytest.mark.parametrize(
    ("flags", "truncated", "masked"),
    [
        ([], 0.0, 0.0),
        (["--correction", "tis"], 0.5, 0.0),
        (["--correction", "tis", "--correction-level", "sequence"], 1.0, 0.0),
        (["--correction", "mis", "--is-cap", "2"], 0.0, 0.5),
        (["--correction", "icepop", "--icepop-band", "0.5,5"], 0.0, 0.5),
        (["--decoupled", "--correction", "tis"], 0.5, 0.0),
    ],
)
def test_a_training_step_with_each_correction_reports_its_metrics(
    tiny_student: Path, off_policy_samples: list[Sample], tmp_path: Path, flags: list[str],
    truncated: float, masked: float,
) -> None:
    args = build_parser().parse_args(["--algorithm", "grpo", "--iterations", "1",
                                      "--no-eval", "--steps-per-rollout", "2", *flags])
    config = loop_config(args)
    rollouts, published = ReadyRollouts(off_policy_samples), Published()
    rows = asyncio.run(train(rollouts, Policy(tiny_student, lr=1e-3, seed=0), published, config,
                             weights_dir=tmp_path / "weights", pad_token_id=0,
                             on_row=lambda row: None))
    (row,) = rows
    assert published.versions == [1] and rollouts.requests[0]["algorithm"] == "grpo"
    assert row["correction"] == f"{args.correction}/{args.correction_level}"
    assert row["decoupled"] is args.decoupled
    # Every share over the 16 response tokens: the decoupled proximal policy takes the
    # rollout's value on the version-0 tokens (ratios 1 and 1/4 there become 1), the others
    # keep the trainer's; a sequence's product (6) exceeds the cap on all its tokens.
    assert row["is_truncated"] == pytest.approx(truncated)
    assert row["is_masked"] == pytest.approx(masked)
    kl = sum(r - math.log(r) - 1 for r in RATIOS) / 4
    assert row["mismatch_kl"] == pytest.approx(kl, rel=1e-4)
    assert 0.0 < row["is_ess"] <= 1.0 and math.isfinite(row["loss"]) and row["tokens"] == 16


def test_a_correction_outside_grpo_or_out_of_range_fails_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="applies to grpo"):
        loop_config(build_parser().parse_args(["--algorithm", "opd", "--correction", "tis"]))
    with pytest.raises(ConfigError, match="cap must be"):
        loop_config(build_parser().parse_args(["--correction", "mis", "--is-cap", "0.5"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--icepop-band", "0.5"])
    assert LoopConfig(algorithm="grpo", iterations=1,
                      correction=Correction("icepop")).corrected


def server_log_probs(url: str, tokens: list[int]) -> list[float]:
    reply = httpx.post(url + "/generate", json={
        "input_ids": tokens, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0,
    }, timeout=120).json()
    return [e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]]


async def control_policy(url: str) -> ControlState:
    client = RolloutClient.connect(url, producer="test")
    try:
        return await client.policy_state()
    finally:
        await client.aclose()


def command_lines() -> list[bytes]:
    """Every running process's ``/proc/PID/cmdline``."""
    found = []
    for path in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            found.append(path.read_bytes())
        except OSError:
            continue  # exited meanwhile
    return found


async def registrations(url: str) -> list[tuple[str, str, str]]:
    """(supervisor, role, endpoint) of each ``ServerRegistered`` on ``rl:control``."""
    client = RolloutClient.connect(url, producer="test")
    try:
        envs = await client.log.read_all(client.log.names.control)
    finally:
        await client.aclose()
    return [(e.event.supervisor, e.event.role, e.event.endpoint)
            for e in envs if isinstance(e.event, ServerRegistered)]


@pytest.mark.slow
@pytest.mark.redis_server
def test_one_opd_iteration_changes_the_served_weights_and_writes_metrics(
    tmp_path: Path,
) -> None:
    # Same seed, hence the same tokenizer; a different width, hence different weights, so
    # the K3 gradient is not zero. No training: the fixtures build in seconds.
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    init_model(student, seed=0, train_steps=0)
    init_model(teacher, seed=0, train_steps=0,
               size=ModelSize(hidden_size=64, intermediate_size=192))
    workdir = tmp_path / "run"
    args: argparse.Namespace = build_parser().parse_args([
        "--algorithm", "opd", "--iterations", "1", "--prompts", "2",
        "--samples-per-prompt", "2", "--no-eval", "--datasets", "math_train",
        "--lr", "1e-2", "--timeout", "240",
    ])
    stack = start_stack(workdir, student_dir=student, teacher_dir=teacher)
    try:
        probe = list(range(3, 40))
        before = server_log_probs(stack.policy_url, probe)
        summary = asyncio.run(train_on_stack(args, stack, student, teacher, workdir))
        after = server_log_probs(stack.policy_url, probe)
        served = httpx.get(stack.policy_url + "/get_weight_version", timeout=30).json()
        policy = asyncio.run(control_policy(stack.trainer_url))
        servers = asyncio.run(registrations(stack.trainer_url))
        argvs = command_lines()
        sync_log = (workdir / "logs" / "sync.log").read_text()
    finally:
        stack.stop()

    # Each model server is run by its own rollout serve and registered on rl:control, where
    # the workers and the syncer found the student's (they were given no URL).
    assert servers == [("train-serve", "policy", stack.policy_url),
                       ("train-serve-teacher", "teacher", stack.teacher_url)]
    assert (workdir / "logs" / "policy-0.log").is_file()
    assert (workdir / "logs" / "teacher-0.log").is_file()
    assert not [a for a in argvs if stack.admin_key.encode() in a]  # the key is in no argv
    assert any(b"--admin-api-key-file" in a for a in argvs)  # the server read it from a file

    # The version went through the policy-version API: the syncer (which holds the admin
    # key, from its file) loaded it and recorded PolicyVersionActivated on control.
    assert policy.published == 1 and policy.failure is None
    assert policy.activated is not None and policy.activated.version == 1
    assert policy.activated.weights_uri == str((workdir / "weights" / "v1").resolve())
    assert policy.activated.servers == [stack.policy_url]
    assert served["weight_version"] == "1"
    assert "version 1 active" in sync_log
    assert stack.secrets_dir is None  # the key file is gone with the stack

    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["iteration"] == 0 and row["published_version"] == 1
    assert row["samples"] == 4 and row["kl"] > 0 and row["tokens"] > 0
    assert summary["algorithm"] == "opd" and summary["kl_first"] == row["kl"]
    # The server now serves the published version: other logprobs for the same tokens, and
    # the ones torch computes from the saved folder.
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
    saved = load_model(workdir / "weights" / "v1")
    with torch.no_grad():
        ids = torch.tensor([probe])
        logits = saved(input_ids=ids).logits
        mine = token_log_probs(logits, ids, vocab_size=tokenizer_vocab_size(student))
    mine_list = mine[0, 1:].tolist()
    assert max(abs(a - b) for a, b in zip(mine_list, after, strict=True)) < 1e-4


@pytest.mark.slow
def test_publishing_to_a_server_that_refuses_names_the_server_and_its_answer(
    tmp_path: Path,
) -> None:
    from tinylm.cli import ADMIN_KEY_ENV
    from tinylm.process import spawn_server
    from trainer.publish import DiskPushPublisher, PublishFailed

    model = tmp_path / "model"
    init_model(model, seed=0, train_steps=0)
    with spawn_server(model, env={ADMIN_KEY_ENV: "the-admin-key"}) as server:
        wrong_key = DiskPushPublisher([server.url], admin_key="not-the-key")
        with pytest.raises(PublishFailed, match=rf"{server.url}.*answered 401"):
            asyncio.run(wrong_key.publish(1, str(model)))
        right_key = DiskPushPublisher([server.url], admin_key="the-admin-key")
        with pytest.raises(PublishFailed, match=r"answered 400: Failed to get weights"):
            asyncio.run(right_key.publish(1, str(tmp_path / "missing")))
        asyncio.run(right_key.publish(7, str(model)))
        info = httpx.get(server.url + "/get_weight_version", timeout=30).json()
    assert info["weight_version"] == "7"


def math_episode(question: str, expression: str, answer: str) -> Dialogue:
    """A ``math`` agent episode written as the agent renders it (tests/agents/conftest.py)."""
    return Dialogue(
        messages=[
            {"role": "system", "content": MATH_SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": "", "tool_calls": [{
                "type": "function",
                "function": {"name": "python", "arguments": {"code": f"print({expression})"}},
            }]},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"The answer is <answer>{answer}</answer>"},
        ],
        tools=[PythonTool().schema()],
    )


async def rollout_masks(url: str, rollout_id: str) -> tuple[int, int, int]:
    """Teacher tokens, student action tokens and positions with the sentinel, over the
    rollout's samples as ``collate`` gives them to the trainer."""
    client = RolloutClient.connect(url, producer="test")
    try:
        samples = [s for s in await client.load(rollout_id) if s.teacher_log_probs is not None]
    finally:
        await client.aclose()
    batch = collate(samples)
    teacher = batch["is_teacher_mask"].bool()
    sentinel = batch["teacher_log_probs"].eq(TEACHER_SENTINEL) & batch["loss_mask"].bool()
    return int(teacher.sum()), int(batch["action_mask"].sum()), int(sentinel.sum())


@pytest.mark.slow
@pytest.mark.redis_server
def test_one_mixed_iteration_trains_teacher_tokens_with_ce_and_student_tokens_with_k3(
    tmp_path: Path,
) -> None:
    # The teacher is overfit on the episodes of the two prompts the rollout takes (the
    # first two of math_train), so its turn 0 (beta 1, t_max 1) is a well-formed tool call;
    # the untrained student acts on every later turn. Same seed and corpus: one tokenizer.
    episodes = [math_episode(*row) for row in (("Compute 38 plus 6.", "38 + 6", "44"),
                                               ("Compute 33 plus 30.", "33 + 30", "63"))]
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    init_model(student, seed=0, dialogues=episodes, train_steps=0)
    init_model(teacher, seed=0, dialogues=episodes, train=TrainSettings(
        steps=120, batch_size=1, learning_rate=5e-3, warmup_steps=3))
    workdir = tmp_path / "run"
    args: argparse.Namespace = build_parser().parse_args([
        "--algorithm", "mixed", "--iterations", "1", "--prompts", "2",
        "--samples-per-prompt", "2", "--no-eval", "--datasets", "math_train",
        "--dagger-beta", "1", "--dagger-t-max", "1", "--lr", "1e-2", "--timeout", "240",
    ])
    stack = start_stack(workdir, student_dir=student, teacher_dir=teacher, dagger=True)
    try:
        probe = list(range(3, 40))
        before = server_log_probs(stack.policy_url, probe)
        summary = asyncio.run(train_on_stack(args, stack, student, teacher, workdir))
        after = server_log_probs(stack.policy_url, probe)
        policy = asyncio.run(control_policy(stack.trainer_url))
        rows = [json.loads(line)
                for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        teacher_tokens, student_tokens, sentinels = asyncio.run(
            rollout_masks(stack.trainer_url, rows[0]["rollout_id"]))
    finally:
        stack.stop()

    assert len(rows) == 1 and summary["algorithm"] == "mixed"
    row = rows[0]
    assert row["samples"] == 4 and row["aborted"] == 0
    # Both kernels ran, each on exactly the lane's positions: CE on every teacher token
    # (the sentinel's), K3 on every student action token.
    assert teacher_tokens > 0 and student_tokens > 0
    assert sentinels == teacher_tokens
    assert (row["ce_tokens"], row["k3_tokens"]) == (teacher_tokens, student_tokens)
    assert row["ce"] > 0 and row["kl"] >= 0 and math.isfinite(row["loss"])
    # The step was published through the syncer and the server serves it.
    assert policy.activated is not None and policy.activated.version == 1
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3
