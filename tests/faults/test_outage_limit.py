"""Past the outage limit every process gives up with a clear fatal error (exit 1), instead
of retrying forever or dying with a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.ops.embedded import free_port
from engine.ops.processes import Processes
from tests.faults.harness import EVALUATORS, ROOT
from workers.cli import ROLLOUT

pytestmark = [pytest.mark.slow]


def test_every_process_exits_with_a_clear_error_past_the_outage_limit(tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "q", "label": "1"}\n', encoding="utf-8")
    config = tmp_path / "rollout.yaml"
    config.write_text(f"rollout:\n  datasets:\n    p: {{path: {data}, task_type: fault}}\n",
                      encoding="utf-8")
    settings = {"redis_url": url, "outage_limit_s": 1.5, "block_ms": 200}
    with Processes(tmp_path / "logs", rollout=ROLLOUT, settings=settings,
                   env={"PYTHONPATH": str(ROOT)}) as procs:
        procs.start("scheduler", "scheduler", "--rollout-config", str(config),
                    "--evaluator-config", str(EVALUATORS))
        procs.start("evaluator", "worker", "--evaluator-config", str(EVALUATORS),
                    "--sandbox", "none", "--worker-id", "w1")
        procs.start("finalizer", "finalizer", "--worker-id", "f1")
        for name in procs:
            code = procs.wait(name, timeout=60)
            text = procs.output(name)
            assert code == 1, (name, text)
            assert "longer than the outage limit of 1.5 s" in text, (name, text)
            assert "Traceback" not in text, (name, text)
