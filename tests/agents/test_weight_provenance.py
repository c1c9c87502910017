"""Per-turn weight provenance from the server, end to end, with a real tinylm subprocess.

A trainer publishes new weights between the two turns of a tool-agent episode (the model
server's ``/update_weights_from_disk``, as SGLang 0.5.23 serves it). The agent must record,
per turn, the ``weight_version`` the server reported -- not one taken from the request -- and
the sample must carry it per token through the events, ``Sample``, ``collate`` and the
``RolloutReady`` spread. Re-scoring the first turn's tokens after the update gives other
logprobs: the weights really changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.actors.finalizer import decide_ready
from engine.actors.outcomes import Attempt, completed_events
from engine.agents.result import UNKNOWN_VERSION, AgentResult
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.client import collate
from engine.events import (
    Envelope,
    Event,
    RolloutPlanned,
    RolloutRequested,
    SampleCompleted,
    TaskFetched,
    TurnCompleted,
)
from engine.projections.base import fold, start
from engine.projections.readback import in_memory
from engine.projections.rollout import RolloutProjection
from engine.projections.samples import trainer_samples
from engine.sandbox import LocalSandboxProvider
from tests.agents.conftest import make_context, make_task
from tests.agents.test_tool_agent_tinylm import Harness
from tests.backends.test_tinylm_weights import perturbed_copy
from tinylm.process import spawn_server
from tinylm.server import start_server

ADMIN = "provenance-admin-key"


@pytest.fixture(scope="module")
def stepped_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(model_dir, tmp_path_factory.mktemp("stepped") / "model", seed=7)


class UpdateAfterFirstTurn(httpx.AsyncBaseTransport):
    """Real HTTP; once the first ``/generate`` reply is in, the "trainer" loads ``model_path``
    on the server as version ``version`` before the agent's next call goes out."""

    def __init__(self, url: str, model_path: Path, version: str, replies: list[Any]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._url, self._path, self._version = url, model_path, version
        self._replies = replies
        self.updates: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        body = await response.aread()
        if request.url.path == "/generate":
            self._replies.append(httpx.Response(200, content=body).json())
            if not self.updates:
                async with httpx.AsyncClient(timeout=120) as client:
                    update = await client.post(
                        self._url + "/update_weights_from_disk",
                        json={"model_path": str(self._path), "weight_version": self._version},
                        headers={"Authorization": f"Bearer {ADMIN}"},
                    )
                self.updates.append(update.json())
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _segments(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of sampled (mask 1) tokens: one per generated turn."""
    out: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (not out or out[-1][1] != i):
            out.append((i, i + 1))
        elif m:
            out[-1] = (out[-1][0], i + 1)
    return out


def _rollout_events(result: AgentResult, reward: Any) -> list[Event]:
    task = make_task()
    events: list[Event] = [
        RolloutRequested(rollout_id=task.rollout_id, n_prompts=1, n_samples_per_prompt=1),
        TaskFetched(
            rollout_id=task.rollout_id, sample_id=task.sample_id, index=0, group_index=0,
            prompt=task.prompt, dataset=task.dataset_name, task_type=task.task_type,
        ),
        RolloutPlanned(rollout_id=task.rollout_id, n_samples=1, n_batches=1),
    ]
    events += completed_events(
        rollout_id=task.rollout_id, sample_id=task.sample_id, attempt=1, rec=Attempt(),
        result=result, reward=reward, policy_version=5, causation=None,
    )
    return events


async def test_a_mid_episode_update_changes_the_recorded_versions_and_logprobs(
    model_dir: Path, stepped_dir: Path, tokenizer: Any, provider: LocalSandboxProvider,
    tmp_path: Path,
) -> None:
    with spawn_server(
        model_dir, extra_args=["--weight-version", "0"], env={"TINYLM_ADMIN_API_KEY": ADMIN}
    ) as proc:
        harness = Harness(tokenizer, proc.url)
        transport = UpdateAfterFirstTurn(proc.url, stepped_dir, "1", harness.replies)
        harness.backends = BackendPool(
            proc.url,
            build=lambda url: SGLangBackend(
                config=SGLangConfig(url=url), tokenizer=tokenizer, transport=transport
            ),
        )
        task = make_task()
        ctx = make_context(task, sandboxes=provider, tmp_path=tmp_path, backends=harness.backends)
        result, reward = await harness.run(task, ctx)

        # The trained model calls python on turn 0, so there is a turn 1 after the update.
        assert transport.updates and transport.updates[0]["success"] is True
        assert len(result.turns) == 2
        assert [r["meta_info"]["weight_version"] for r in harness.replies] == ["0", "1"]
        assert [t.weight_version for t in result.turns] == [0, 1]

        # Per token: turn 0's tokens are version 0, the observation -1, turn 1's version 1.
        mask = result.loss_mask.tolist()
        versions = result.response_versions.tolist()
        (a0, b0), (a1, b1) = _segments(mask)
        assert set(versions[a0:b0]) == {0} and set(versions[a1:b1]) == {1}
        assert set(versions[b0:a1]) == {UNKNOWN_VERSION}

        # The same tokens of turn 0, scored under the new weights, get other logprobs.
        prompt = result.prompt_token_ids.tolist()
        turn0 = result.response_token_ids.tolist()[a0:b0]
        rescored = httpx.post(
            proc.url + "/generate",
            json={
                "input_ids": prompt + turn0,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": len(prompt) - 1,
            },
            timeout=120,
        ).json()
        assert rescored["meta_info"]["weight_version"] == "1"
        new = np.array([e[0] for e in rescored["meta_info"]["input_token_logprobs"][1:]])
        old = np.array(result.response_logprobs.tolist()[a0:b0])
        assert new.shape == old.shape and float(np.abs(new - old).max()) > 1e-3

    # Through the log: TurnCompleted and SampleCompleted carry the versions; the trainer's
    # sample, collate's tensor and RolloutReady's spread follow from them.
    events = _rollout_events(result, reward)
    assert [e.weight_version for e in events if isinstance(e, TurnCompleted)] == [0, 1]
    done = next(e for e in events if isinstance(e, SampleCompleted))
    assert done.token_versions == result.response_versions
    envs = [Envelope("s", f"{i + 1}-0", ev) for i, ev in enumerate(events)]
    projection = RolloutProjection()
    ready = decide_ready(fold(projection, start(projection), envs).state)
    assert ready is not None
    assert ready.version_tokens == {"0": b0 - a0, "1": b1 - a1}
    envs.append(Envelope("s", f"{len(envs) + 1}-0", ready))
    projection = RolloutProjection()
    (sample,) = trainer_samples(in_memory(fold(projection, start(projection), envs).state, envs))
    assert sample.token_versions == result.response_versions
    batch = collate([sample])
    row = batch["token_versions"][0].tolist()
    n_prompt = len(prompt)
    assert row[:n_prompt] == [UNKNOWN_VERSION] * n_prompt
    assert row[n_prompt:] == versions


async def test_a_server_that_reports_no_version_is_recorded_as_unknown(
    model_dir: Path, stepped_dir: Path, tokenizer: Any
) -> None:
    """tinylm without ``--weight-version`` reports SGLang's ``"default"``: not an integer
    version, so unknown (None), never the version the rollout request named."""
    with start_server(model_dir, max_running_requests=2) as server:
        backend = SGLangBackend(config=SGLangConfig(url=server.url), tokenizer=tokenizer)
        try:
            params = {"max_new_tokens": 4, "temperature": 0.0}
            first = await backend.generate(input_ids=[1, 2, 3], sampling_params=params)
            assert first.weight_version is None
            update = httpx.post(
                server.url + "/update_weights_from_disk",
                json={"model_path": str(stepped_dir), "weight_version": "12"},
                timeout=120,
            )
            assert update.status_code == 200
            second = await backend.generate(input_ids=[1, 2, 3], sampling_params=params)
            assert second.weight_version == 12
        finally:
            await backend.aclose()
