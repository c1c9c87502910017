"""The ``swe`` task type: a tiny repository with a failing test, fixed by an installed scaffold.

Each task is a repository of POSIX ``sh`` files (runnable in a local sandbox and a bare busybox
container alike) with one planted bug, an issue reporting the symptom with a hint, and a test
script; the reward is whether the test passes after the scaffold's edits. A dataset line
(``data/swe_*.jsonl``, from :func:`write_dataset`)::

    {"id": "swe-0-3", "prompt": "<the issue>",
     "label": {"repo": {"calc.sh": "...", "test.sh": "..."}, "test": "test.sh",
               "fix": {"file": "calc.sh", "old": "...", "new": "..."}}}

The scaffold never sees the label; ``label.fix`` serves the format corpus and the tests. Bugs
are a wrong operator, a misspelt greeting or a constant one off, drawn from
``random.Random(seed)``. ``SweTask`` is the ``InstalledTask`` side: ``verify`` restores the
test file (the scaffold may not change it) and runs it.
"""

from __future__ import annotations

import json
import random
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.agents.result import Reward
from engine.domain import Task
from engine.errors import ConfigError
from engine.sandbox import ExecOutcome, Sandbox, classify

__all__ = ["SweItem", "SweTask", "generate_items", "repo_of", "write_dataset"]

DATA = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True, kw_only=True)
class SweItem:
    """One generated task: its id, issue, files, test file and the planted bug's fix."""

    id: str
    issue: str
    repo: dict[str, str]
    test: str
    fix_file: str
    old: str
    new: str

    def line(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt": self.issue,
            "label": {
                "repo": self.repo,
                "test": self.test,
                "fix": {"file": self.fix_file, "old": self.old, "new": self.new},
            },
        }


_NAMES = ["Ann", "Bob", "Cleo", "Dan", "Eve", "Finn", "Gus", "Ida", "Jo", "Kim", "Lea", "Max"]
_WORDS = ["Hello", "Welcome", "Greetings", "Goodbye", "Thanks", "Cheers"]
_CONSTANTS = ["limit", "width", "retries", "depth", "size", "count"]


def _test_script(cases: list[tuple[str, str]], source: str) -> str:
    lines = ["#!/bin/sh", f". ./{source}", "fail=0"]
    for call, expected in cases:
        q = shlex.quote(expected)
        lines.append(
            f'got="$({call})"; [ "$got" = {q} ] || '
            f'{{ echo "FAIL: {call} printed $got, expected "{q}; fail=1; }}'
        )
    lines += ['[ "$fail" = 0 ] && echo PASS', 'exit "$fail"']
    return "\n".join(lines) + "\n"


def _operator(rng: random.Random, n: int) -> SweItem:
    name, good, bad = rng.choice([("sum", "+", "-"), ("diff", "-", "+")])
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    right = a + b if good == "+" else a - b
    wrong = a - b if good == "+" else a + b
    source = "calc.sh"
    body = f"{name}() {{ echo $(($1 {bad} $2)); }}\n"
    other = "double() { echo $(($1 * 2)); }\n"
    repo = {
        source: "# small arithmetic helpers\n" + body + other,
        "test.sh": _test_script([(f"{name} {a} {b}", str(right)), ("double 4", "8")], source),
    }
    issue = (
        f"`{name} {a} {b}` prints {wrong} but should print {right}.\n"
        f"Hint: in {source}, `$1 {bad} $2` should be `$1 {good} $2`.\n"
        "Run `sh test.sh` to check."
    )
    return SweItem(id=f"swe-{n}", issue=issue, repo=repo, test="test.sh", fix_file=source,
                   old=f"$1 {bad} $2", new=f"$1 {good} $2")  # fmt: skip


def _word(rng: random.Random, n: int) -> SweItem:
    word = rng.choice(_WORDS)
    cut = rng.randrange(1, len(word) - 1)
    typo = word[:cut] + word[cut + 1 :]
    who = rng.choice(_NAMES)
    source = "greet.sh"
    repo = {
        source: f'greet() {{ echo "{typo}, $1!"; }}\n',
        "test.sh": _test_script([(f"greet {who}", f"{word}, {who}!")], source),
    }
    issue = (
        f"`greet {who}` prints `{typo}, {who}!` but should print `{word}, {who}!`.\n"
        f"Hint: in {source}, `{typo}` should be `{word}`.\n"
        "Run `sh test.sh` to check."
    )
    return SweItem(id=f"swe-{n}", issue=issue, repo=repo, test="test.sh", fix_file=source,
                   old=typo, new=word)  # fmt: skip


