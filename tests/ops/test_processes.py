"""The launcher of the engine's processes (``engine.ops.processes``), on real processes."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.errors import ConfigError, EngineError
from engine.ops.processes import Processes, settings_env
from workers.cli import ROLLOUT

ROOT = Path(__file__).resolve().parents[2]
SECRET_URL = "redis://engine:s3cret-password@127.0.0.1:1/0"


def launcher(
    tmp_path: Path, settings: dict[str, object] | None = None, grace_s: float = 20.0
) -> Processes:
    return Processes(tmp_path / "logs", rollout=ROLLOUT, settings=settings,
                     env={"PYTHONPATH": str(ROOT)}, grace_s=grace_s)


def _cmdline(pid: int) -> str:
    """``/proc/PID/cmdline`` once the child's exec has set it up: Popen may return (its
    vfork parent resumes) before the new program's arguments are in place."""
    deadline = time.monotonic() + 10
    while True:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        if raw or time.monotonic() > deadline:
            return raw.replace(b"\0", b" ").decode()
        time.sleep(0.01)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_settings_become_their_variables_and_an_unknown_one_is_refused() -> None:
    assert settings_env({"heartbeat_ms": 100, "quiet": True, "sglang_url": ["a", "b"],
                         "out_dir": Path("/o"), "evaluators": None}) == {
        "ROLLOUT_HEARTBEAT_MS": "100", "ROLLOUT_QUIET": "true",
        "ROLLOUT_SGLANG_URL": "a,b", "ROLLOUT_OUT_DIR": "/o", "ROLLOUT_EVALUATORS": ""}
    with pytest.raises(ConfigError, match="'heartbeat' is not a setting"):
        settings_env({"heartbeat": 100})


def test_a_bad_setting_fails_before_anything_starts(tmp_path: Path) -> None:
    with launcher(tmp_path, settings={"heartbeat_ms": 5000, "claim_idle_ms": 1000}) as procs:
        with pytest.raises(ConfigError, match="w1: .*ROLLOUT_HEARTBEAT_MS"):
            procs.start("w1", "worker")
        assert list(procs) == []


def test_secrets_travel_in_the_environment_and_this_process_rollout_variables_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLOUT_STREAM_PREFIX", "mine")
    with launcher(tmp_path, settings={"redis_url": SECRET_URL}) as procs:
        # An engine process that cannot reach Redis: it stays up, retrying.
        proc = procs.start("fin", "finalizer", "--worker-id", "f1")
        cmdline = _cmdline(proc.pid)
        assert proc.argv[1:] == (*ROLLOUT, "finalizer", "--worker-id", "f1")
        assert "s3cret" not in cmdline and "finalizer --worker-id f1" in cmdline
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert f"ROLLOUT_REDIS_URL={SECRET_URL}".encode() in environ
        assert not any(v.startswith(b"ROLLOUT_STREAM_PREFIX=") for v in environ)
        assert procs.alive("fin")


def test_a_process_that_dies_is_named_with_its_last_lines(tmp_path: Path) -> None:
    with launcher(tmp_path) as procs:
        procs.spawn("ok", python("import time; time.sleep(60)"))
        procs.spawn("bad", python("import sys; print('line one'); print('it broke'); "
                                  "sys.exit(3)"))
        assert procs.wait("bad", 30) == 3
        with pytest.raises(EngineError) as died:
            procs.check_alive()
        message = str(died.value)
        assert "bad exited with status 3" in message and "it broke" in message
        assert str(tmp_path / "logs" / "bad.log") in message
        assert procs.output("bad") == "line one\nit broke\n"
        # A process stopped on request is not a death.
        assert procs.kill("ok") == -signal.SIGKILL
        procs.restart("bad")
        assert procs.wait("bad", 30) == 3
        assert procs.output("bad").count("it broke") == 2  # a restart appends to the log


def test_stop_escalates_to_sigkill_and_restart_takes_a_new_name(tmp_path: Path) -> None:
    stubborn = python("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "print('up', flush=True); time.sleep(60)")
    procs = launcher(tmp_path, grace_s=0.5)
    first = procs.spawn("a", stubborn)
    while "up" not in procs.output("a"):
        time.sleep(0.05)
    assert procs.terminate("a") == -signal.SIGKILL
    again = procs.restart("a", as_name="b", settings={"worker_id": "b"})
    assert list(procs) == ["b"] and again.argv == first.argv
    assert again.env["ROLLOUT_WORKER_ID"] == "b"
    with pytest.raises(EngineError, match="'b' is running"):
        procs.spawn("b", stubborn)
    procs.stop()
    assert again.popen.returncode is not None and list(procs) == []


def test_model_servers_and_rollout_serve_are_stopped_after_the_engine_processes(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "server-got-sigterm"
    server = python(
        "import pathlib, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marker)!r}).touch(), "
        "sys.exit(0)))\nprint('up', flush=True)\ntime.sleep(60)"
    )
    worker = python(  # on SIGTERM, a last call: is the server still up?
        "import pathlib, signal, sys, time\n"
        "def last(*_):\n    time.sleep(0.3)\n"
        f"    print('server up' if not pathlib.Path({str(marker)!r}).exists() else 'server gone',"
        " flush=True)\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, last)\nprint('up', flush=True)\ntime.sleep(60)"
    )
    procs = launcher(tmp_path)
    assert procs.start("serve", "serve").serves  # rollout serve counts as a server
    procs.spawn("server", server, serves=True)
    procs.spawn("worker", worker)
    while not all("up" in procs.output(n) for n in ("server", "worker")):
        time.sleep(0.05)
    log = procs["worker"].log
    procs.stop()
    assert log.read_text().split() == ["up", "server", "up"]
    assert marker.exists()


@pytest.mark.slow
def test_a_model_server_is_served_on_a_reserved_port_and_restarted_on_it(
    tmp_path: Path, tinylm_dir: Path
) -> None:
    with launcher(tmp_path) as procs:
        server = procs.serve_tinylm("tinylm", tinylm_dir, "--weight-version", "3")
        info = httpx.get(server.url + "/get_model_info", timeout=30).json()
        assert info["weight_version"] == "3"
        assert procs.kill("tinylm") == -signal.SIGKILL
        again = procs.restart("tinylm")  # returns once it answers again
        assert again.url == server.url and again.pid != server.pid
        assert httpx.get(server.url + "/get_model_info", timeout=30).status_code == 200
