"""``python -m trainer``: train the tiny student on the bundled tasks through the engine.

    python -m trainer --algorithm grpo --iterations 30
    python -m trainer --algorithm opd --iterations 60 --steps-per-rollout 2
    python -m trainer --algorithm grpo --correction tis --is-cap 2 --decoupled

Builds (once, into ``--models-dir``) a student tinylm trained for ``--student-steps`` and,
for ``opd`` / ``mixed`` or ``--teacher-eval``, a teacher trained for ``--teacher-steps`` from
the same seed (same tokenizer, more training: the stronger policy); starts the stack
(``trainer.stack``); measures the teacher's eval reward by loading its weights on the policy
server for one eval pass (then the student's back); trains (``trainer.loop``); writes
``metrics.jsonl``, ``summary.json`` and ``curves.png`` into ``--workdir`` and stops every
process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.client import RolloutClient
from engine.errors import ConfigError, EngineError
from engine.losses import CORRECTION_LEVELS, CORRECTION_MODES, Correction
from engine.ops.demo import say
from trainer.loop import ALGORITHMS, TEACHER_ALGORITHMS, LoopConfig, evaluate, train
from trainer.policy import FrozenModel, Policy
from trainer.publish import DiskPushPublisher, VersionPublisher
from trainer.report import MetricsWriter, plot
from trainer.stack import TrainStack, ensure_model, start_stack

__all__ = ["build_parser", "loop_config", "main", "run", "stop_on_signals", "train_on_stack"]

KL_LABELS = {
    "grpo": "KL(policy || initial policy), K3 on sampled tokens",
    "opd": "KL(student || teacher), K3 on student tokens",
    "mixed": "KL(student || teacher), K3 on student tokens",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Reference trainer: GRPO, OPD or mixed CE/K3 on the bundled tasks, on CPU.",
    )
    p.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="grpo")
    p.add_argument("--iterations", type=int, default=20, help="rollout + update iterations")
    p.add_argument("--workdir", type=Path, default=None,
                   help="metrics, plot, weights and logs (default runs/train-<algorithm>)")
    p.add_argument("--models-dir", type=Path, default=Path("runs/train-models"),
                   help="where the student and teacher models are built once and reused")
    p.add_argument("--student-steps", type=int, default=450,
                   help="tinylm training steps of the student (weaker than the teacher)")
    p.add_argument("--teacher-steps", type=int, default=1200,
                   help="tinylm training steps of the teacher")
    p.add_argument("--student-model", type=Path, default=None,
                   help="use this model folder as the student instead of building one")
    p.add_argument("--teacher-model", type=Path, default=None,
                   help="use this model folder as the teacher instead of building one")
    p.add_argument("--teacher-eval", action="store_true",
                   help="also measure the teacher's eval reward for grpo (opd/mixed always do)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per training rollout")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="GRPO group size")
    p.add_argument("--datasets", default=None,
                   help="comma-separated training datasets (default: all, FIFO)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--steps-per-rollout", type=int, default=1,
                   help="optimizer steps on each rollout's batch (PPO epochs)")
    p.add_argument("--correction", choices=CORRECTION_MODES, default="none",
                   help="grpo: off-policy correction of the policy-gradient term "
                        "(docs/trainers.md, Off-policy corrections)")
    p.add_argument("--correction-level", choices=CORRECTION_LEVELS, default="token",
                   help="grpo: importance weights per token or per sequence (their product)")
    p.add_argument("--is-cap", type=float, default=2.0,
                   help="grpo: the importance-weight cap C of tis (truncate) and mis (mask)")
    p.add_argument("--icepop-band", type=_band, default=(0.5, 5.0), metavar="LOW,HIGH",
                   help="grpo: icepop keeps tokens whose ratio lies in [LOW, HIGH]")
    p.add_argument("--decoupled", action="store_true",
                   help="grpo: decoupled PPO, the proximal policy's logprobs recomputed "
                        "before each update")
    p.add_argument("--eval-every", type=int, default=5,
                   help="eval pass every N iterations (and before the first, after the last)")
    p.add_argument("--eval-samples-per-prompt", type=int, default=4,
                   help="samples per eval prompt (the bundled eval sets have 14 prompts; "
                        "their own setting is 2, too few to see a change of 0.1)")
    p.add_argument("--no-eval", action="store_true",
                   help="skip every eval pass (the teacher's too): training iterations only")
    p.add_argument("--dagger-beta", type=float, default=0.5,
                   help="mixed: the teacher's per-turn probability (knob dagger_beta)")
    p.add_argument("--dagger-t-max", type=int, default=None,
                   help="mixed: the teacher acts only on turns below this (knob t_max; "
                        "default: no limit)")
    p.add_argument("--workers", type=int, default=1, help="evaluator worker processes")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads of the training step (default 1, as tinylm's server: "
                        "a tiny model loses to thread sync)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait per rollout")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    return p


def _band(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected LOW,HIGH (two numbers), got {text!r}"
        ) from None
    return low, high


def loop_config(args: argparse.Namespace) -> LoopConfig:
    """The loop's configuration from the command line; a ``ConfigError`` names a bad one."""
    try:
        correction = Correction(args.correction, level=args.correction_level, cap=args.is_cap,
                                band=args.icepop_band)
    except ValueError as exc:
        raise ConfigError(f"--correction {args.correction}: {exc}") from None
    return LoopConfig(
        algorithm=args.algorithm, iterations=args.iterations, n_prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt, clip_eps=args.clip_eps,
        steps_per_rollout=args.steps_per_rollout,
        seed=args.seed, eval_every=args.eval_every, eval_passes=not args.no_eval,
        eval_samples_per_prompt=args.eval_samples_per_prompt,
        timeout_s=args.timeout,
        datasets=args.datasets.split(",") if args.datasets else None,
        knobs=_knobs(args), correction=correction, decoupled=args.decoupled,
    )