def _constant(rng: random.Random, n: int) -> SweItem:
    name = rng.choice(_CONSTANTS)
    right = rng.randint(3, 60)
    wrong = right + rng.choice([-1, 1])
    source = "config.sh"
    repo = {
        source: f"{name}() {{ echo {wrong}; }}\n",
        "test.sh": _test_script([(name, str(right))], source),
    }
    issue = (
        f"`{name}` prints {wrong} but should print {right}.\n"
        f"Hint: in {source}, `echo {wrong}` should be `echo {right}`.\n"
        "Run `sh test.sh` to check."
    )
    return SweItem(id=f"swe-{n}", issue=issue, repo=repo, test="test.sh", fix_file=source,
                   old=f"echo {wrong}", new=f"echo {right}")  # fmt: skip


_FAMILIES = [_operator, _word, _constant]


def generate_items(n: int, *, seed: int) -> list[SweItem]:
    """``n`` tasks cycling through the bug families, deterministic in ``seed``."""
    rng = random.Random(seed)
    items = [_FAMILIES[i % len(_FAMILIES)](rng, i) for i in range(n)]
    return [
        SweItem(**{**item.__dict__, "id": f"swe-{seed}-{i}"}) for i, item in enumerate(items)
    ]


def fix_command(item: SweItem) -> str:
    """The one-line edit that fixes ``item`` (what the format corpus teaches)."""
    return f"sed -i 's/{item.old}/{item.new}/' {item.fix_file}"


def write_dataset(path: Path, n: int, *, seed: int) -> None:
    """Write ``n`` generated tasks as JSONL (the bundled files come from this)."""
    lines = [json.dumps(item.line(), sort_keys=True) for item in generate_items(n, seed=seed)]
    path.write_text("\n".join(lines) + "\n")


def repo_of(task: Task) -> tuple[dict[str, str], str]:
    """The task's files and its test file; ``ConfigError`` naming a malformed task."""
    label = task.label
    where = (
        f"swe task {task.sample_id} (dataset {task.dataset_name!r}, line {task.source_line})"
    )
    if not isinstance(label, Mapping):
        raise ConfigError(f"{where}: the label must be an object with 'repo' and 'test'")
    repo, test = label.get("repo"), label.get("test")
    if not isinstance(repo, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in repo.items()
    ):
        raise ConfigError(f"{where}: label.repo must map file paths to their text")
    if not isinstance(test, str) or test not in repo:
        raise ConfigError(f"{where}: label.test must name one of the repo's files, got {test!r}")
    return {str(k): str(v) for k, v in repo.items()}, test


@dataclass(frozen=True, kw_only=True)
class SweTask:
    """The ``swe`` task for ``InstalledAgent``."""

    test_timeout_s: float = 30.0

    def instruction(self, task: Task) -> str:
        if not isinstance(task.prompt, str):
            raise ConfigError(f"swe task {task.sample_id}: the prompt must be the issue text")
        return task.prompt

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        repo, _ = repo_of(task)
        for path, text in sorted(repo.items()):
            await sandbox.write_file(path, text)

    async def collect(self, task: Task, sandbox: Sandbox) -> dict[str, str]:
        repo, _ = repo_of(task)
        out: dict[str, str] = {}
        for path in sorted(repo):
            try:
                out[path] = (await sandbox.read_file(path)).decode(errors="replace")
            except FileNotFoundError:
                out[path] = "<deleted>"
            except OSError as exc:
                out[path] = f"<unreadable: {exc}>"
        return out

    async def verify(self, task: Task, sandbox: Sandbox) -> Reward:
        repo, test = repo_of(task)
        await sandbox.write_file(test, repo[test])  # the scaffold may not edit the test
        result = await sandbox.exec(f"sh {shlex.quote(test)}", timeout_s=self.test_timeout_s)
        passed = classify(result) is ExecOutcome.OK
        return {"score": 1.0 if passed else 0.0, "test_exit_code": float(result.exit_code)}
