"""The tiny model server's weight-sync routes, against SGLang 0.5.23's shapes and semantics.

Sources (SGLang 0.5.23 wheel): ``srt/entrypoints/http_server.py`` (routes, replies, status
codes), ``srt/managers/io_struct.py`` (``UpdateWeightFromDiskReqInput`` / ``...ReqOutput``,
``PauseGenerationReqInput``), ``srt/managers/tokenizer_manager.py``
(``update_weights_from_disk``: ``abort_all_requests``, then the writer side of
``model_update_lock`` unless paused; ``weight_version`` read into every ``meta_info``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.backends.test_tinylm_server import LONG, PROMPT, generate, wait_until
from tinylm.server import TinyLMServer, start_server

ADMIN = "weights-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


def perturbed_copy(src: Path, dst: Path, *, seed: int, scale: float = 0.05) -> Path:
    """An HF folder like ``src`` whose every weight moved by seeded noise (a trainer step)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    moved = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(moved, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def step1_dir(tinylm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_copy(tinylm_dir, tmp_path_factory.mktemp("step1") / "model", seed=1)


@pytest.fixture
def server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tinylm_dir, max_running_requests=4, admin_api_key=ADMIN) as srv:
        yield srv


def admin(server: TinyLMServer, route: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(server.url + route, json=body or {}, headers=AUTH, timeout=120)


def scores(server: TinyLMServer) -> tuple[list[float], str]:
    """Logprobs of PROMPT's tokens under the served weights, and the reply's weight_version."""
    reply = generate(
        server,
        input_ids=PROMPT,
        return_logprob=True,
        logprob_start_len=0,
        sampling_params={"max_new_tokens": 0},
    )
    meta = reply["meta_info"]
    return [e[0] for e in meta["input_token_logprobs"][1:]], meta["weight_version"]


def version(server: TinyLMServer) -> str:
    response = httpx.get(server.url + "/get_weight_version")
    assert response.status_code == 200
    return str(response.json()["weight_version"])


def test_update_from_disk_changes_logprobs_and_the_reported_version(
    server: TinyLMServer, tinylm_dir: Path, step1_dir: Path
) -> None:
    before, v0 = scores(server)
    assert v0 == "default" == version(server)  # SGLang's --weight-version default
    assert httpx.get(server.url + "/get_model_info").json()["weight_version"] == "default"

    reply = admin(
        server, "/update_weights_from_disk", {"model_path": str(step1_dir), "weight_version": "1"}
    )
    assert reply.status_code == 200
    assert reply.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 1.",
        "num_paused_requests": 0,
    }
    after, v1 = scores(server)
    assert v1 == "1" == version(server)
    info = httpx.get(server.url + "/get_model_info").json()
    assert (info["weight_version"], info["model_path"]) == ("1", str(step1_dir))
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3

    # No weight_version: the weights change, the version stays (SGLang keeps the old one).
    assert admin(server, "/update_weights_from_disk", {"model_path": str(tinylm_dir)}).json()[
        "success"
    ]
    back, v_back = scores(server)
    assert v_back == "1"
    assert back == before  # the same weights again give the same logprobs, bit for bit


def test_a_failed_update_keeps_the_old_weights_and_version(
    server: TinyLMServer, tmp_path: Path, tinylm_dir: Path
) -> None:
    before, _ = scores(server)
    missing = admin(
        server,
        "/update_weights_from_disk",
        {"model_path": str(tmp_path / "nope"), "weight_version": "9"},
    )
    assert missing.status_code == 400
    assert missing.json()["success"] is False
    assert "missing config.json" in missing.json()["message"]

    wider = shutil.copytree(tinylm_dir, tmp_path / "wider")
    config = (
        (wider / "config.json")
        .read_text()
        .replace('"num_hidden_layers": 2', '"num_hidden_layers": 3')
    )
    (wider / "config.json").write_text(config)
    other = admin(
        server, "/update_weights_from_disk", {"model_path": str(wider), "weight_version": "9"}
    )
    assert other.status_code == 400
    assert "num_layers" in other.json()["message"]

    bad = admin(
        server,
        "/update_weights_from_disk",
        {"model_path": str(tinylm_dir), "abort_all_requests": "yes"},
    )
    assert bad.status_code == 400 and "abort_all_requests" in bad.json()["message"]
    assert scores(server) == (before, "default")


def test_an_update_waits_for_requests_in_flight(server: TinyLMServer, step1_dir: Path) -> None:
    """Without ``abort_all_requests`` the update takes ``model_update_lock``'s writer side: a
    running request finishes on the old weights and reports the old version."""
    # What the server was running when the update answered: the request must be gone by
    # then (the order in which the two HTTP replies reach their client threads is not
    # the server's to decide, so it is not what this test compares).
    running_at_update: list[list[str]] = []
    body = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="old", sampling_params=body)
        wait_until(lambda: "old" in server.scheduler.running_rids(), "the request to run")
        update = pool.submit(
            admin,
            server,
            "/update_weights_from_disk",
            {"model_path": str(step1_dir), "weight_version": "1"},
        )
        update.add_done_callback(
            lambda _: running_at_update.append(list(server.scheduler.running_rids()))
        )
        assert update.result(timeout=120).status_code == 200
        reply = running.result(timeout=120)
    assert running_at_update and "old" not in running_at_update[0]
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 400}
    assert reply["meta_info"]["weight_version"] == "default"
    assert version(server) == "1"