def _models(args: argparse.Namespace) -> tuple[Path, Path | None]:
    models: Path = args.models_dir.resolve()
    student = (args.student_model or ensure_model(
        models / f"student-{args.student_steps}", steps=args.student_steps, seed=args.seed
    )).resolve()
    needs_teacher = args.algorithm in TEACHER_ALGORITHMS or args.teacher_eval
    if not needs_teacher:
        return student, None
    teacher = (args.teacher_model or ensure_model(
        models / f"teacher-{args.teacher_steps}", steps=args.teacher_steps, seed=args.seed
    )).resolve()
    return student, teacher


def _knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The request's knobs: the DAgger rollin's for ``mixed``, none otherwise."""
    if args.algorithm != "mixed":
        return {}
    knobs: dict[str, Any] = {"dagger_beta": args.dagger_beta}
    if args.dagger_t_max is not None:
        knobs["t_max"] = args.dagger_t_max
    return knobs


async def train_on_stack(
    args: argparse.Namespace, stack: TrainStack, student: Path, teacher: Path | None,
    workdir: Path,
) -> dict[str, Any]:
    client = RolloutClient.connect(stack.trainer_url, block_ms=500, producer="trainer")
    publisher = VersionPublisher(client, timeout_s=args.timeout)
    # Not policy versions: the teacher's eval pass loads weights on the server directly.
    direct = DiskPushPublisher([stack.policy_url], admin_key=stack.admin_key)
    metrics = MetricsWriter(workdir / "metrics.jsonl")
    began = time.monotonic()
    try:
        teacher_eval: float | None = None
        if teacher is not None and not args.no_eval:
            # Not a policy version: the teacher's weights visit the policy server for one
            # eval pass, then the student's initial weights come back.
            await direct.load(str(teacher), label="teacher")
            scores = await evaluate(client, iteration=0, version=0, seed=args.seed,
                                    timeout_s=args.timeout,
                                    samples_per_prompt=args.eval_samples_per_prompt,
                                    check_alive=stack.check_alive)
            teacher_eval = scores.get("eval_reward")
            say(f"teacher   eval reward {teacher_eval}")
            await direct.load(str(student), label="0")
        policy = Policy(student, lr=args.lr, seed=args.seed)
        reference = FrozenModel(student) if args.algorithm == "grpo" else None
        config = loop_config(args)

        def on_row(row: dict[str, Any]) -> None:
            metrics.write(row)
            shown = {k: row[k] for k in ("reward", "eval_reward", "kl", "loss") if k in row}
            say(f"iter {row['iteration']:>4}  " + "  ".join(
                f"{k} {v:.4f}" for k, v in shown.items()))

        rows = await train(
            client, policy, publisher, config, weights_dir=workdir / "weights",
            pad_token_id=int(policy.model.config.pad_token_id or 0), on_row=on_row,
            reference=reference, check_alive=stack.check_alive,
        )
    finally:
        metrics.close()
        await client.aclose()
    evals = [r["eval_reward"] for r in rows if "eval_reward" in r]
    trains = [r["reward"] for r in rows if "reward" in r]
    kls = [r["kl"] for r in rows if "kl" in r]
    summary = {
        "algorithm": args.algorithm,
        **({"correction": f"{config.correction.mode}/{config.correction.level}",
            "decoupled": config.decoupled} if args.algorithm == "grpo" else {}),
        "iterations": args.iterations,
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
        "teacher_eval_reward": teacher_eval,
        "train_reward_first": trains[0] if trains else None,
        "train_reward_last": trains[-1] if trains else None,
        "kl_first": kls[0] if kls else None,
        "kl_last": kls[-1] if kls else None,
        "student": str(student),
        "teacher": str(teacher) if teacher else None,
        "wall_s": round(time.monotonic() - began, 1),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = plot(rows, workdir / "curves.png", title=f"{args.algorithm}: {student.name}",
               teacher_eval_reward=teacher_eval, kl_label=KL_LABELS[args.algorithm])
    summary["plot"] = str(png) if png else None
    summary["metrics"] = str(workdir / "metrics.jsonl")
    if png is None:
        say("plot      skipped: matplotlib is missing (pip install 'rollout-engine[train]')")
    return summary


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run (models, stack, training); returns the summary. Stops what it started."""
    workdir: Path = (args.workdir or Path(f"runs/train-{args.algorithm}")).resolve()
    loop_config(args)  # a bad configuration fails before any model or process starts
    workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.torch_threads)
    student, teacher = _models(args)
    stack = start_stack(workdir, student_dir=student, teacher_dir=teacher,
                        workers=args.workers, redis_url=args.redis_url,
                        dagger=args.algorithm == "mixed")
    try:
        return asyncio.run(train_on_stack(args, stack, student, teacher, workdir))
    finally:
        stack.stop()


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGTERM and SIGINT end the run through ``KeyboardInterrupt``, so ``run`` stops every
    process it started. SIGINT too: a shell starts background jobs with it ignored."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_signals()
    try:
        summary = run(args)
    except KeyboardInterrupt:
        say("interrupted; every process stopped")
        return 130
    except (EngineError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    say(json.dumps(summary))
    return 0
