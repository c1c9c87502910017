"""Past the outage limit every process gives up with a clear fatal error (exit 1), instead
of retrying forever or dying with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.ops.embedded import free_port
from tests.faults.harness import EVALUATORS, ROOT

pytestmark = [pytest.mark.slow]


def test_every_process_exits_with_a_clear_error_past_the_outage_limit(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "q", "label": "1"}\n', encoding="utf-8")
    config = tmp_path / "rollout.yaml"
    config.write_text(f"rollout:\n  datasets:\n    p: {{path: {data}, task_type: fault}}\n",
                      encoding="utf-8")
    common = ["--redis-url", url, "--outage-limit-s", "1.5", "--block-ms", "200"]
    commands = {
        "scheduler": ["workers.scheduler", *common, "--rollout-config", str(config),
                      "--evaluator-config", str(EVALUATORS)],
        "evaluator": ["workers.evaluator", *common, "--evaluator-config", str(EVALUATORS),
                      "--sandbox", "none", "--worker-id", "w1"],
        "finalizer": ["workers.finalizer", *common, "--worker-id", "f1"],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    env["PYTHONPATH"] = str(ROOT)
    procs = {
        name: subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for name, argv in commands.items()
    }
    try:
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=60)
            text = err.decode()
            assert proc.returncode == 1, (name, text)
            assert "longer than the outage limit of 1.5 s" in text, (name, text)
            assert "Traceback" not in text, (name, text)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