def test_abort_all_requests_aborts_them_before_the_update(
    server: TinyLMServer, step1_dir: Path
) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="long", sampling_params=LONG)
        wait_until(lambda: "long" in server.scheduler.running_rids(), "the request to run")
        update = admin(
            server,
            "/update_weights_from_disk",
            {"model_path": str(step1_dir), "weight_version": "2", "abort_all_requests": True},
        )
        reply = running.result(timeout=120)
    assert update.json()["success"] is True
    assert reply["meta_info"]["finish_reason"]["type"] == "abort"


def test_paused_in_place_the_update_lands_at_once_and_requests_continue_on_it(
    server: TinyLMServer, step1_dir: Path
) -> None:
    body = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="kept", sampling_params=body)
        wait_until(lambda: "kept" in server.scheduler.running_rids(), "the request to run")
        paused = admin(server, "/pause_generation", {"mode": "in_place"})
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        # In flight and paused: flushing is refused, the update does not wait for it.
        flush = admin(server, "/flush_cache")
        assert flush.status_code == 400
        assert flush.headers["content-type"].startswith("text/plain")
        # flush_cache=false: the default would flush after the swap and fail on "kept"
        # (see the next test).
        update = admin(
            server,
            "/update_weights_from_disk",
            {"model_path": str(step1_dir), "weight_version": "3", "flush_cache": False},
        )
        assert update.json()["success"] is True
        assert not running.done()
        assert admin(server, "/continue_generation").json()["status"] == "ok"
        reply = running.result(timeout=120)
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    assert reply["meta_info"]["weight_version"] == "3"
    flushed = admin(server, "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")


def test_an_update_that_cannot_flush_the_cache_fails_though_the_weights_changed(
    server: TinyLMServer, tinylm_dir: Path, step1_dir: Path
) -> None:
    """SGLang 0.5.23: ``WeightUpdater.update_weights_from_disk`` records the new version on the
    scheduler, then ``flush_cache_after_weight_update`` fails the call while a request runs;
    ``TokenizerManager.update_weights_from_disk`` then keeps its model path and version."""
    body = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="held", sampling_params=body)
        wait_until(lambda: "held" in server.scheduler.running_rids(), "the request to run")
        admin(server, "/pause_generation", {"mode": "in_place"})
        update = admin(
            server,
            "/update_weights_from_disk",
            {"model_path": str(step1_dir), "weight_version": "5"},
        )
        assert update.status_code == 400
        assert update.json() == {
            "success": False,
            "message": "Weights were updated, but the cache was not flushed because requests "
            "are still running or queued. Retract or finish them, then call /flush_cache.",
            "num_paused_requests": 0,
        }
        info = httpx.get(server.url + "/get_model_info").json()
        assert (info["weight_version"], info["model_path"]) == ("default", str(tinylm_dir))
        assert version(server) == "default"
        admin(server, "/continue_generation")
        reply = running.result(timeout=120)
    # The scheduler's view: the request finished on the new weights, reported as "5".
    assert reply["meta_info"]["weight_version"] == "5"
    spans = reply["meta_info"]["weight_versions"]
    assert spans[-1]["version"] == "5" and spans[-1]["end"] == 300
    _, reported = scores(server)
    assert reported == "5" and version(server) == "default"


def test_pause_abort_mode_aborts_and_new_requests_wait_for_continue(server: TinyLMServer) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(generate, server, input_ids=PROMPT, rid="cut", sampling_params=LONG)
        wait_until(lambda: "cut" in server.scheduler.running_rids(), "the request to run")
        assert admin(server, "/pause_generation").status_code == 200  # mode defaults to abort
        assert running.result(timeout=120)["meta_info"]["finish_reason"]["type"] == "abort"
        later = pool.submit(
            generate, server, input_ids=PROMPT, rid="later", sampling_params={"max_new_tokens": 2}
        )
        # It has not reached the scheduler: it waits for /continue_generation.
        assert "later" not in server.scheduler.running_rids() and not later.done()
        admin(server, "/continue_generation")
        assert later.result(timeout=120)["meta_info"]["completion_tokens"] == 2
    retract = admin(server, "/pause_generation", {"mode": "retract"})
    assert retract.status_code == 400 and "retract" in retract.json()["message"]


def test_weight_routes_are_admin_routes(server: TinyLMServer, step1_dir: Path) -> None:
    for route in (
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
    ):
        response = httpx.post(server.url + route, json={"model_path": str(step1_dir)})
        assert response.status_code == 401, route
    assert version(server) == "default"
