"""The processes a training run needs on one machine, started and stopped together.

``start_stack`` uses the demo's ``engine.ops.demo.Stack``: an authenticated embedded Redis (or
the caller's URL), the student's tinylm server started with a fresh admin key, the scheduler,
evaluator workers, a finalizer on the bundled tasks and the weight syncer (``rollout sync``: it
loads each published policy version on the student's server), and, when a teacher is given,
the teacher's tinylm server and a capture worker that force-decodes kept samples on it; for
``mixed``, workers whose agents roll in the teacher (``trainer.dagger``).

Every process is started by the engine's launcher (``engine.ops.processes``, through the
``rollout`` command), its settings in its environment. The admin key goes to the syncer in a
file (``ROLLOUT_SGLANG_ADMIN_KEY_FILE``, mode 0600, in a private folder removed when the stack
stops) and to the trainer process itself, for its one direct load outside the policy versions
(the teacher's eval pass, ``trainer.cli``); the evaluator workers, whose sandboxes run
model-written code, never see it.

Models (``ensure_models``): the student and the teacher are tinylm models built from the same
seed, hence the same tokenizer (the teacher force-decodes the student's token ids), trained
for different numbers of steps: the teacher longer, so it is the stronger policy.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ConfigError
from engine.ops.demo import EVALUATORS, ROLLOUT_YAML, Stack, say
from engine.ops.embedded import redact
from engine.ops.tinylm import init_model

__all__ = ["ADMIN_KEY_ENV", "ROLLOUT", "TrainStack", "ensure_model", "start_stack"]

ROLLOUT = ("-m", "workers")
"""How the stack runs the ``rollout`` command (``workers.cli.ROLLOUT``, a sibling of this
package that it does not import): the engine's processes and the model servers start so."""

ADMIN_KEY_ENV = "TINYLM_ADMIN_API_KEY"
"""Where ``rollout tinylm serve`` reads its admin key (tinylm.cli; never argv)."""


@dataclass
class TrainStack:
    """The demo's ``Stack`` plus the student server's admin key and the teacher's URL."""

    stack: Stack
    policy_url: str
    admin_key: str
    teacher_url: str | None = None
    secrets_dir: Path | None = None  # holds the admin key file; removed by stop()

    @property
    def trainer_url(self) -> str:
        return self.stack.trainer_url

    def check_alive(self) -> None:
        self.stack.check_alive()

    def stop(self) -> None:
        try:
            self.stack.stop()
        finally:
            if self.secrets_dir is not None:
                shutil.rmtree(self.secrets_dir, ignore_errors=True)
                self.secrets_dir = None


def ensure_model(model_dir: Path, *, steps: int, seed: int = 0) -> Path:
    """A tinylm trained for ``steps`` steps in ``model_dir`` (built once, then reused)."""
    if (model_dir / "config.json").is_file():
        return model_dir
    say(f"model     building tinylm ({steps} training steps) into {model_dir}")
    report = init_model(model_dir, seed=seed, train_steps=steps)
    say(f"model     built in {report.seconds:.0f}s, final loss {report.final_loss}")
    return model_dir


def _write_key(train: TrainStack) -> Path:
    """The admin key in a file only this user can read, in a fresh private folder."""
    train.secrets_dir = Path(tempfile.mkdtemp(prefix="rollout-trainer-"))  # mode 0700
    path = train.secrets_dir / "sglang-admin.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(train.admin_key + "\n")
    return path


def same_tokenizer(a: Path, b: Path) -> None:
    """Refuse a teacher whose tokenizer differs from the student's: force-decoding the
    student's token ids on it would score other strings."""
    ta, tb = a / "tokenizer.json", b / "tokenizer.json"
    if not (ta.is_file() and tb.is_file()) or ta.read_bytes() != tb.read_bytes():
        raise ConfigError(
            f"the teacher {b} and the student {a} must share one tokenizer (tokenizer.json "
            "differs or is missing): build both with the same seed"
        )


def start_stack(
    workdir: Path,
    *,
    student_dir: Path,
    teacher_dir: Path | None,
    workers: int = 1,
    redis_url: str | None = None,
    dagger: bool = False,
) -> TrainStack:
    """Start everything (see the module docstring). ``dagger``: the workers run DAgger agents
    that roll in the teacher (``trainer.dagger``; needs ``teacher_dir``)."""
    if dagger and teacher_dir is None:
        raise ConfigError("DAgger workers need a teacher model")
    if teacher_dir is not None:
        same_tokenizer(student_dir, teacher_dir)
    (workdir / "out").mkdir(parents=True, exist_ok=True)
    stack = Stack.open(workdir, rollout=ROLLOUT, redis_url=redis_url)
    train = TrainStack(stack, policy_url="", admin_key=secrets.token_urlsafe(24))
    try:
        say(f"redis     {redact(stack.redis_url)}")
        procs = stack.processes
        train.policy_url = procs.serve_tinylm(
            "tinylm", student_dir, env={ADMIN_KEY_ENV: train.admin_key}).url
        say(f"policy    tinylm server at {train.policy_url} (admin key: the syncer and "
            "the trainer)")
        worker: dict[str, object] = {"evaluator_config": EVALUATORS}
        if teacher_dir is not None:
            train.teacher_url = procs.serve_tinylm("teacher", teacher_dir).url
            say(f"teacher   tinylm server at {train.teacher_url}")
            teacher = {"teacher_url": train.teacher_url, "teacher_tokenizer": teacher_dir}
            procs.start("capture", "capture", settings={**teacher, "worker_id": "train-capture"})
            if dagger:  # the workers' own teacher port, for DAgger turns
                from trainer.dagger import DAGGER_CONFIG

                worker = {"evaluator_config": DAGGER_CONFIG, **teacher}
        # The scheduler reads only the profiles, the bundled ones either way.
        procs.start("scheduler", "scheduler", settings={
            "config": ROLLOUT_YAML, "evaluator_config": EVALUATORS, "worker_id": "train-sched"})
        for i in range(workers):
            procs.start(f"worker-{i}", "worker", settings={
                **worker, "model_dir": student_dir, "sglang_url": train.policy_url,
                "worker_id": f"train-worker-{i}"})
        procs.start("finalizer", "finalizer", settings={
            "out_dir": workdir / "out", "worker_id": "train-finalizer"})
        procs.start("sync", "sync", settings={
            "sglang_url": train.policy_url, "worker_id": "train-sync",
            "sglang_admin_key_file": _write_key(train)})
    except BaseException:
        train.stop()
        raise
    return train
