"""The sandbox contract, run against every backend (local always, Docker when a daemon answers).

Commands stick to what both a Debian host and the busybox test image have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from engine.errors import SandboxError, SandboxEscape, SandboxTimeout
from engine.sandbox import (
    MANAGED_LABEL,
    SANDBOX_ID_LABEL,
    ExecOutcome,
    KillReason,
    classify,
    raise_for_outcome,
)
from engine.sandbox.base import Sandbox, SandboxProvider
from tests.sandbox.conftest import TEST_LIMITS, Backend

GONE_CHECK = (
    'i=0; while kill -0 "$(cat {file})" 2>/dev/null && [ $i -lt 50 ]; do sleep 0.1; '
    'i=$((i+1)); done; kill -0 "$(cat {file})" 2>/dev/null && echo alive || echo gone'
)


async def assert_gone(sandbox: Sandbox, *pid_files: str) -> None:
    """Each file holds a pid from inside the sandbox; that process must be dead (not a zombie
    either: the sandbox's reaper collects orphans)."""
    for pid_file in pid_files:
        result = await sandbox.exec(GONE_CHECK.format(file=pid_file))
        assert result.stdout.strip() == "gone", (pid_file, result)


class TestSandboxContract:
    async def test_implements_the_protocols(self, backend: Backend, sandbox: Sandbox) -> None:
        assert isinstance(backend.provider, SandboxProvider)
        assert isinstance(sandbox, Sandbox)
        assert sandbox.labels[MANAGED_LABEL] == "1"
        assert sandbox.labels[SANDBOX_ID_LABEL] == sandbox.id
        assert sandbox.labels["rollout.test-run"] == backend.run_labels["rollout.test-run"]
        assert sandbox.limits == TEST_LIMITS

    async def test_echo_exit_codes_and_argv(self, sandbox: Sandbox) -> None:
        hello = await sandbox.exec("echo hello; echo oops >&2")
        assert (hello.exit_code, hello.stdout, hello.stderr) == (0, "hello\n", "oops\n")
        assert hello.ok and classify(hello) is ExecOutcome.OK and hello.killed_by is None

        failed = await sandbox.exec(["sh", "-c", "exit 3"])
        assert failed.exit_code == 3 and not failed.ok and failed.killed_by is None
        assert classify(failed) is ExecOutcome.NONZERO_EXIT

        argv = await sandbox.exec(["printf", "%s|", "a b", "$HOME", "c"])
        assert argv.stdout == "a b|$HOME|c|"  # no shell in between

    async def test_runs_in_the_workdir(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec("pwd; echo $HOME")
        assert result.stdout.split() == [sandbox.workdir, sandbox.workdir]

    async def test_command_not_found(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec(["no-such-command-anywhere"])
        assert result.exit_code in (126, 127) and not result.ok
        assert "no-such-command-anywhere" in result.stdout + result.stderr

    async def test_env_is_passed_and_the_workers_is_not(
        self, sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("ROLLOUT_TEST_SECRET", "s3cret-token")
        result = await sandbox.exec('echo "$FOO"; env', env={"FOO": "bar baz"})
        assert result.stdout.splitlines()[0] == "bar baz"
        assert "s3cret-token" not in result.stdout
        with pytest.raises(SandboxError, match="environment name"):
            await sandbox.exec("true", env={"A=B": "x"})

    async def test_stdin(self, sandbox: Sandbox) -> None:
        echoed = await sandbox.exec(["cat"], stdin=b"line one\nline\x00two")
        assert echoed.stdout == "line one\nline\x00two"
        text = await sandbox.exec("read a; echo got:$a", stdin="word\n")
        assert text.stdout == "got:word\n"
        big = await sandbox.exec(["wc", "-c"], stdin=b"x" * 300_000)
        assert big.stdout.strip() == "300000"
        none = await sandbox.exec(["cat"])
        assert none.stdout == "" and none.exit_code == 0

    async def test_output_is_truncated_to_the_limit(self, sandbox: Sandbox) -> None:
        limit = TEST_LIMITS.max_output_bytes
        result = await sandbox.exec(
            "head -c 100000 /dev/zero | tr '\\000' x; head -c 50000 /dev/zero | tr '\\000' y >&2"
        )
        assert result.exit_code == 0
        assert result.stdout == "x" * limit and result.stdout_truncated
        assert result.stderr == "y" * limit and result.stderr_truncated
        assert result.truncated
        small = await sandbox.exec("echo small")
        assert not small.truncated

    async def test_timeout_kills_the_command_and_its_descendants(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec(
            "sleep 991 & echo $! > bg.pid; setsid sleep 992 & echo $! > sid.pid; sleep 993",
            timeout_s=1,
        )
        assert result.timed_out and result.killed_by == KillReason.TIMEOUT
        assert classify(result) is ExecOutcome.TIMEOUT
        assert 0.5 < result.elapsed_s < 15
        with pytest.raises(SandboxTimeout, match="wall-clock"):
            raise_for_outcome(result, sandbox_id=sandbox.id, command="sleep")
        await assert_gone(sandbox, "bg.pid", "sid.pid")
        assert (await sandbox.exec("echo still usable")).stdout == "still usable\n"

    async def test_timeout_is_capped_by_the_limits(self, backend: Backend) -> None:
        limits = dataclasses.replace(TEST_LIMITS, wall_timeout_s=1)
        box = backend.create(limits=limits)
        await box.start()
        try:
            result = await box.exec("sleep 30", timeout_s=100)
            assert result.timed_out and result.elapsed_s < 15
            with pytest.raises(SandboxError, match="timeout_s"):
                await box.exec("true", timeout_s=0)
        finally:
            await box.stop()

    async def test_cancelled_exec_kills_its_processes(self, sandbox: Sandbox) -> None:
        task = asyncio.create_task(sandbox.exec("sleep 994 & echo $! > c.pid; wait"))
        for _ in range(200):
            with contextlib.suppress(SandboxError):
                if (await sandbox.read_file("c.pid")).strip():
                    break
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_gone(sandbox, "c.pid")

    async def test_background_process_outlives_its_exec(self, sandbox: Sandbox) -> None:
        started = await sandbox.exec("sleep 995 >/dev/null 2>&1 & echo $! > keep.pid")
        assert started.exit_code == 0
        alive = await sandbox.exec('kill -0 "$(cat keep.pid)" && echo alive')
        assert alive.stdout == "alive\n"

    async def test_concurrent_execs_across_sandboxes(self, backend: Backend) -> None:
        boxes = [backend.create({"rollout.sample": f"c{n}"}) for n in range(3)]
        await asyncio.gather(*(box.start() for box in boxes))
        try:

            async def one(box: Sandbox, n: int) -> None:
                result = await box.exec(["sh", "-c", f"cat; echo {n}"], stdin=f"{box.id}-{n}\n")
                assert result.stdout == f"{box.id}-{n}\n{n}\n", result

            await asyncio.gather(*(one(box, n) for box in boxes for n in range(4)))
        finally:
            await asyncio.gather(*(box.stop() for box in boxes))

    async def test_files_roundtrip(self, sandbox: Sandbox) -> None:
        payload = bytes(range(256)) * 4
        await sandbox.write_file("deep/er/data.bin", payload)
        assert await sandbox.read_file("deep/er/data.bin") == payload
        assert await sandbox.read_file(f"{sandbox.workdir}/deep/er/data.bin") == payload
        listed = await sandbox.exec("wc -c < deep/er/data.bin")
        assert listed.stdout.strip() == "1024"

        await sandbox.write_file("run.sh", "#!/bin/sh\necho ran $1\n", mode=0o755)
        assert (await sandbox.exec(["./run.sh", "ok"])).stdout == "ran ok\n"

        await sandbox.exec("echo made by a command > made.txt")
        assert await sandbox.read_file("made.txt") == b"made by a command\n"
        await sandbox.write_file("made.txt", "overwritten")
        assert (await sandbox.exec("cat made.txt")).stdout == "overwritten"

    async def test_file_errors(self, sandbox: Sandbox) -> None:
        with pytest.raises(SandboxError, match="does not exist") as missing:
            await sandbox.read_file("nope.txt")
        assert not isinstance(missing.value, SandboxEscape)
        await sandbox.exec("mkdir adir")
        with pytest.raises(SandboxError, match="not a regular file|is a directory"):
            await sandbox.read_file("adir")
        with pytest.raises(SandboxError, match="byte"):
            await sandbox.write_file("huge", b"x" * (TEST_LIMITS.max_file_bytes + 1))

    @pytest.mark.parametrize(
        "path", ["../x", "a/../../x", "/etc/passwd", "/tmp/rollout-escape-x", "{workdir}-evil/x"]
    )
    async def test_paths_outside_are_refused(self, sandbox: Sandbox, path: str) -> None:
        path = path.format(workdir=sandbox.workdir)
        with pytest.raises(SandboxEscape, match="outside the sandbox workdir"):
            await sandbox.read_file(path)
        with pytest.raises(SandboxEscape, match="outside the sandbox workdir"):
            await sandbox.write_file(path, "escaped")

    async def test_symlinks_out_are_refused_and_in_are_followed(self, sandbox: Sandbox) -> None:
        setup = await sandbox.exec(
            "ln -s /etc etc_link && ln -s /etc/passwd pw && ln -s ../../../../../../.. up "
            "&& mkdir d && echo inside > d/f.txt && ln -s f.txt d/alias && ln -s d dir_alias"
        )
        assert setup.exit_code == 0, setup.stderr
        for path in ("etc_link/passwd", "pw", "up/etc/passwd"):
            with pytest.raises(SandboxEscape, match=r"symlink|resolves to"):
                await sandbox.read_file(path)
        for path in ("etc_link/rollout-escape", "pw"):
            with pytest.raises(SandboxEscape):
                await sandbox.write_file(path, "escaped")
        assert await sandbox.read_file("d/alias") == b"inside\n"
        assert await sandbox.read_file("dir_alias/f.txt") == b"inside\n"
        await sandbox.write_file("d/alias", "through the link")
        assert await sandbox.read_file("d/f.txt") == b"through the link"

    async def test_lifecycle_errors(self, backend: Backend) -> None:
        box = backend.create()
        with pytest.raises(SandboxError, match="is new"):
            await box.exec("true")
        await box.start()
        await box.start()  # idempotent
        await box.stop()
        await box.stop()  # idempotent
        with pytest.raises(SandboxError, match="is stopped"):
            await box.exec("true")
        with pytest.raises(SandboxError, match="is stopped"):
            await box.read_file("x")
        with pytest.raises(SandboxError, match="cannot start again"):
            await box.start()

    async def test_stop_removes_everything(self, backend: Backend) -> None:
        labels = {"rollout.sample": "stop-me"}
        box = backend.create(labels)
        await box.start()
        await box.exec("sleep 996 >/dev/null 2>&1 &")
        await box.write_file("state.txt", "x")
        assert await backend.provider.find(backend.labels(labels)) == [box.id]
        await box.stop()
        assert await backend.provider.find(backend.labels(labels)) == []
        assert await backend.provider.reap(backend.labels(labels)) == 0

    async def test_reap_by_labels(self, backend: Backend) -> None:
        boxes = {
            ("w1", "s1"): backend.create({"rollout.worker": "w1", "rollout.sample": "s1"}),
            ("w1", "s2"): backend.create({"rollout.worker": "w1", "rollout.sample": "s2"}),
            ("w2", "s3"): backend.create({"rollout.worker": "w2", "rollout.sample": "s3"}),
        }
        for box in boxes.values():
            await box.start()
            await box.exec("sleep 997 >/dev/null 2>&1 &")
        provider = backend.provider
        w1 = backend.labels({"rollout.worker": "w1"})
        assert sorted(await provider.find(w1)) == sorted(
            [boxes["w1", "s1"].id, boxes["w1", "s2"].id]
        )
        assert await provider.reap(w1) == 2
        assert await provider.find(w1) == []
        with pytest.raises(SandboxError):
            await boxes["w1", "s1"].exec("true")
        survivor = boxes["w2", "s3"]
        assert (await survivor.exec("echo alive")).stdout == "alive\n"
        assert await provider.reap(backend.labels({"rollout.sample": "s3"})) == 1
        assert await provider.reap(w1) == 0
        for box in boxes.values():
            await box.stop()  # the owner stopping a reaped sandbox is not an error

    async def test_reap_refuses_an_empty_selector(self, backend: Backend) -> None:
        with pytest.raises(SandboxError, match="empty label selector"):
            await backend.provider.reap({})

    async def test_bad_labels_are_refused(self, backend: Backend) -> None:
        with pytest.raises(SandboxError, match="label key"):
            backend.provider.create(labels={"has space": "x"})
        with pytest.raises(SandboxError, match="newline"):
            backend.provider.create(labels={"ok": "line\nbreak"})
