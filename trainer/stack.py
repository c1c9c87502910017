"""The processes a training run needs on one machine, started and stopped together.

``start_stack`` uses the demo's ``engine.ops.demo.Stack``: an authenticated embedded Redis (or
the caller's URL), the student's tinylm server with a fresh admin key, the scheduler,
evaluator workers, a finalizer on the bundled tasks and the weight syncer (``rollout sync``: it
loads each published policy version on the student's server), and, when a teacher is given,
the teacher's tinylm server and a capture worker that force-decodes kept samples on it; for
``mixed``, workers whose agents roll in the teacher (``trainer.dagger``).

Every process is started by the engine's launcher (``engine.ops.processes``, through the
``rollout`` command), its settings in its environment. Each model server is run by its own
``rollout serve`` (the student's as a policy server, the teacher's as a teacher), which
restarts it if it exits (the student's at the active policy version) and registers it on
``rl:control``: the workers and the syncer find the student's there, the teacher's URL is
handed to the capture worker. The admin key is written to a file (mode 0600, in a private
folder removed when the stack stops) that the student's server reads
(``--admin-api-key-file``) and so does the syncer (``ROLLOUT_SGLANG_ADMIN_KEY_FILE``); the
trainer process keeps it too, for its one direct load outside the policy versions (the
teacher's eval pass, ``trainer.cli``); the evaluator workers, whose sandboxes run
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

__all__ = ["ROLLOUT", "TrainStack", "ensure_model", "start_stack"]

ROLLOUT = ("-m", "workers")
"""How the stack runs the ``rollout`` command (``workers.cli.ROLLOUT``, a sibling of this
package that it does not import): the engine's processes and the model servers start so."""


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
        key_file = str(_write_key(train))
        train.policy_url = stack.serve("serve", student_dir, "--admin-api-key-file", key_file,
                                       supervisor="train-serve")
        say(f"policy    tinylm server at {train.policy_url}, run by rollout serve (admin key: "
            "the syncer and the trainer)")
        found = {"servers_from_log": True}  # the student's server, registered on rl:control
        worker: dict[str, object] = {"evaluator_config": EVALUATORS}
        if teacher_dir is not None:
            train.teacher_url = stack.serve("serve-teacher", teacher_dir, role="teacher",
                                            supervisor="train-serve-teacher")
            say(f"teacher   tinylm server at {train.teacher_url}, run by rollout serve")
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
                **worker, **found, "model_dir": student_dir, "worker_id": f"train-worker-{i}"})
        procs.start("finalizer", "finalizer", settings={
            "out_dir": workdir / "out", "worker_id": "train-finalizer"})
        procs.start("sync", "sync", settings={
            **found, "worker_id": "train-sync", "sglang_admin_key_file": key_file})
    except BaseException:
        train.stop()
        raise
    return train
