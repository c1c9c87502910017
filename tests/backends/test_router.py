"""The real ``sglang-router`` (PyPI ``sglang-router``, the ``router`` extra) in front of two
tinylm servers: what a deployment with several model servers runs.

The router forwards ``/generate`` as is and rewrites ``/v1/chat/completions`` into SGLang's
request model, adding fields such as ``separate_reasoning`` and ``return_hidden_states``
(sglang-router 0.3.2); tinylm accepts them as SGLang does. Skipped when the router's binary is
not installed.
"""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.backends import OpenAIBackend, OpenAIConfig, SGLangBackend, SGLangConfig
from tests.backends.test_tinylm_server import PROMPT
from tinylm.server import TinyLMServer, start_server

ROUTER = shutil.which("sglang-router")
pytestmark = pytest.mark.skipif(ROUTER is None, reason="sglang-router is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, process: subprocess.Popen[bytes], limit_s: float = 60.0) -> None:
    """Poll until the router answers a generation (the limit only turns a hang into a failure)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"sglang-router exited with {process.returncode}")
        try:
            probe = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
            if httpx.post(url + "/generate", json=probe, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("sglang-router never served a generation")


@pytest.fixture(scope="module")
def servers(tinylm_dir: Path) -> Iterator[tuple[TinyLMServer, TinyLMServer]]:
    with start_server(tinylm_dir) as a, start_server(tinylm_dir) as b:
        yield a, b


@pytest.fixture(scope="module")
def router(servers: tuple[TinyLMServer, TinyLMServer]) -> Iterator[str]:
    assert ROUTER is not None
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        ROUTER, "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(s.url for s in servers), "--policy", "round_robin",
        "--log-level", "warn",
    ]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def test_token_level_generation_through_the_router_reaches_both_servers(
    router: str, servers: tuple[TinyLMServer, TinyLMServer]
) -> None:
    before = [s.scheduler.steps for s in servers]
    backend = SGLangBackend(config=SGLangConfig(url=router))
    greedy = {"max_new_tokens": 4, "temperature": 0.0}
    results = [await backend.generate(input_ids=PROMPT, sampling_params=greedy) for _ in range(4)]
    await backend.aclose()
    assert {r.token_ids for r in results} == {results[0].token_ids}  # same model, greedy
    assert all(len(r.token_ids or ()) == 4 and r.logprobs for r in results)
    assert all(s.scheduler.steps > b for s, b in zip(servers, before, strict=True))


async def test_chat_through_the_router_with_the_fields_it_adds(router: str) -> None:
    backend = OpenAIBackend(config=OpenAIConfig(base_url=router + "/v1", model="tinylm"))
    result = await backend.generate(
        messages=[{"role": "user", "content": "hello"}],
        sampling_params={"max_new_tokens": 3, "temperature": 0.0},
    )
    await backend.aclose()
    assert result.usage is not None and result.usage.completion_tokens <= 3
    assert result.finish_reason in ("stop", "length")


def test_the_openai_sdk_streams_through_the_router(router: str) -> None:
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        c.chat.completions.create(
            model="tinylm",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=3,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_compose_puts_the_router_in_front_and_seeds_are_honoured() -> None:
    """compose.yaml's `router` profile, and the SGLang flag per-sample seeds need."""
    import yaml

    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose not installed")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [binary, "-f", str(root / "compose.yaml"), "--profile", "router", "--profile", "gpu",
         "config"],
        capture_output=True, text=True, timeout=60, check=False, cwd=root,
        env={"PATH": "/usr/bin:/bin", "SGLANG_WORKER_URLS": "http://g1:30000 http://g2:30000",
             "ROLLOUT_SGLANG_URL": "http://router:30000"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    router = services["router"]["command"]
    router = shlex.split(router) if isinstance(router, str) else router
    at = router.index("--worker-urls")
    assert router[at + 1 : at + 3] == ["http://g1:30000", "http://g2:30000"]
    assert services["evaluator"]["environment"]["ROLLOUT_SGLANG_URL"] == "http://router:30000"
    # SGLang uses sampling_params.sampling_seed only with deterministic inference
    # (sglang/srt/sampling/sampling_batch_info.py: enable_deterministic_inference).
    sglang = services["sglang"]["command"]
    assert "--enable-deterministic-inference" in (
        shlex.split(sglang) if isinstance(sglang, str) else sglang
    )
